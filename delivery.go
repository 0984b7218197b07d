package bgtask

import (
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// outbox is what the core decided while m.mu was held and the shell does
// once it is released (unlock): the effects, in the order decided, and the
// log lines (both guarded by m.mu); and the count of calls into the logger
// that panicked (panics: atomic).
type outbox struct {
	fx    []effect
	lines []logRec
	recs  []record // committed records for the journal, in order
	// spare is a records buffer an unlock is done with, for the next
	// commit's (at most one is kept; a bigger one than spareRecs goes).
	// Guarded by order: an unlock takes it while it holds both locks.
	spare    []record
	later    []func() // user callbacks (Spec.OnDone), run once the records are durable, each on a goroutine
	measures []func() // Metrics calls, run in commit order (see turns)
	// turns orders what the unlocks emit — log lines and measurements —
	// as m.mu was released, whichever goroutine emits them.
	turns   turns
	order   sync.Mutex // held from m.mu's release to a batch's append: batches stay in commit order
	panics  atomic.Uint64
	durable durableMark // with a journal: how far the committed records are durable
}

// spareRecs bounds the records buffer an unlock hands on (recycle).
const spareRecs = 64

// recycle keeps recs, encoded and no longer read, as the spare buffer.
// o.order is held.
func (o *outbox) recycle(recs []record) {
	if cap(recs) > spareRecs {
		return
	}
	clear(recs) // drop what the records point to
	o.spare = recs[:0]
}

// notify queues a notification for e's parent, in production order.
func (m *Manager) notify(e *entry, kind NotificationKind, text string) {
	m.notifyOf(e, kind, 0, text)
}

// notifyOf is notify, for the answer of invocation inv (NotifyAnswer).
// m.mu is held.
func (m *Manager) notifyOf(e *entry, kind NotificationKind, inv int, text string) {
	if m.cfg.notifier == nil {
		return
	}
	m.push(Notification{
		Kind:            kind,
		ParentSessionID: e.info.parent,
		TaskID:          e.info.id,
		Task:            e.project(),
		Text:            text,
		Invocation:      inv,
	})
}

// push numbers n and queues it on its parent's lane, in production order.
// A lane that is full (WithNotifyLimits) gives up its oldest waiting
// notification, which is kept as undelivered. m.mu is held.
func (m *Manager) push(n Notification) {
	m.notes.seq++
	n.Seq = m.notes.seq
	if n.ID == "" {
		id, err := newID(m.cfg.ids, idNotification)
		if err != nil || id == "" {
			id = "n-" + strconv.FormatUint(m.changes.epoch, 10) + "-" + strconv.FormatUint(n.Seq, 10)
		}
		n.ID = id
	}
	m.notes.lastID = n.ID
	if m.cfg.notesAtCommit && m.led.recording() {
		// Delivered with its commit (fleet.AtCommit): nothing is queued,
		// nothing is owed.
		nt := m.noticeOf(n)
		nt.full = &n
		m.led.emit(record{kind: recNotifyProduced, task: n.TaskID, at: m.now(), recordExt: &recordExt{notice: nt}})
		return
	}
	if m.led.recording() {
		m.led.emit(record{kind: recNotifyProduced, task: n.TaskID, at: m.now(), recordExt: &recordExt{notice: m.noticeOf(n)}})
	}
	m.queueNote(n)
}

// queueNote puts n on its parent's lane; its task counts it as out until
// it is delivered or given up. m.mu is held.
func (m *Manager) queueNote(n Notification) {
	old, evicted, ok := m.notes.lanes.Push(n.ParentSessionID, n)
	if ok {
		m.noteOut(n.TaskID, 1)
	}
	if evicted {
		m.notes.failures.Add(1)
		m.noteOut(old.TaskID, -1)
		m.keepLost(old, "its parent's queue is full (WithNotifyLimits)")
	}
	if !ok {
		m.notes.failures.Add(1)
		m.logLocked(slog.LevelError, "notification not delivered: the manager is shut down",
			slog.String("task", n.TaskID), slog.String("parent", n.ParentSessionID), slog.String("kind", string(n.Kind)))
	}
}

// noteOut counts a notification of task id as out (d 1) or no longer
// (d -1); an ended task none is out for may be forgotten. m.mu is held.
func (m *Manager) noteOut(id string, d int) {
	e := m.led.tasks[id]
	if id == "" || e == nil {
		return
	}
	e.notesOut += d
	m.led.notesOut += d
	if d < 0 && e.notesOut == 0 && e.terminal() {
		m.taskSettled(e)
		m.sweep()
	}
}

// noticeOf is n as the ledger records it. m.mu is held.
func (m *Manager) noticeOf(n Notification) *notice {
	nt := &notice{id: n.ID, seq: n.Seq, kind: n.Kind, parent: n.ParentSessionID, text: n.Text, attempt: n.Task.CurrentAttemptID, invocation: n.Invocation}
	for _, t := range n.Tasks {
		nt.tasks = append(nt.tasks, t.ID)
	}
	if n.Kind == NotifyBranchClosed && len(m.led.closures) > 0 {
		nt.closure = m.led.closures[len(m.led.closures)-1].seq
	}
	return nt
}

// keepLost keeps n, which the Notifier will not get, for
// Dropped().Undelivered: at most the WithNotifyLimits bound, the oldest
// given up first (counted by Dropped().NotifyDropped). Either way it is
// logged at error level. m.mu is held.
func (m *Manager) keepLost(n Notification, why string) {
	// Recorded as settled: a restart does not deliver it again, out of its
	// parent's order, after what came later was delivered.
	if m.led.recording() {
		m.led.emit(record{kind: recNotifyDelivered, task: n.TaskID, at: m.now(), recordExt: &recordExt{note: "given up: " + why, notice: &notice{seq: n.Seq, kind: n.Kind, parent: n.ParentSessionID}}})
	}
	m.logLocked(slog.LevelError, "notification not delivered", slog.String("reason", why),
		slog.String("task", n.TaskID), slog.String("parent", n.ParentSessionID), slog.String("kind", string(n.Kind)))
	if len(m.notes.lost) >= m.cfg.undeliveredLimit {
		m.notes.dropped.Add(1)
		m.logLocked(slog.LevelError, "undelivered notification dropped: Undelivered is full (WithNotifyLimits)",
			slog.String("task", m.notes.lost[0].TaskID), slog.String("parent", m.notes.lost[0].ParentSessionID), slog.String("kind", string(m.notes.lost[0].Kind)))
		m.notes.lost[0] = Notification{}
		m.notes.lost = m.notes.lost[1:]
	}
	m.notes.lost = append(m.notes.lost, n)
}

// deliver hands n to the notifier, on the parent's lane goroutine. A refused
// Notify is retried (WithNotifyRetry) before it is given up: logged at error
// level, counted and kept (Dropped().Undelivered). The lane then moves on,
// so one bad notification never blocks the next forever.
func (m *Manager) deliver(_ string, n Notification) {
	cur := n.Task.Current()
	var acked bool // guarded by m.mu
	delivered := func() {
		m.mu.Lock()
		if !acked {
			acked = true
			if m.led.recording() {
				m.led.emit(record{kind: recNotifyDelivered, task: n.TaskID, at: m.now(), recordExt: &recordExt{notice: &notice{seq: n.Seq, kind: n.Kind, parent: n.ParentSessionID}}})
			}
			m.noteOut(n.TaskID, -1)
		}
		m.unlock()
	}
	ctx := &runCtx{Context: m.life.ctx, v: runValue{ref: RunRef{TaskID: n.TaskID, AttemptID: cur.ID, Token: cur.Token}, kind: callNotify, delivered: delivered}}
	var err error
	for attempt := 1; ; attempt++ {
		if err = m.poisoned(); err != nil {
			break // not durable: never delivered
		}
		err = func() (err error) {
			defer func() {
				if r := recover(); r != nil {
					err = fmt.Errorf("Notifier panicked: %s", panicText(r))
				}
			}()
			return m.cfg.notifier.Notify(ctx, n)
		}()
		m.mu.Lock()
		done := acked
		m.mu.Unlock()
		if err == nil || done { // a Delivered inside Notify is final
			delivered()
			return
		}
		if attempt >= m.cfg.notifyAttempts || m.life.ctx.Err() != nil {
			break
		}
		d, ok := m.notifyBackoff(attempt+1, err)
		if !ok {
			err = fmt.Errorf("%w (and the WithNotifyRetry backoff panicked: no more tries)", err)
			break
		}
		if d > 0 {
			t := m.cfg.clock.NewTimer(d)
			select {
			case <-t.C():
			case <-m.life.ctx.Done():
				t.Stop()
			}
		}
	}
	m.notes.failures.Add(1)
	why := "the Notifier refused it: " + safeText(err) // user code: before the lock
	m.mu.Lock()
	if !acked { // a Delivered after this, from a Notifier that kept ctx, is too late
		acked = true
		m.noteOut(n.TaskID, -1)
		m.keepLost(n, why)
	}
	m.unlock()
}

// notifyBackoff asks the WithNotifyRetry backoff (user code) how long to
// wait before try n; ok is false if it panicked.
func (m *Manager) notifyBackoff(n int, cause error) (d time.Duration, ok bool) {
	defer func() {
		if r := recover(); r != nil {
			d, ok = 0, false
		}
	}()
	return m.cfg.notifyBackoff(n, cause), true
}

// Drops is what a Manager dropped or could not deliver, as counted since
// it was opened (Manager.Dropped). Nothing here is lost silently: each is
// also logged as it happens.
type Drops struct {
	// NotifyFailures counts the notifications not delivered: refused by
	// the Notifier after every retry, pushed out of a full queue, or
	// produced after Shutdown.
	NotifyFailures uint64 `json:"notifyFailures"`
	// NotifyDropped counts the undelivered notifications given up because
	// Undelivered was full (WithNotifyLimits): they are gone.
	NotifyDropped uint64 `json:"notifyDropped"`
	// LoggerPanics counts the calls into the logger (WithLogger) that
	// panicked. Such a panic is swallowed: the line is lost, the Manager
	// goes on.
	LoggerPanics uint64 `json:"loggerPanics"`
	// Undelivered are the notifications the Notifier never accepted
	// (after every retry) or that a full queue gave up, in the order they
	// were given up: at most the WithNotifyLimits bound, the oldest
	// dropped first. A copy.
	Undelivered []Notification `json:"undelivered,omitempty"`
}

// Dropped reports what the Manager dropped or could not deliver (Drops).
func (m *Manager) Dropped() Drops {
	m.mu.Lock()
	lost := slices.Clone(m.notes.lost)
	m.unlock()
	return Drops{
		NotifyFailures: m.notes.failures.Load(),
		NotifyDropped:  m.notes.dropped.Load(),
		LoggerPanics:   m.out.panics.Load(),
		Undelivered:    lost,
	}
}

// WithNotifyRetry makes a refused Notify be tried up to attempts times in
// all, waiting backoff(n, cause) before try n (n ≥ 2; cause is the error
// the Notifier returned; nil backoff: no wait). Default: 3 tries with
// Backoff(200ms, 5s, 0.2). A notification refused every time is
// logged at error level, counted and kept (Dropped).
func WithNotifyRetry(attempts int, backoff func(attempt int, cause error) time.Duration) Option {
	return optionFunc(func(c *config) {
		c.notifyAttempts = attempts
		c.notifyBackoff = backoff
	})
}

// lessNeeded picks the notification a full queue gives up: the oldest retry
// notification (the final summary repeats what it said), else the oldest.
func lessNeeded(waiting []Notification) int {
	for i, n := range waiting {
		if n.Kind == NotifyRetryScheduled || n.Kind == NotifyRetrySessionReady {
			return i
		}
	}
	return 0
}

// Default bounds of WithNotifyLimits.
const (
	// defaultNotifyQueueLimit is how many notifications may wait for one
	// parent session while its Notifier is busy: room for a burst of
	// 10,000 tasks of one parent ending at once.
	defaultNotifyQueueLimit = 10_000
	// defaultUndeliveredLimit is how many undelivered notifications
	// Dropped().Undelivered keeps.
	defaultUndeliveredLimit = 1000
)

// WithNotifyLimits bounds the memory notifications may hold when a Notifier
// is slow or stuck: at most queue notifications wait for one parent session
// (a full queue gives up its oldest waiting retry notification, or else its
// oldest, which is then undelivered), and Dropped().Undelivered keeps at
// most undelivered (the oldest is dropped first, counted by
// Dropped().NotifyDropped). Each is logged at error level. A value ≤ 0 keeps
// the default: defaultNotifyQueueLimit and defaultUndeliveredLimit.
func WithNotifyLimits(queue, undelivered int) Option {
	return optionFunc(func(c *config) {
		if queue > 0 {
			c.queueLimit = queue
		}
		if undelivered > 0 {
			c.undeliveredLimit = undelivered
		}
	})
}

// round is one parent's batch of tasks, from the first launch after the
// parent had none live to the moment the last of them ends.
type round struct {
	parent string
	live   int
	tasks  []*entry
}

// roundEnded counts e out of its parent's round and, when it was the last
// live task, sends exactly one NotifyAllComplete. m.mu is held; the lock is
// what makes siblings ending together yield one.
func (m *Manager) roundEnded(e *entry) {
	r := e.rt.round
	if r == nil {
		return
	}
	e.rt.round = nil
	r.live--
	if r.live > 0 {
		return
	}
	if m.notes.rounds[r.parent] == r {
		delete(m.notes.rounds, r.parent)
	}
	if m.cfg.notifier == nil {
		return
	}
	tasks := make([]Task, 0, len(r.tasks))
	for _, t := range r.tasks {
		tasks = append(tasks, t.project())
	}
	m.push(allComplete(e.info.parent, tasks))
}

// allComplete is the NotifyAllComplete a Manager sends parent when the
// last live task of its round ended: tasks (the round's, ended; sorted in
// place) failures first, and its text. It has no ID or Seq: those are the
// producer's. A journal shared by several processes (pgledger, through
// internal/fleet) uses it to
// tell a round whose tasks ended in different processes.
func allComplete(parent string, tasks []Task) Notification {
	slices.SortStableFunc(tasks, func(a, b Task) int { return failureRank(a) - failureRank(b) })
	return Notification{Kind: NotifyAllComplete, ParentSessionID: parent, Tasks: tasks, Text: allCompleteText(parent, tasks)}
}

// The ranks of an ended task in an all-complete notification: failures
// first, then tasks that were stopped, then answers.
const (
	rankFailed = iota
	rankStopped
	rankCompleted
)

// failureRank orders failures before stopped tasks before answers.
func failureRank(t Task) int {
	switch {
	case t.Outcome == nil || t.Outcome.State == StatusError:
		return rankFailed
	case t.Outcome.State == StatusCompleted:
		return rankCompleted
	}
	return rankStopped
}
