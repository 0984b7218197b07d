// Package held keeps the events that arrive for a child session before the
// Manager can apply them: a host may report a session's first events while
// the StartSession call that creates it has not returned, so the session is
// not bound to its attempt yet.
//
// An event is held under one key: the attempt it names, or, when it names
// only its session, that session. Each key holds at most the limit given
// to New. At the limit, an event that does not end a run (liveness) is
// refused, but an event that ends one is never lost to the bound: it takes
// the place of the oldest liveness event held for its key or, when only run
// ends are held there, is held past the limit (up to twice it). At the
// limit, an end is refused (in either case) when the same run's end is held
// already — for an attempt key any end of that attempt, for a session key
// an end of that session: a run ends once. Session-keyed events are bounded all
// together, attempt-keyed ones per attempt, so events for other sessions
// never crowd out an event that names its attempt.
//
// A Set is not safe for concurrent use: the Manager guards it with its lock.
package held

// Event is one held event.
type Event[T any] struct {
	V       T
	Attempt string // the attempt it named; "" when keyed by its session
	Session string
	Ends    bool   // it ends a run
	Horizon uint64 // the last session start issued when it arrived
}

// Set is the events held now, in arrival order.
type Set[T any] struct {
	limit     int
	items     []Event[T]
	bySession int
	byAttempt map[string]int
	out       []T // Take's result, reused
}

// New returns an empty Set holding at most limit events per key (limit ≥ 1).
func New[T any](limit int) *Set[T] {
	return &Set[T]{limit: max(limit, 1), byAttempt: make(map[string]int)}
}

// Len reports how many events are held.
func (s *Set[T]) Len() int { return len(s.items) }

// BySession reports how many events are held keyed by session.
func (s *Set[T]) BySession() int { return s.bySession }

// ForAttempt reports how many events are held for the attempt.
func (s *Set[T]) ForAttempt(id string) int { return s.byAttempt[id] }

func (s *Set[T]) count(attempt string) int {
	if attempt == "" {
		return s.bySession
	}
	return s.byAttempt[attempt]
}

func (s *Set[T]) add(attempt string, d int) {
	if attempt == "" {
		s.bySession += d
		return
	}
	if n := s.byAttempt[attempt] + d; n > 0 {
		s.byAttempt[attempt] = n
	} else {
		delete(s.byAttempt, attempt)
	}
}

// Hold keeps ev and reports true, or refuses it (false) at the bound. When
// it gave up a held liveness event to make room for ev, that event's value
// is returned as dropped, with gaveUp true.
func (s *Set[T]) Hold(ev Event[T]) (dropped T, gaveUp, ok bool) {
	n := s.count(ev.Attempt)
	if n >= s.limit {
		if !ev.Ends {
			return dropped, false, false
		}
		victim := -1
		for i, h := range s.items {
			if h.Attempt != ev.Attempt {
				continue // another key
			}
			if !h.Ends {
				if victim < 0 {
					victim = i
				}
			} else if ev.Attempt != "" || h.Session == ev.Session {
				return dropped, false, false // this run's end is held already
			}
		}
		switch {
		case victim >= 0:
			dropped, gaveUp = s.items[victim].V, true
			copy(s.items[victim:], s.items[victim+1:])
			s.items[len(s.items)-1] = Event[T]{}
			s.items = s.items[:len(s.items)-1]
			s.add(ev.Attempt, -1)
		case n >= 2*s.limit:
			return dropped, false, false
		}
	}
	s.add(ev.Attempt, 1)
	s.items = append(s.items, ev)
	return dropped, gaveUp, true
}

// Take removes and returns, in arrival order, the events held for attempt
// or, keyed by session, for session ("" matches no session). The slice is
// the Set's own: valid until the next Take.
func (s *Set[T]) Take(attempt, session string) []T {
	clear(s.out) // the last Take's: held no longer
	out := s.out[:0]
	kept := s.items[:0]
	for _, h := range s.items {
		switch {
		case h.Attempt != "" && h.Attempt == attempt:
		case h.Attempt == "" && session != "" && h.Session == session:
		default:
			kept = append(kept, h)
			continue
		}
		s.add(h.Attempt, -1)
		out = append(out, h.V)
	}
	clear(s.items[len(kept):])
	s.items = kept
	s.out = out
	return out
}

// Expire removes the session-keyed events that arrived before start oldest
// was issued (their horizon is below it), handing each to drop in arrival
// order.
func (s *Set[T]) Expire(oldest uint64, drop func(T)) {
	if s.bySession == 0 {
		return
	}
	kept := s.items[:0]
	for _, h := range s.items {
		if h.Attempt == "" && h.Horizon < oldest {
			s.bySession--
			drop(h.V)
			continue
		}
		kept = append(kept, h)
	}
	clear(s.items[len(kept):])
	s.items = kept
}
