package held

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// Event builders. Attempt-keyed events carry a session too (the host names
// both), so tests can check that keying by attempt ignores it.

func sessLive(v, session string) Event[string] {
	return Event[string]{V: v, Session: session}
}

func sessEnd(v, session string) Event[string] {
	return Event[string]{V: v, Session: session, Ends: true}
}

func attLive(v, attempt, session string) Event[string] {
	return Event[string]{V: v, Attempt: attempt, Session: session}
}

func attEnd(v, attempt, session string) Event[string] {
	return Event[string]{V: v, Attempt: attempt, Session: session, Ends: true}
}

func withHorizon(ev Event[string], h uint64) Event[string] {
	ev.Horizon = h
	return ev
}

// values lists the held values in the Set's order, to check what a Take or
// Expire left behind and that it kept arrival order.
func values(s *Set[string]) []string {
	out := []string{}
	for _, h := range s.items {
		out = append(out, h.V)
	}
	return out
}

type holdStep struct {
	ev      Event[string]
	dropped string // "" when nothing is given up
	gaveUp  bool
	ok      bool
}

type takeStep struct {
	attempt, session string
	want             []string
}

func accept(ev Event[string]) holdStep { return holdStep{ev: ev, ok: true} }
func refuse(ev Event[string]) holdStep { return holdStep{ev: ev} }
func replace(ev Event[string], dropped string) holdStep {
	return holdStep{ev: ev, dropped: dropped, gaveUp: true, ok: true}
}

