package bgtask

// The crash harness: a rich scenario is run once on a file journal, every
// batch it commits (and its compaction) taped; then a journal image is
// made for every point a crash could leave — after every batch, after
// every record inside a batch, at byte offsets inside the last unit
// written, with a random subset of its pages lost — and each is opened as
// a restart would, on a session service that answers truthfully for the
// world that image implies. After each, the restarted Manager is driven
// until everything ended, and the promises are checked: no panic; each
// task that ended exactly one final summary delivered (the ID it had if it
// was produced before the crash); each round exactly one all_complete; no
// attempt lost or invented; nothing completed or cancelled without
// evidence; no child left running; answers released once and in order.

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask/internal/clock"
	"github.com/bgtask/bgtask/internal/wal"
)

// crashLong makes the harness cut at every byte of every batch (not a
// sample) and run the restart of every cut image in full. .ci/run sets it.
var crashLong = flag.Bool("crash.long", false, "crash harness: every byte cut, every image restarted in full")

// crashWorld is the session service: it outlives the harness process, and
// answers StatusHost's questions truthfully.
type crashWorld struct {
	// turn is held while a turn's end is told (the service ends it, the
	// Manager hears of it) and while a result is handed to a session: a
	// result that arrives after a turn ended starts the next turn.
	turn    sync.Mutex
	mu      sync.Mutex
	woke    chan struct{}            // closed when a session takes a new turn (deliver)
	sess    map[string]*worldSession // by session id
	byAtt   map[string]string        // attempt id → session id
	prompts []PromptRequest
}

type worldSession struct {
	attempt string
	state   SessionState
	end     Event
	aborted bool // an abort stopped it (it is gone)
	woken   bool // a result delivered after a turn ended started another
	// late: an abort reached it after its run ended, and the service said
	// yes (the turn's end and a stop raced; the Manager may have heard of
	// the abort first, and the run ends as the stop asked).
	late bool
}

func newCrashWorld() *crashWorld {
	return &crashWorld{sess: map[string]*worldSession{}, byAtt: map[string]string{}}
}

func (w *crashWorld) StartSession(ctx context.Context, req SessionRequest) (string, error) {
	sid := "s-" + req.AttemptID
	w.mu.Lock()
	defer w.mu.Unlock()
	for n := 2; w.sess[sid] != nil; n++ {
		// A second start of the same attempt makes a second session, as a
		// session service does: the first runs on, and must be stopped.
		sid = fmt.Sprintf("s-%s-%d", req.AttemptID, n)
	}
	w.sess[sid] = &worldSession{attempt: req.AttemptID, state: SessionStateAlive}
	if w.byAtt[req.AttemptID] == "" {
		w.byAtt[req.AttemptID] = sid
	}
	return sid, nil
}

func (w *crashWorld) AbortSession(ctx context.Context, sid string) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	switch s := w.sess[sid]; {
	case s != nil && s.state == SessionStateAlive:
		s.state, s.aborted = SessionStateGone, true
	case s != nil && s.state == SessionStateEnded:
		s.late = true
	}
	return nil
}

func (w *crashWorld) SessionStatus(ctx context.Context, sid string) (SessionReport, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.sess[sid]
	if s == nil || s.state == SessionStateGone {
		return SessionReport{State: SessionStateGone}, nil
	}
	return SessionReport{State: s.state, End: s.end}, nil
}

func (w *crashWorld) FindSession(ctx context.Context, req SessionRequest) (string, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.byAtt[req.AttemptID], nil
}

func (w *crashWorld) PromptSession(ctx context.Context, req PromptRequest) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.prompts = append(w.prompts, req)
	return nil
}

// end ends session sid's run with ev, as the service saw it: the event the
// Manager is then told. It reports whether the run ended so (false: it was
// not running, e.g. an abort stopped it first, and there is nothing to tell).
func (w *crashWorld) end(sid string, ev Event) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if s := w.sess[sid]; s != nil && s.state == SessionStateAlive {
		s.state, s.end = SessionStateEnded, ev
		return true
	}
	return false
}

// deliver hands a child's result to session sid: a session whose turn had
// ended takes it as its next turn.
func (w *crashWorld) deliver(ctx context.Context, sid string) {
	w.turn.Lock()
	defer w.turn.Unlock()
	Delivered(ctx) // the result reaches the session now, before its next turn can begin
	w.mu.Lock()
	defer w.mu.Unlock()
	if s := w.sess[sid]; s != nil && s.state == SessionStateEnded && s.end.Kind == SessionIdle && !s.late { // an aborted session takes no next turn
		s.state, s.end, s.woken = SessionStateAlive, Event{}, true
		if w.woke != nil {
			close(w.woke)
			w.woke = nil
		}
	}
}