func TestHold(t *testing.T) {
	tests := []struct {
		name       string
		limit      int
		steps      []holdStep
		len        int
		bySession  int
		forAttempt map[string]int
		takes      []takeStep // run in order after the steps
	}{
		{
			name:  "limit 0 behaves as limit 1",
			limit: 0,
			steps: []holdStep{
				accept(attLive("a1-1", "a1", "s1")),
				refuse(attLive("a1-2", "a1", "s1")),
				accept(sessLive("s1-1", "s1")),
				refuse(sessLive("s2-1", "s2")),
				accept(attLive("a2-1", "a2", "s2")),
			},
			len: 3, bySession: 1, forAttempt: map[string]int{"a1": 1, "a2": 1},
			takes: []takeStep{
				{"a1", "", []string{"a1-1"}},
				{"", "s1", []string{"s1-1"}},
				{"a2", "", []string{"a2-1"}},
			},
		},
		{
			name:  "negative limit behaves as limit 1",
			limit: -3,
			steps: []holdStep{
				accept(sessLive("s1-1", "s1")),
				refuse(sessLive("s1-2", "s1")),
				accept(attLive("a1-1", "a1", "s1")),
				refuse(attLive("a1-2", "a1", "s1")),
				// At limit 1, an end takes the single liveness slot.
				replace(attEnd("a1-end", "a1", "s1"), "a1-1"),
			},
			len: 2, bySession: 1, forAttempt: map[string]int{"a1": 1},
			takes: []takeStep{{"a1", "s1", []string{"s1-1", "a1-end"}}},
		},
		{
			name:  "session-keyed events are bounded all together",
			limit: 2,
			steps: []holdStep{
				accept(sessLive("s1-1", "s1")),
				accept(sessLive("s2-1", "s2")),
				refuse(sessLive("s3-1", "s3")), // a session never seen still finds the key full
				refuse(sessLive("s1-2", "s1")),
			},
			len: 2, bySession: 2, forAttempt: map[string]int{},
			takes: []takeStep{
				{"", "s1", []string{"s1-1"}},
				{"", "s2", []string{"s2-1"}},
				{"", "s3", []string{}},
			},
		},
		{
			name:  "attempt-keyed events are bounded per attempt",
			limit: 2,
			steps: []holdStep{
				accept(attLive("a1-1", "a1", "s1")),
				accept(attLive("a1-2", "a1", "s1")),
				refuse(attLive("a1-3", "a1", "s1")),
				accept(attLive("a2-1", "a2", "s2")),
				accept(attLive("a2-2", "a2", "s2")),
				refuse(attLive("a2-3", "a2", "s2")),
				// Full attempts leave the session key its own room.
				accept(sessLive("s3-1", "s3")),
				accept(sessLive("s4-1", "s4")),
			},
			len: 6, bySession: 2, forAttempt: map[string]int{"a1": 2, "a2": 2, "a3": 0},
			takes: []takeStep{
				{"a1", "", []string{"a1-1", "a1-2"}},
				{"a2", "", []string{"a2-1", "a2-2"}},
			},
		},
		{
			name:  "other sessions never crowd out an attempt-keyed event",
			limit: 2,
			steps: []holdStep{
				accept(sessLive("s1-1", "s1")),
				accept(sessLive("s2-1", "s2")),
				replace(sessEnd("s3-end", "s3"), "s1-1"),
				replace(sessEnd("s4-end", "s4"), "s2-1"),
				accept(sessEnd("s5-end", "s5")), // past the bound: only ends held
				accept(sessEnd("s6-end", "s6")), // at twice the bound now
				refuse(sessEnd("s7-end", "s7")),
				refuse(sessLive("s8-1", "s8")),
				// The session key is as full as it gets; the attempt is not.
				accept(attLive("a1-1", "a1", "s8")),
				accept(attEnd("a1-end", "a1", "s8")),
				refuse(attLive("a1-2", "a1", "s8")),
			},
			len: 6, bySession: 4, forAttempt: map[string]int{"a1": 2},
			takes: []takeStep{
				{"a1", "", []string{"a1-1", "a1-end"}},
				{"", "s5", []string{"s5-end"}},
			},
		},
		{
			name:  "below the bound nothing is given up",
			limit: 3,
			steps: []holdStep{
				accept(attLive("a1-1", "a1", "s1")),
				accept(attLive("a1-2", "a1", "s1")),
				accept(attEnd("a1-end", "a1", "s1")),
				accept(sessLive("s2-1", "s2")),
				accept(sessEnd("s2-end", "s2")),
			},
			len: 5, bySession: 2, forAttempt: map[string]int{"a1": 3},
			takes: []takeStep{{"a1", "s2", []string{"a1-1", "a1-2", "a1-end", "s2-1", "s2-end"}}},
		},
		{
			name:  "attempt end takes the place of the oldest liveness of its attempt",
			limit: 3,
			steps: []holdStep{
				accept(attLive("a2-old", "a2", "s2")), // older, but another key
				accept(sessLive("s1-old", "s1")),      // older, but another key
				accept(attLive("a1-x", "a1", "s1")),
				accept(attLive("a1-y", "a1", "s1")),
				accept(attLive("a1-z", "a1", "s1")),
				refuse(attLive("a1-w", "a1", "s1")),
				replace(attEnd("a1-end", "a1", "s1"), "a1-x"),
			},
			len: 5, bySession: 1, forAttempt: map[string]int{"a1": 3, "a2": 1},
			takes: []takeStep{
				{"a1", "", []string{"a1-y", "a1-z", "a1-end"}},
				{"a2", "", []string{"a2-old"}},
				{"", "s1", []string{"s1-old"}},
			},
		},
		{
			name:  "session end takes the place of the oldest session-keyed liveness, of any session",
			limit: 3,
			steps: []holdStep{
				accept(attLive("a1-old", "a1", "s2")), // older, but another key
				accept(sessLive("s1-x", "s1")),
				accept(sessLive("s2-y", "s2")),
				accept(sessLive("s1-z", "s1")),
				replace(sessEnd("s2-end", "s2"), "s1-x"),
				replace(sessEnd("s3-end", "s3"), "s2-y"),
			},
			len: 4, bySession: 3, forAttempt: map[string]int{"a1": 1},
			takes: []takeStep{
				{"", "s1", []string{"s1-z"}},
				{"", "s2", []string{"s2-end"}},
				{"", "s3", []string{"s3-end"}},
				{"a1", "", []string{"a1-old"}},
			},
		},
		{
			name:  "session end skips held ends and gives up the oldest liveness",
			limit: 2,
			steps: []holdStep{
				accept(sessEnd("s1-end", "s1")),
				accept(sessLive("s2-1", "s2")),
				replace(sessEnd("s3-end", "s3"), "s2-1"),
			},
			len: 2, bySession: 2, forAttempt: map[string]int{},
			takes: []takeStep{
				{"", "s1", []string{"s1-end"}},
				{"", "s2", []string{}},
				{"", "s3", []string{"s3-end"}},
			},
		},
		{
			name:  "session ends are held past the bound up to twice it",
			limit: 2,
			steps: []holdStep{
				accept(sessEnd("s1-end", "s1")),
				accept(sessEnd("s2-end", "s2")),
				accept(sessEnd("s3-end", "s3")),
				accept(sessEnd("s4-end", "s4")),
				refuse(sessEnd("s5-end", "s5")),
				refuse(sessLive("s6-1", "s6")),
			},
			len: 4, bySession: 4, forAttempt: map[string]int{},
			takes: []takeStep{
				{"", "s3", []string{"s3-end"}},
				{"", "s4", []string{"s4-end"}},
				{"", "s5", []string{}},
			},
		},
		{
			name:  "session end refused past the bound when that session's end is held",
			limit: 1,
			steps: []holdStep{
				accept(sessEnd("s1-end", "s1")),
				refuse(sessEnd("s1-end2", "s1")),
				accept(sessEnd("s2-end", "s2")),
				refuse(sessEnd("s2-end2", "s2")),
				refuse(sessEnd("s3-end", "s3")), // twice the bound
			},
			len: 2, bySession: 2, forAttempt: map[string]int{},
			takes: []takeStep{
				{"", "s1", []string{"s1-end"}},
				{"", "s2", []string{"s2-end"}},
			},
		},
		{
			name:  "an attempt-keyed end does not count as its session's held end",
			limit: 1,
			steps: []holdStep{
				accept(attEnd("a1-end", "a1", "s1")),
				accept(sessEnd("s2-end", "s2")),
				accept(sessEnd("s1-end", "s1")), // past the bound: s1 has no session-keyed end
			},
			len: 3, bySession: 2, forAttempt: map[string]int{"a1": 1},
			takes: []takeStep{
				{"", "s1", []string{"s1-end"}},
				{"a1", "", []string{"a1-end"}},
			},
		},
		{
			name:  "attempt end refused at the bound when an end of that attempt is held",
			limit: 2,
			steps: []holdStep{
				accept(attEnd("a1-end1", "a1", "s1")),
				accept(attEnd("a1-end2", "a1", "s2")), // below the bound: held
				refuse(attEnd("a1-end3", "a1", "s3")), // any end of a1, whatever its session
				refuse(attLive("a1-1", "a1", "s1")),
				accept(attEnd("a2-end", "a2", "s1")), // another attempt
			},
			len: 3, bySession: 0, forAttempt: map[string]int{"a1": 2, "a2": 1},
			takes: []takeStep{
				{"a1", "", []string{"a1-end1", "a1-end2"}},
				{"a2", "", []string{"a2-end"}},
			},
		},
		{
			name:  "attempt end at limit 1 replaces, then a second end is refused",
			limit: 1,
			steps: []holdStep{
				accept(attEnd("a2-end", "a2", "s1")), // another attempt's end blocks nothing
				accept(attLive("a1-1", "a1", "s1")),
				replace(attEnd("a1-end", "a1", "s1"), "a1-1"),
				refuse(attEnd("a1-end2", "a1", "s1")),
				refuse(attLive("a1-2", "a1", "s1")),
			},
			len: 2, bySession: 0, forAttempt: map[string]int{"a1": 1, "a2": 1},
			takes: []takeStep{{"a1", "", []string{"a1-end"}}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := New[string](tt.limit)
			for i, st := range tt.steps {
				dropped, gaveUp, ok := s.Hold(st.ev)
				assert.Equal(t, st.dropped, dropped, "step %d (%s): dropped", i, st.ev.V)
				assert.Equal(t, st.gaveUp, gaveUp, "step %d (%s): gaveUp", i, st.ev.V)
				assert.Equal(t, st.ok, ok, "step %d (%s): ok", i, st.ev.V)
			}
			assert.Equal(t, tt.len, s.Len(), "Len")
			assert.Equal(t, tt.bySession, s.BySession(), "BySession")
			for id, n := range tt.forAttempt {
				assert.Equal(t, n, s.ForAttempt(id), "ForAttempt(%q)", id)
			}
			for _, tk := range tt.takes {
				got := slices.Clone(s.Take(tk.attempt, tk.session))
				if got == nil {
					got = []string{}
				}
				assert.Equal(t, tk.want, got, "Take(%q, %q)", tk.attempt, tk.session)
			}
		})
	}
}

// A refused or replacing Hold must leave the counts as they were.
func TestHoldCountsAtTheBound(t *testing.T) {
	s := New[string](2)
	s.Hold(attLive("a1-1", "a1", "s1"))
	s.Hold(attLive("a1-2", "a1", "s1"))
	s.Hold(sessLive("s1-1", "s1"))
	s.Hold(sessLive("s2-1", "s2"))

	_, _, ok := s.Hold(attLive("a1-3", "a1", "s1"))
	require.False(t, ok)
	_, _, ok = s.Hold(sessLive("s3-1", "s3"))
	require.False(t, ok)
	assert.Equal(t, 4, s.Len())
	assert.Equal(t, 2, s.BySession())
	assert.Equal(t, 2, s.ForAttempt("a1"))

	dropped, gaveUp, ok := s.Hold(attEnd("a1-end", "a1", "s1"))
	require.True(t, ok)
	assert.True(t, gaveUp)
	assert.Equal(t, "a1-1", dropped)
	dropped, gaveUp, ok = s.Hold(sessEnd("s3-end", "s3"))
	require.True(t, ok)
	assert.True(t, gaveUp)
	assert.Equal(t, "s1-1", dropped)
	assert.Equal(t, 4, s.Len())
	assert.Equal(t, 2, s.BySession())
	assert.Equal(t, 2, s.ForAttempt("a1"))
	assert.Equal(t, []string{"a1-2", "s2-1", "a1-end", "s3-end"}, values(s))
}