func (w *crashWorld) alive(sid string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.sess[sid]
	return s != nil && s.state == SessionStateAlive
}

func (w *crashWorld) session(sid string) (worldSession, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.sess[sid]
	if s == nil {
		return worldSession{}, false
	}
	return *s, true
}

// tapeJournal tapes every batch and compaction a Manager hands its
// journal, in order, until the crash.
type tapeJournal struct {
	Journal
	mu      sync.Mutex
	tape    []tapeStep
	crashed atomic.Bool
}

type tapeStep struct {
	recs    []Record
	compact bool
}

func cloneRecords(b []Record) []Record {
	out := slices.Clone(b)
	for i := range out {
		out[i].Data = slices.Clone(out[i].Data)
	}
	return out
}

func (j *tapeJournal) Append(b []Record) Commit {
	if j.crashed.Load() {
		return doneCommit{}
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	j.tape = append(j.tape, tapeStep{recs: cloneRecords(b)})
	return j.Journal.Append(b)
}

func (j *tapeJournal) Compact(keep []Record) error {
	if j.crashed.Load() {
		return nil
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	j.tape = append(j.tape, tapeStep{recs: cloneRecords(keep), compact: true})
	return j.Journal.Compact(keep)
}

// crashRecorder is a Notifier that keeps what it was given, and hands a
// final summary to its parent session in the world, if it is one.
type crashRecorder struct {
	mu  sync.Mutex
	got []Notification
	w   *crashWorld // nil: the world is played by hand
}

func (r *crashRecorder) Notify(ctx context.Context, n Notification) error {
	r.mu.Lock()
	r.got = append(r.got, n)
	r.mu.Unlock()
	if r.w != nil && n.Kind == NotifyFinalSummary {
		r.w.deliver(ctx, n.ParentSessionID)
	}
	return nil
}

func (r *crashRecorder) all() []Notification {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.got)
}

// crashOptions are the options both lives run with (but the journal, the
// notifier and the clock).
func crashOptions() []Option {
	return []Option{
		WithRetention(Retention{MaxEnded: 3}),
		WithRetryDelay(func(int, error) time.Duration { return 0 }),
		WithIDs(SequentialIDs()),
	}
}

var err429 = errors.New("429 Too Many Requests: rate limit exceeded")

// crashScenario is the first life: retries across three models, an Extend
// with answers, a children gate, a key, a Timeout and an AttemptTimeout,
// a branch closure, a stop, retention forgetting tasks and a compaction.
// Some tasks are still live at its end.
func crashScenario(t *testing.T, m *Manager, w *crashWorld) {
	ctx := context.Background()
	launch := func(spec Spec) Task {
		t.Helper()
		task, err := m.Launch(ctx, spec)
		require.NoError(t, err)
		return task
	}
	running := func(id string) Task {
		t.Helper()
		return waitStatus(t, m, id, StatusRunning)
	}
	finish := func(id string, ev Event) {
		t.Helper()
		task := running(id)
		ev.SessionID = task.SessionID
		w.end(task.SessionID, ev)
		require.NoError(t, m.Observe(ev))
	}
	abc := mustModels(t, "a/1", "b/2", "c/3")

	// Retries across three models.
	t1 := launch(Spec{ParentSessionID: "p1", Description: "three models", Prompt: "go", Models: abc})
	finish(t1.ID, Event{Kind: SessionError, Err: err429})
	waitFor(t, m, t1.ID, func(task Task) bool { return len(task.Attempts) == 2 && task.Status == StatusRunning })
	finish(t1.ID, Event{Kind: SessionError, Err: errors.New("529 overloaded_error: Overloaded")})
	waitFor(t, m, t1.ID, func(task Task) bool { return len(task.Attempts) == 3 && task.Status == StatusRunning })
	finish(t1.ID, Event{Kind: SessionIdle, Text: "t1 answer"})
	waitStatus(t, m, t1.ID, StatusCompleted)

	// A key, deadlines, an Extend with its answers.
	t2 := launch(Spec{ParentSessionID: "p2", Description: "extended", Prompt: "first", Models: abc[:1], Key: "k2",
		Timeout: time.Hour, AttemptTimeout: 30 * time.Minute})
	running(t2.ID)
	n, err := m.Extend(ctx, t2.ID, "second")
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.NoError(t, m.Observe(Event{SessionID: running(t2.ID).SessionID, Kind: SessionIdle, Text: "answer 1", Invocation: 1}))
	a1, err := m.WaitAnswer(ctx, t2.ID, 1)
	require.NoError(t, err)
	require.Equal(t, "answer 1", a1.Text)
	finish(t2.ID, Event{Kind: SessionIdle, Text: "answer 2", Invocation: 2})
	waitStatus(t, m, t2.ID, StatusCompleted)

	// The children gate: t3's session launched c3; t3's turn end waits
	// for c3's end and its summary's delivery.
	t3 := launch(Spec{ParentSessionID: "p3", Description: "gated", Prompt: "spawn", Models: abc[:2]})
	s3 := running(t3.ID).SessionID
	c3 := launch(Spec{ParentSessionID: s3, Description: "child of t3", Prompt: "work", Models: abc[1:]})
	running(c3.ID)
	require.NoError(t, m.Observe(Event{SessionID: s3, Kind: SessionIdle, Text: "t3 held"}))
	finish(c3.ID, Event{Kind: SessionIdle, Text: "c3 answer"})
	waitStatus(t, m, c3.ID, StatusCompleted)
	require.NoError(t, m.notes.lanes.Wait(ctx)) // c3's summary delivered to s3: its result starts t3's next turn
	finish(t3.ID, Event{Kind: SessionIdle, Text: "t3 answer"})
	waitStatus(t, m, t3.ID, StatusCompleted)

	// A branch closure: p4's tree (t4 and its child c4) stops.
	t4 := launch(Spec{ParentSessionID: "p4", Description: "closed", Prompt: "x", Models: abc})
	s4 := running(t4.ID).SessionID
	c4 := launch(Spec{ParentSessionID: s4, Description: "child of t4", Prompt: "y", Models: abc})
	running(c4.ID)
	_, err = m.Stop(ctx, Target{Session: "p4"})
	require.NoError(t, err)

	// A stop.
	t5 := launch(Spec{ParentSessionID: "p5", Description: "stopped", Prompt: "z", Models: abc})
	running(t5.ID)
	require.NoError(t, stopErr(m.Stop(ctx, Target{Task: t5.ID})))

	// A budget spent: t10's tree (t10, and c10 with a narrower grant)
	// reaches its tokens; the budget's closure stops both; a late report
	// of the stopped child still counts.
	t10 := launch(Spec{ParentSessionID: "p10", Description: "budgeted", Prompt: "b", Models: abc, Budget: &Budget{Tokens: 1000, Spawns: 3}})
	s10 := running(t10.ID).SessionID
	c10 := launch(Spec{ParentSessionID: s10, Description: "granted", Prompt: "g", Models: abc, Budget: &Budget{Tokens: 600}})
	sc10 := running(c10.ID).SessionID
	require.NoError(t, m.Observe(Event{SessionID: s10, Kind: SessionUsage, Usage: Usage{InputTokens: 200, OutputTokens: 100, Requests: 1}}))
	require.NoError(t, m.Observe(Event{SessionID: sc10, Kind: SessionBusy, Usage: Usage{InputTokens: 400, OutputTokens: 100, Requests: 2, Cost: 5000}}))
	require.NoError(t, m.Observe(Event{SessionID: s10, Kind: SessionUsage, Usage: Usage{OutputTokens: 250, Requests: 1}}))
	waitStatus(t, m, t10.ID, StatusCancelled)
	waitStatus(t, m, c10.ID, StatusCancelled)
	require.NoError(t, m.Observe(Event{SessionID: sc10, Kind: SessionUsage, Usage: Usage{OutputTokens: 40, Requests: 1}}))

	// More ended tasks than retention keeps, then a compaction.
	for i := range 4 {
		ti := launch(Spec{ParentSessionID: "p6", Description: fmt.Sprintf("filler %d", i), Prompt: "f", Models: abc[2:]})
		finish(ti.ID, Event{Kind: SessionIdle, Text: "filler"})
		_, err := m.Wait(ctx, ti.ID)
		require.NoError(t, err)
	}
	require.NoError(t, m.notes.lanes.Wait(ctx)) // deliveries done
	m.mu.Lock()
	m.led.forgotten += compactEvery // make the compaction due now (it is due at 1,000 forgotten)
	m.mu.Unlock()
	m.maybeCompact()

	// Left live at the crash: a task with a retry and a deadline, a
	// running one with a child, one stopped whose abort never returns.
	t7 := launch(Spec{ParentSessionID: "p7", Description: "live at the crash", Prompt: "l", Models: abc, Timeout: time.Hour})
	finish(t7.ID, Event{Kind: SessionError, Err: err429})
	waitFor(t, m, t7.ID, func(task Task) bool { return len(task.Attempts) == 2 && task.Status == StatusRunning })
	t8 := launch(Spec{ParentSessionID: "p8", Description: "parent at the crash", Prompt: "m", Models: abc[1:]})
	s8 := running(t8.ID).SessionID
	c8 := launch(Spec{ParentSessionID: s8, Description: "child at the crash", Prompt: "n", Models: abc[2:]})
	running(c8.ID)
	// A budgeted tree live at the crash: its figures come back exactly.
	t11 := launch(Spec{ParentSessionID: "p11", Description: "budgeted, live", Prompt: "q", Models: abc, Budget: &Budget{Tokens: 100_000, Spawns: 4}})
	s11 := running(t11.ID).SessionID
	c11 := launch(Spec{ParentSessionID: s11, Description: "child, live", Prompt: "r", Models: abc[1:]})
	require.NoError(t, m.Observe(Event{SessionID: running(c11.ID).SessionID, Kind: SessionUsage, Usage: Usage{InputTokens: 1200, OutputTokens: 300, CachedTokens: 1000, Requests: 3, Cost: 12_500}}))
	require.NoError(t, m.Observe(Event{SessionID: s11, Kind: SessionBusy, Usage: Usage{InputTokens: 70, Requests: 1}}))
	t9 := launch(Spec{ParentSessionID: "p7", Description: "sibling of t7", Prompt: "o", Models: abc[:1], AttemptTimeout: time.Hour})
	finish(t9.ID, Event{Kind: SessionIdle, Text: "t9 answer"})
	waitStatus(t, m, t9.ID, StatusCompleted)
	require.NoError(t, m.notes.lanes.Wait(ctx))
}

// crashRun is the taped first life.
type crashRun struct {
	tape  []tapeStep
	start time.Time // when the first life began
}

var (
	crashRunOnce sync.Once
	crashRunTape *crashRun
	crashRunErr  string
)

// runCrashScenario runs the first life once per test binary.
func runCrashScenario(t *testing.T) *crashRun {
	t.Helper()
	crashRunOnce.Do(func() {
		ok := t.Run("first life", func(t *testing.T) {
			dir := t.TempDir()
			fj, err := OpenFileJournal(dir)
			require.NoError(t, err)
			j := &tapeJournal{Journal: fj}
			w := newCrashWorld()
			start := time.Now()
			m, err := Open(context.Background(), w, append(crashOptions(), WithJournal(j), WithNotifier(&crashRecorder{}))...)
			require.NoError(t, err)
			crashScenario(t, m, w)
			j.crashed.Store(true)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = m.Shutdown(ctx)
			j.mu.Lock()
			crashRunTape = &crashRun{tape: j.tape, start: start}
			j.mu.Unlock()
		})
		if !ok {
			crashRunErr = "the first life failed"
		}
	})
	if crashRunErr != "" {
		t.Fatal(crashRunErr)
	}
	return crashRunTape
}

// crashImage is a journal directory's files as a crash may leave them.
type crashImage struct {
	name  string
	files map[string][]byte
	// want is the index of the snapshot whose records the image must read
	// as (a cut inside a batch reads as the batch before it).
	want int
}

// snapshots writes the tape into a fresh journal, one step at a time, and
// keeps the directory's segment files after each: snapshot k is the
// journal with the first k steps durable.
func snapshots(t testing.TB, tape []tapeStep) []map[string][]byte {
	t.Helper()
	dir := t.TempDir()
	l, err := wal.Open(dir, wal.Options{})
	require.NoError(t, err)
	defer l.Close()
	read := func() map[string][]byte {
		out := map[string][]byte{}
		names, err := os.ReadDir(dir)
		require.NoError(t, err)
		for _, n := range names {
			if strings.HasPrefix(n.Name(), "seg-") {
				b, err := os.ReadFile(filepath.Join(dir, n.Name()))
				require.NoError(t, err)
				out[n.Name()] = b
			}
		}
		return out
	}
	snaps := []map[string][]byte{read()}
	for _, st := range tape {
		if st.compact {
			require.NoError(t, l.Compact(payloadsOf(st.recs)))
		} else {
			require.NoError(t, l.Append(payloadsOf(st.recs)).Wait())
		}
		snaps = append(snaps, read())
	}
	return snaps
}

// lastSeg is the name of the last segment of files.
func lastSeg(files map[string][]byte) string {
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	return names[len(names)-1]
}

// recordEnds walks seg's records from off to its logical end (a header of
// zeros) and returns where each ends.
func recordEnds(seg []byte, off int) []int {
	var ends []int
	for off+12 <= len(seg) && binary.LittleEndian.Uint32(seg[off:]) != 0 || off+12 <= len(seg) && binary.LittleEndian.Uint32(seg[off+4:]) != 0 {
		off += 12 + int(binary.LittleEndian.Uint32(seg[off:])&^(3<<30))
		ends = append(ends, off)
	}
	return ends
}

// eachCrashImage calls f with each image a crash can leave of the taped
// journal: after every step; after every record inside a batch; at byte
// offsets inside the batch (all with -crash.long, else a sample); and with
// a random subset of the batch's pages lost. Images are made one at a time
// (there are many with -crash.long); a cut image keeps 8 KiB of the
// segment's zeroed space after the cut batch, not all of it, so that it
// still ends as a preallocated segment does.
func eachCrashImage(snaps []map[string][]byte, f func(img crashImage) bool) {
	rng := rand.New(rand.NewPCG(27, 1))
	for k := 1; k < len(snaps); k++ {
		if !f(crashImage{name: fmt.Sprintf("after step %d", k), files: snaps[k], want: k}) {
			return
		}
		name := lastSeg(snaps[k])
		prev, ok := snaps[k-1][name]
		if !ok {
			continue // a compaction, or a new segment: replaced whole
		}
		cur := snaps[k][name]
		from := 0
		if ends := recordEnds(prev, 0); len(ends) > 0 {
			from = ends[len(ends)-1]
		}
		ends := recordEnds(cur, from)
		if len(ends) == 0 {
			continue
		}
		to := ends[len(ends)-1]
		whole := cur[:min(len(cur), to+8192)]
		cut := func(what string, zero func(img []byte)) bool {
			files := make(map[string][]byte, len(snaps[k]))
			for n, b := range snaps[k] {
				files[n] = b
			}
			img := slices.Clone(whole)
			zero(img)
			files[name] = img
			want := k - 1
			if bytes.Equal(img, whole) { // what the crash lost were zeros anyway
				want = k
			}
			return f(crashImage{name: fmt.Sprintf("step %d, %s", k, what), files: files, want: want})
		}
		for _, e := range ends[:len(ends)-1] {
			if !cut(fmt.Sprintf("after the record ending at %d", e), func(img []byte) { clear(img[e:to]) }) {
				return
			}
		}
		var offs []int
		if *crashLong {
			for x := from + 1; x < to; x++ {
				offs = append(offs, x)
			}
		} else {
			for range 4 {
				offs = append(offs, from+1+rng.IntN(to-from-1))
			}
		}
		for _, x := range offs {
			if !cut(fmt.Sprintf("cut at byte %d", x), func(img []byte) { clear(img[x:to]) }) {
				return
			}
		}
		if to-from > 4096 || *crashLong {
			lost := func(img []byte) {
				for p := from / 4096 * 4096; p < to; p += 4096 {
					if rng.IntN(2) == 0 {
						clear(img[max(p, from):min(p+4096, to)])
					}
				}
			}
			if !cut("pages lost", lost) {
				return
			}
		}
	}
}

// recordsIn decodes the records files hold, as a restart reads them.
func recordsIn(t testing.TB, files map[string][]byte) (dir string, recs []record) {
	t.Helper()
	dir, err := os.MkdirTemp("", "bgtask-crash-image-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) }) // the caller may remove it sooner
	for n, b := range files {
		require.NoError(t, os.WriteFile(filepath.Join(dir, n), b, 0o644))
	}
	payloads, _, err := wal.ReadOnly(dir, wal.Options{})
	require.NoError(t, err, "a crash image always opens")
	for _, p := range payloads {
		rec, err := unpackData(p, nil)
		require.NoError(t, err)
		recs = append(recs, rec)
	}
	return dir, recs
}

// worldOf is the session service a crash that left recs implies: every
// session a start may have made exists (the one its bind names, else the
// one a start makes for its attempt: an image that may hold anything can
// have renamed it); a run the records ended is over (gone if it was
// stopped); every other run is alive.
func worldOf(recs []record) *crashWorld {
	bound := map[string]string{} // attempt → the session its bind names
	for _, rec := range recs {
		if rec.kind == recSessionBound && rec.attempt.SessionID != "" {
			bound[rec.attempt.ID] = rec.attempt.SessionID
		}
	}
	w := newCrashWorld()
	session := func(att string) *worldSession {
		sid, ok := bound[att]
		if !ok {
			sid = "s-" + att
		}
		if w.sess[sid] == nil {
			w.sess[sid] = &worldSession{attempt: att, state: SessionStateAlive}
			w.byAtt[att] = sid
		}
		return w.sess[sid]
	}
	aborted := map[string]bool{}
	for _, rec := range recs {
		switch rec.kind {
		case recStartRequested, recSessionBound:
			session(rec.attempt.ID)
		case recAbortRequested:
			aborted[rec.attempt.ID] = true
		case recAttemptFinal:
			if w.byAtt[rec.attempt.ID] == "" {
				continue
			}
			session(rec.attempt.ID).endAs(&rec, aborted[rec.attempt.ID])
		}
	}
	return w
}

// endAs ends s as rec, its attempt's final record, says its run ended
// (aborted: an abort was asked for it).
func (s *worldSession) endAs(rec *record, aborted bool) {
	switch {
	case rec.attempt.Status == StatusCompleted:
		s.state, s.end = SessionStateEnded, Event{Kind: SessionIdle, Text: rec.evidence.output}
	case aborted:
		s.state, s.aborted = SessionStateGone, true
	default:
		s.state, s.end = SessionStateEnded, Event{Kind: SessionError, Err: errors.New(rec.attempt.Error)}
	}
}

// before is what the first life had done by the crash: the
// notifications delivered (their delivery is recorded), and the
// notifications produced, by ID.
type before struct {
	delivered []*notice
	produced  map[string]*notice // by ID
	tasks     []string           // every task launched with its first attempt, in order
	launched  []string           // every task launched, its first attempt kept or not
	parent    map[string]string  // task → its parent session
	retried   map[string]int     // task → the last attempt a durable retry_scheduled failed over from
	attempts  map[string][]string
}

func beforeOf(recs []record) before {
	b := before{produced: map[string]*notice{}, attempts: map[string][]string{}, parent: map[string]string{}, retried: map[string]int{}}
	bySeq := map[uint64]*notice{}
	for _, rec := range recs {
		switch rec.kind {
		case recNotifyProduced:
			bySeq[rec.notice.seq] = rec.notice
			b.produced[rec.notice.id] = rec.notice
		case recNotifyDelivered:
			if n := bySeq[rec.notice.seq]; n != nil && !strings.HasPrefix(rec.note, "given up") {
				b.delivered = append(b.delivered, n)
			}
		case recTaskLaunched:
			if !slices.Contains(b.launched, rec.task) {
				b.launched = append(b.launched, rec.task)
			}
			b.parent[rec.task] = rec.spec.parent
		case recRetryScheduled:
			b.retried[rec.task] = max(b.retried[rec.task], rec.attempt.Number)
		case recAttemptCreated:
			if !slices.Contains(b.tasks, rec.task) { // launched whole: with its first attempt
				b.tasks = append(b.tasks, rec.task)
			}
			if !slices.Contains(b.attempts[rec.task], rec.attempt.ID) {
				b.attempts[rec.task] = append(b.attempts[rec.task], rec.attempt.ID)
			}
		}
	}
	return b
}

// drive plays the world after the restart: every run still alive ends its
// turn with an answer that covers every invocation it was given, until
// every task ended.
func drive(t *testing.T, m *Manager, w *crashWorld) {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for range 1000 {
		m.mu.Lock()
		ch := m.waitAny()
		m.mu.Unlock()
		w.mu.Lock()
		if w.woke == nil {
			w.woke = make(chan struct{})
		}
		woke := w.woke
		w.mu.Unlock()
		live := 0
		for _, task := range m.Snapshot().Tasks {
			if task.Status.Terminal() {
				continue
			}
			live++
			if task.Status != StatusRunning || !w.alive(task.SessionID) {
				continue
			}
			ev := Event{SessionID: task.SessionID, Kind: SessionIdle, Text: "answer after the restart", Invocation: max(1, len(task.Invocations))}
			w.turn.Lock()
			if !w.alive(task.SessionID) { // a result ended up in it meanwhile: not this turn
				w.turn.Unlock()
				continue
			}
			// An abort (a deadline, a stop) may have stopped the run since
			// alive said it runs: then no turn ended, and telling one would
			// be the world lying (crashkill_test.go's kills found it).
			if !w.end(task.SessionID, ev) {
				w.turn.Unlock()
				continue
			}
			err := m.Observe(ev)
			w.turn.Unlock()
			if err != nil && !errors.Is(err, ErrStaleEvent) && !errors.Is(err, ErrUnknownSession) {
				t.Fatalf("Observe: %v", err)
			}
		}
		if live == 0 {
			return
		}
		select {
		case <-ch:
		case <-woke:
		case <-deadline:
			for _, task := range m.Snapshot().Tasks {
				if !task.Status.Terminal() {
					t.Logf("live: %s %s pending=%q activity=%q session %s alive=%v invocations=%d", task.ID, task.Status, task.Pending, task.Activity, task.SessionID, w.alive(task.SessionID), len(task.Invocations))
				} else {
					t.Logf("ended: %s %s stop=%v session %s notes", task.ID, task.Status, task.Stop, task.SessionID)
				}
			}
			t.Fatalf("the restarted manager did not end its tasks: %d live", live)
		}
	}
	t.Fatal("the restarted manager did not settle")
}

// checkRestart opens the image in dir as a restart would, drives it to the
// end, and checks every promise against recs (what the image holds).
//
// history is every record committed up to the crash (what the image holds
// and what compaction dropped before it): what the world saw.
func checkRestart(t *testing.T, j Journal, recs, history []record, start time.Time, late bool) {
	t.Helper()
	w := worldOf(history)
	b := beforeOf(history)
	t.Cleanup(func() {
		if t.Failed() {
			for _, r := range recs {
				t.Logf("record %d %s %s %s", r.seq, r.kind, r.task, describe(&r))
			}
		}
	})
	rec := &crashRecorder{w: w}
	now := start.Add(time.Minute)
	if late { // the process was down past every deadline
		now = start.Add(2 * time.Hour)
	}
	clk := clock.NewFake(now)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	m, err := Open(ctx, w, append(crashOptions(), WithJournal(j), WithNotifier(rec), WithClock(clk))...)
	require.NoError(t, err, "a crash image always opens")
	drive(t, m, w)
	require.NoError(t, m.notes.lanes.Wait(ctx))
	for _, id := range b.launched {
		if !slices.Contains(b.tasks, id) {
			_, err := m.Task(id)
			require.Error(t, err, "task %s, launched without its first attempt, never happened", id)
		}
	}
	tasks := map[string]Task{}
	for _, id := range b.tasks {
		if task, err := m.Task(id); err == nil {
			tasks[id] = task
		}
	}
	checkBudgets(t, m, recs)
	require.NoError(t, m.Shutdown(ctx))
	after := rec.all()
	t.Cleanup(func() {
		if t.Failed() {
			for _, task := range tasks {
				t.Logf("after: %s %s %q attempts %d result %q outcome %+v", task.ID, task.Status, task.Error, len(task.Attempts), task.Result, task.Outcome)
			}
			for _, n := range after {
				t.Logf("delivered after: %s %s task %s to %s", n.ID, n.Kind, n.TaskID, n.ParentSessionID)
			}
		}
	})

	// Each task that ended: exactly one final summary delivered, with the
	// ID it had if it was produced before the crash.
	finals := map[string]map[string]bool{} // task → IDs
	rounds := map[string]map[string][]string{}
	answers := map[string]map[int]map[string]bool{}
	note := func(id string, kind NotificationKind, task, parent string, inv int, tasks []string) {
		switch kind {
		case NotifyFinalSummary:
			if finals[task] == nil {
				finals[task] = map[string]bool{}
			}
			finals[task][id] = true
		case NotifyAllComplete:
			if rounds[parent] == nil {
				rounds[parent] = map[string][]string{}
			}
			rounds[parent][id] = tasks
		case NotifyAnswer:
			if answers[task] == nil {
				answers[task] = map[int]map[string]bool{}
			}
			if answers[task][inv] == nil {
				answers[task][inv] = map[string]bool{}
			}
			answers[task][inv][id] = true
		}
	}
	taskOf := func(n *notice) string {
		if ref := n.attempt; ref != "" {
			for task, atts := range b.attempts {
				if slices.Contains(atts, ref) {
					return task
				}
			}
		}
		return ""
	}
	for _, n := range b.delivered {
		note(n.id, n.kind, taskOf(n), n.parent, n.invocation, n.tasks)
	}
	for _, n := range after {
		ids := make([]string, len(n.Tasks))
		for i := range n.Tasks {
			ids[i] = n.Tasks[i].ID
		}
		note(n.ID, n.Kind, n.TaskID, n.ParentSessionID, n.Invocation, ids)
		if p := b.produced[n.ID]; p != nil {
			require.Equal(t, p.kind, n.Kind, "notification %s delivered again as it was produced", n.ID)
		}
	}
	parents := map[string][]string{} // parent → its tasks
	for _, id := range b.tasks {
		parents[b.parent[id]] = append(parents[b.parent[id]], id)
		task, ok := tasks[id]
		if !ok {
			require.Len(t, finals[id], 1, "task %s was forgotten: its final summary was delivered before", id)
			continue
		}
		// A durable retry goes on: the attempt it chose exists.
		require.Greater(t, len(task.Attempts), b.retried[id], "task %s: its durable retry after attempt %d went on", id, b.retried[id])
		require.True(t, task.Status.Terminal(), "task %s ended", id)
		require.Len(t, finals[id], 1, "task %s: exactly one final summary (by ID) over both lives", id)
		for nid, p := range b.produced {
			if p.kind == NotifyFinalSummary && taskOf(p) == id {
				require.True(t, finals[id][nid], "task %s: its final summary keeps the ID it had before the crash", id)
			}
		}
		// No attempt lost or invented: the attempts before the crash come
		// back as they were, and any after them follow its chain.
		had := b.attempts[id]
		require.GreaterOrEqual(t, len(task.Attempts), len(had), "task %s: no attempt lost", id)
		for i, a := range task.Attempts {
			if i < len(had) {
				require.Equal(t, had[i], a.ID, "task %s: attempt %d", id, i+1)
			}
			require.Equal(t, i+1, a.Number)
		}
		// Nothing completed or cancelled without evidence.
		cur := task.Attempts[len(task.Attempts)-1]
		switch task.Status {
		case StatusCompleted:
			s, ok := w.session("s-" + cur.ID)
			require.True(t, ok && s.state == SessionStateEnded && s.end.Kind == SessionIdle, "task %s completed: its session ended with an answer (%+v)", id, s)
		case StatusCancelled:
			s, ok := w.session("s-" + cur.ID)
			require.True(t, !ok || s.aborted || s.late, "task %s cancelled: its session was stopped, or it never had one (%+v)", id, s)
		}
	}
	// No child left running.
	w.mu.Lock()
	for sid, s := range w.sess {
		require.NotEqual(t, SessionStateAlive, s.state, "session %s is still running, its task ended", sid)
	}
	w.mu.Unlock()
	// Each round exactly one all_complete: every task is in exactly one
	// of its parent's, and no round is told twice.
	for parent, ids := range parents {
		in := map[string]int{}
		for _, tasks := range rounds[parent] {
			for _, id := range tasks {
				in[id]++
			}
		}
		for _, id := range ids { // every task ended by now (or was forgotten, having ended)
			require.Equal(t, 1, in[id], "task %s is in exactly one all_complete of %s (%v)", id, parent, rounds[parent])
		}
	}
	// Answers: each invocation answered once (by ID), in order.
	for id, invs := range answers {
		for n, ids := range invs {
			require.Len(t, ids, 1, "task %s invocation %d answered once", id, n)
		}
	}
	for id, task := range tasks {
		for i, inv := range task.Invocations {
			require.Equal(t, i+1, inv.N, "task %s: invocations in order", id)
			require.NotNil(t, inv.Answer, "task %s: invocation %d answered", id, inv.N)
		}
	}
}

// TestCrashAtEveryPoint is the crash harness: see the top of this file.
func TestCrashAtEveryPoint(t *testing.T) {
	run := runCrashScenario(t)
	snaps := snapshots(t, run.tape)
	wantRecs := make([][]record, len(snaps))
	for k := range snaps {
		_, wantRecs[k] = recordsIn(t, snaps[k])
	}
	// history[k] is every record committed by step k.
	history := make([][]record, len(snaps))
	for k, st := range run.tape {
		history[k+1] = history[k]
		if st.compact {
			continue
		}
		for _, r := range st.recs {
			rec, err := decodeRecord(r)
			require.NoError(t, err)
			history[k+1] = append(slices.Clip(history[k+1]), rec)
		}
	}
	full, n := 0, 0
	began := time.Now()
	eachCrashImage(snaps, func(img crashImage) bool {
		i := n
		n++
		dir, recs := recordsIn(t, img.files)
		defer os.RemoveAll(dir)
		require.Equal(t, len(wantRecs[img.want]), len(recs), "%s: reads as the journal after step %d", img.name, img.want)
		for r := range recs {
			require.Equal(t, wantRecs[img.want][r].seq, recs[r].seq, "%s: record %d", img.name, r)
		}
		// Every step's image is restarted in full; a cut image reads as one
		// of those (checked above), and a sample of them is restarted too.
		sample := 5
		if *crashLong {
			sample = 20 // of many more: every byte
		}
		if !strings.HasPrefix(img.name, "after step") && i%sample != 0 {
			return true
		}
		full++
		return t.Run(img.name, func(t *testing.T) {
			fj, err := OpenFileJournal(dir)
			require.NoError(t, err)
			checkRestart(t, fj, recs, history[img.want], run.start, i%2 == 1)
		})
	})
	t.Logf("%d images checked (%d restarted in full) in %v, from %d taped steps", n, full, time.Since(began).Round(time.Millisecond), len(run.tape))
}

// A journal that does not keep a batch whole breaks the Journal contract;
// even so, a restart on what it kept, cut after any record, opens and
// keeps every promise: recovery derives what is owed from state (a task
// launched without its first attempt gets none and is dropped, an end
// without its final summary gets one, a round without its all_complete
// gets it, a durable retry starts its attempt).
func TestCrashAfterEveryRecordOfANonAtomicJournal(t *testing.T) {
	run := runCrashScenario(t)
	var history []record
	var raw []Record
	for _, st := range run.tape {
		if st.compact {
			break // the records before the compaction: every kind of cut
		}
		for _, r := range st.recs {
			rec, err := decodeRecord(r)
			require.NoError(t, err)
			history = append(history, rec)
			raw = append(raw, r)
		}
	}
	for k := 1; k <= len(raw); k++ {
		ok := t.Run(fmt.Sprintf("after record %d (%s)", k, history[k-1].kind), func(t *testing.T) {
			j := &memJournal{recs: cloneRecords(raw[:k])}
			checkRestart(t, j, history[:k], history[:k], run.start, k%2 == 1)
		})
		if !ok {
			break
		}
	}
}