func TestTake(t *testing.T) {
	arrivals := []Event[string]{
		sessLive("s1-1", "s1"),
		attLive("a1-1", "a1", "s1"), // names s1 too, but keyed by attempt
		sessLive("s2-1", "s2"),
		attEnd("a2-end", "a2", "s1"),
		sessEnd("s1-end", "s1"),
		attLive("a1-2", "a1", "s2"),
		sessLive("none-1", ""), // keyed by an empty session
		sessLive("s2-2", "s2"),
	}
	tests := []struct {
		name             string
		attempt, session string
		want             []string
		left             []string
		bySession        int
		forAttempt       map[string]int
	}{
		{
			name: "attempt and session together, in arrival order", attempt: "a1", session: "s1",
			want:      []string{"s1-1", "a1-1", "s1-end", "a1-2"},
			left:      []string{"s2-1", "a2-end", "none-1", "s2-2"},
			bySession: 3, forAttempt: map[string]int{"a1": 0, "a2": 1},
		},
		{
			name: "attempt only", attempt: "a1", session: "",
			want:      []string{"a1-1", "a1-2"},
			left:      []string{"s1-1", "s2-1", "a2-end", "s1-end", "none-1", "s2-2"},
			bySession: 5, forAttempt: map[string]int{"a1": 0, "a2": 1},
		},
		{
			name: "session only skips attempt-keyed events naming it", attempt: "", session: "s1",
			want:      []string{"s1-1", "s1-end"},
			left:      []string{"a1-1", "s2-1", "a2-end", "a1-2", "none-1", "s2-2"},
			bySession: 3, forAttempt: map[string]int{"a1": 2, "a2": 1},
		},
		{
			name: "empty session matches no session-keyed event", attempt: "", session: "",
			want:      []string{},
			left:      []string{"s1-1", "a1-1", "s2-1", "a2-end", "s1-end", "a1-2", "none-1", "s2-2"},
			bySession: 5, forAttempt: map[string]int{"a1": 2, "a2": 1},
		},
		{
			name: "unknown attempt and session", attempt: "a9", session: "s9",
			want:      []string{},
			left:      []string{"s1-1", "a1-1", "s2-1", "a2-end", "s1-end", "a1-2", "none-1", "s2-2"},
			bySession: 5, forAttempt: map[string]int{"a1": 2, "a2": 1},
		},
		{
			name: "other attempt and session", attempt: "a2", session: "s2",
			want:      []string{"s2-1", "a2-end", "s2-2"},
			left:      []string{"s1-1", "a1-1", "s1-end", "a1-2", "none-1"},
			bySession: 3, forAttempt: map[string]int{"a1": 2, "a2": 0},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := New[string](10)
			for _, ev := range arrivals {
				_, _, ok := s.Hold(ev)
				require.True(t, ok, ev.V)
			}
			got := slices.Clone(s.Take(tt.attempt, tt.session))
			if got == nil {
				got = []string{}
			}
			assert.Equal(t, tt.want, got)
			assert.Equal(t, tt.left, values(s), "left held")
			assert.Equal(t, len(tt.left), s.Len())
			assert.Equal(t, tt.bySession, s.BySession())
			for id, n := range tt.forAttempt {
				assert.Equal(t, n, s.ForAttempt(id), "ForAttempt(%q)", id)
			}
			// Taken events are held no longer: a second Take finds none.
			assert.Empty(t, s.Take(tt.attempt, tt.session))
		})
	}
}

// Take gives back the room it frees: the bound counts what is held now.
func TestTakeFreesRoom(t *testing.T) {
	s := New[string](1)
	_, _, ok := s.Hold(attLive("a1-1", "a1", "s1"))
	require.True(t, ok)
	_, _, ok = s.Hold(sessLive("s1-1", "s1"))
	require.True(t, ok)
	_, _, ok = s.Hold(attLive("a1-2", "a1", "s1"))
	require.False(t, ok)
	_, _, ok = s.Hold(sessLive("s2-1", "s2"))
	require.False(t, ok)

	require.Equal(t, []string{"a1-1", "s1-1"}, slices.Clone(s.Take("a1", "s1")))
	assert.Zero(t, s.Len())
	assert.Zero(t, s.BySession())
	assert.Zero(t, s.ForAttempt("a1"))

	_, _, ok = s.Hold(attLive("a1-2", "a1", "s1"))
	assert.True(t, ok)
	_, _, ok = s.Hold(sessLive("s2-1", "s2"))
	assert.True(t, ok)
	assert.Equal(t, []string{"a1-2"}, slices.Clone(s.Take("a1", "")))
	assert.Equal(t, []string{"s2-1"}, slices.Clone(s.Take("", "s2")))
	assert.Zero(t, s.Len())
}

func TestExpire(t *testing.T) {
	arrivals := []Event[string]{
		withHorizon(sessLive("s1-h1", "s1"), 1),
		withHorizon(attLive("a1-h0", "a1", "s1"), 0),
		withHorizon(sessEnd("s2-h5", "s2"), 5),
		withHorizon(sessLive("s3-h3", "s3"), 3),
		withHorizon(attEnd("a2-h0", "a2", "s2"), 0),
		withHorizon(sessLive("s1-h7", "s1"), 7),
		withHorizon(sessLive("none-h4", ""), 4),
	}
	tests := []struct {
		name      string
		oldest    uint64
		dropped   []string
		left      []string
		bySession int
	}{
		{
			name: "oldest 0 expires nothing", oldest: 0,
			dropped:   []string{},
			left:      []string{"s1-h1", "a1-h0", "s2-h5", "s3-h3", "a2-h0", "s1-h7", "none-h4"},
			bySession: 5,
		},
		{
			name: "horizon equal to oldest is kept", oldest: 1,
			dropped:   []string{},
			left:      []string{"s1-h1", "a1-h0", "s2-h5", "s3-h3", "a2-h0", "s1-h7", "none-h4"},
			bySession: 5,
		},
		{
			name: "horizons below oldest, in arrival order", oldest: 4,
			dropped:   []string{"s1-h1", "s3-h3"},
			left:      []string{"a1-h0", "s2-h5", "a2-h0", "s1-h7", "none-h4"},
			bySession: 3,
		},
		{
			name: "empty session expires too", oldest: 5,
			dropped:   []string{"s1-h1", "s3-h3", "none-h4"},
			left:      []string{"a1-h0", "s2-h5", "a2-h0", "s1-h7"},
			bySession: 2,
		},
		{
			name: "every session-keyed event, ends too; attempt-keyed stay", oldest: 100,
			dropped:   []string{"s1-h1", "s2-h5", "s3-h3", "s1-h7", "none-h4"},
			left:      []string{"a1-h0", "a2-h0"},
			bySession: 0,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := New[string](10)
			for _, ev := range arrivals {
				_, _, ok := s.Hold(ev)
				require.True(t, ok, ev.V)
			}
			dropped := []string{}
			s.Expire(tt.oldest, func(v string) { dropped = append(dropped, v) })
			assert.Equal(t, tt.dropped, dropped)
			assert.Equal(t, tt.left, values(s), "left held")
			assert.Equal(t, len(tt.left), s.Len())
			assert.Equal(t, tt.bySession, s.BySession())
			assert.Equal(t, 1, s.ForAttempt("a1"))
			assert.Equal(t, 1, s.ForAttempt("a2"))
		})
	}
}

func TestExpireLeavesAttemptKeyedEvents(t *testing.T) {
	s := New[string](2)
	s.Hold(withHorizon(attLive("a1-1", "a1", "s1"), 0))
	s.Hold(withHorizon(attEnd("a1-end", "a1", "s1"), 0))
	s.Hold(withHorizon(attLive("a2-1", "a2", "s2"), 0))
	s.Expire(10, func(v string) { t.Errorf("dropped %q, keyed by attempt", v) })
	assert.Equal(t, []string{"a1-1", "a1-end", "a2-1"}, values(s))
	assert.Equal(t, 3, s.Len())
	assert.Equal(t, 2, s.ForAttempt("a1"))
	assert.Equal(t, 1, s.ForAttempt("a2"))
}

// Expire gives back the room it frees in the session key.
func TestExpireFreesRoom(t *testing.T) {
	s := New[string](1)
	_, _, ok := s.Hold(withHorizon(sessLive("s1-1", "s1"), 1))
	require.True(t, ok)
	_, _, ok = s.Hold(withHorizon(sessLive("s2-1", "s2"), 2))
	require.False(t, ok)
	s.Expire(2, func(string) {})
	assert.Zero(t, s.BySession())
	_, _, ok = s.Hold(withHorizon(sessLive("s2-1", "s2"), 2))
	assert.True(t, ok)
	assert.Equal(t, []string{"s2-1"}, values(s))
}
