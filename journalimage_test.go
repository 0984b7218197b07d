package bgtask

// Journal images Open must refuse, with an error that says where, or
// survive: the regression tests of what FuzzOpen found, and of the
// location every replay error names.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask/internal/wal"
)

// completedTasks are the records of n tasks launched from p, each run in
// its session and completed.
func completedTasks(t *testing.T, n int) []record {
	t.Helper()
	led := newLedger(SequentialIDs())
	led.keepLog = true
	for i := range n {
		e, err := led.launch(&taskInfo{id: fmt.Sprintf("t%d", i), parent: "p", models: []Model{{ID: "m"}}, maxAttempts: 1, launchedAt: t0})
		require.NoError(t, err)
		require.NoError(t, led.bindSession(e, e.cur().ID, fmt.Sprintf("s%d", i), t0))
		require.NoError(t, led.finalize(e, e.cur().ID, StatusCompleted, "", "ok", t0))
	}
	return led.log
}

// writePayloads commits payloads to a new file journal in dir, in one
// batch, and returns its segment and where each record's header is in it.
func writePayloads(t *testing.T, dir string, payloads [][]byte) (seg string, offs []int64) {
	t.Helper()
	l, err := wal.Open(dir, wal.Options{})
	require.NoError(t, err)
	require.NoError(t, l.Append(payloads).Wait())
	require.NoError(t, l.Close())
	off := int64(0)
	for _, p := range payloads {
		offs = append(offs, off)
		off += 12 + int64(len(p))
	}
	segs, err := filepath.Glob(filepath.Join(dir, "seg-*.log"))
	require.NoError(t, err)
	require.Len(t, segs, 1)
	return segs[0], offs
}

// encoded is recs as the file journal stores them.
func encoded(t *testing.T, recs []record) [][]byte {
	t.Helper()
	payloads, err := encodePayloads(recs)
	require.NoError(t, err)
	return payloads
}

// openImage opens the file journal in dir as a restart does, and shuts the
// Manager down if it opened.
func openImage(t *testing.T, dir string) error {
	t.Helper()
	j, err := OpenFileJournal(dir)
	if err != nil {
		return err
	}
	m, err := Open(context.Background(), &benchHost{}, WithJournal(j))
	if m != nil {
		require.NoError(t, m.Shutdown(context.Background()))
	}
	return err
}

// wrappedJournal hides the file journal's type from the Manager, which
// then replays it through Journal.Replay.
type wrappedJournal struct{ Journal }

// A record a replay refuses, or cannot decode, is an error that names the
// segment file, the offset of the record's header, and the record (its
// sequence and kind) — near the start of the journal and far into it
// (where the records are decoded on a goroutine of their own), through
// Open, through Journal.Replay, and through ReadFileJournal.
func TestAReplayErrorNamesTheFileTheOffsetAndTheKind(t *testing.T) {
	bound := func(t *testing.T, seq uint64) []byte {
		p := encoded(t, []record{{seq: seq, kind: recSessionBound, task: "t0", at: t0,
			attempt: Attempt{ID: "x", Status: StatusRunning, SessionID: "s-x", Number: 1}}})
		return p[0]
	}
	tests := []struct {
		name  string
		tasks int // completed tasks before the bad record
		// bad is the record put after them, and its sequence.
		bad  func(t *testing.T, seq uint64) []byte
		want string // what the error says after the record's kind
	}{
		{name: "refused", tasks: 2, bad: bound, want: `(session_bound): ledger: unknown attempt "x"`},
		{name: "refused far in", tasks: replayChunk, bad: bound, want: `(session_bound): ledger: unknown attempt "x"`},
		{name: "cut short", tasks: 2, bad: func(t *testing.T, seq uint64) []byte {
			p := bound(t, seq)
			return p[:len(p)-3]
		}, want: "(session_bound): codec: record cut short or malformed"},
		{name: "cut short far in", tasks: replayChunk + 7, bad: func(t *testing.T, seq uint64) []byte {
			p := bound(t, seq)
			return p[:len(p)-3]
		}, want: "(session_bound): codec: record cut short or malformed"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			recs := completedTasks(t, tt.tasks)
			seq := recs[len(recs)-1].seq + 1
			payloads := append(encoded(t, recs), tt.bad(t, seq))
			payloads = append(payloads, encoded(t, completedTasks(t, 1))...) // and more after it
			dir := t.TempDir()
			seg, offs := writePayloads(t, dir, payloads)
			at := offs[len(recs)]
			want := fmt.Sprintf("journal %s at offset %d: ", seg, at)
			if tt.name == "cut short" || tt.name == "cut short far in" {
				want += "decoding "
			}
			want += fmt.Sprintf("record %d %s", seq, tt.want)

			err := openImage(t, dir)
			require.Error(t, err)
			assert.Equal(t, want, err.Error(), "Open")

			j, err := OpenFileJournal(dir)
			require.NoError(t, err)
			m, err := Open(context.Background(), &benchHost{}, WithJournal(wrappedJournal{j}))
			require.Error(t, err)
			assert.Nil(t, m)
			assert.Equal(t, want, err.Error(), "Open, through Journal.Replay")

			_, err = ReadFileJournal(dir)
			require.Error(t, err)
			assert.Contains(t, err.Error(), fmt.Sprintf("journal %s at offset %d: ", seg, at), "ReadFileJournal")
			assert.Contains(t, err.Error(), "(session_bound)", "ReadFileJournal")
		})
	}
}

// A record that is not one bgtask wrote — no format byte it knows, an
// unknown kind — is named by where it is, and by as much of it as can be
// read.
func TestAnUnreadableRecordIsNamedByItsPlace(t *testing.T) {
	recs := completedTasks(t, 1)
	for _, tt := range []struct {
		name string
		give []byte
		want string
	}{
		{"empty", []byte{dataMark}, "decoding record 0 (kind unknown): not a record of format 1 to 7"},
		{"an unknown kind", []byte{dataMark, recordFormat, 9, 99, 0, 0, 0, 0, 0}, "decoding record 9 (kind unknown): unknown kind 99"},
		{"no sequence", []byte{0x80}, "decoding record 0 (kind unknown): a record with no sequence"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			seg, offs := writePayloads(t, dir, append(encoded(t, recs), tt.give))
			err := openImage(t, dir)
			require.Error(t, err)
			assert.Equal(t, fmt.Sprintf("journal %s at offset %d: %s", seg, offs[len(recs)], tt.want), err.Error())
		})
	}
}

// FuzzOpen found: a compaction's records cut after a launch and before its
// first attempt (a disk that lost them: no crash does, the compaction is
// durable before it is used) made ReadFileJournal panic on the task with
// no attempt. Open drops such a task; ReadFileJournal leaves it out.
func TestReadFileJournalLeavesOutALaunchWithoutItsFirstAttempt(t *testing.T) {
	recs := completedTasks(t, 2)
	dir := t.TempDir()
	writePayloads(t, dir, encoded(t, recs[:len(recs)-3])) // the second task's launch, not its first attempt
	v, err := ReadFileJournal(dir)
	require.NoError(t, err)
	require.Len(t, v.Tasks, 1)
	assert.Equal(t, "t0", v.Tasks[0].ID)
	assert.Len(t, v.Records, len(recs)-3)
	require.NoError(t, openImage(t, dir))
}

// FuzzOpen found: records whose kind needs what they do not carry (a
// notification record with no notification, an orphaned session with no
// session, a closure record with no closure) made the replay, or
// ReadFileJournal, dereference nil. They are refused, and the error says
// where they are.
func TestOpenRefusesARecordWithoutWhatItsKindCarries(t *testing.T) {
	recs := completedTasks(t, 1)
	seq := recs[len(recs)-1].seq + 1
	for _, tt := range []struct {
		name string
		give record
		want string
	}{
		{"a notification", record{seq: seq, kind: recNotifyDelivered, at: t0}, "(notification_delivered): it has no notification"},
		{"a produced one", record{seq: seq, kind: recNotifyProduced, task: "t0", at: t0}, "(notification_produced): it has no notification"},
		{"an orphaned session", record{seq: seq, kind: recSessionOrphan, task: "t0", at: t0, attempt: recs[len(recs)-1].attempt},
			"(session_orphaned): ledger: an orphaned session must be named"},
		{"a closure", record{seq: seq, kind: recBranchClosed, at: t0, recordExt: &recordExt{note: "x"}}, "(branch_closed): ledger: a closure record must carry its closure"},
		{"a closure, nothing else", record{seq: seq, kind: recBranchClosed, at: t0}, "(branch_closed): ledger: a closure record must carry its closure"},
		{"an orphaned session named empty", record{seq: seq, kind: recSessionOrphan, task: "t0", at: t0, attempt: recs[len(recs)-1].attempt, recordExt: &recordExt{note: "x"}},
			"(session_orphaned): ledger: an orphaned session must be named"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			seg, offs := writePayloads(t, dir, encoded(t, append(recs, tt.give)))
			err := openImage(t, dir)
			require.Error(t, err)
			assert.Equal(t, fmt.Sprintf("journal %s at offset %d: record %d %s", seg, offs[len(recs)], seq, tt.want), err.Error())
			_, err = ReadFileJournal(dir)
			if tt.give.kind == recSessionOrphan || tt.give.kind == recBranchClosed {
				require.Error(t, err)
				assert.Contains(t, err.Error(), fmt.Sprintf("%s at offset %d", seg, offs[len(recs)]))
			}
		})
	}
}

// A launch record with a spec no launch makes — no model (the next
// attempt's model would be read from an empty chain), no attempt, a
// negative depth or timeout — is refused.
func TestOpenRefusesALaunchNoSpecMakes(t *testing.T) {
	for _, tt := range []struct {
		name string
		give func(*taskInfo)
		want string
	}{
		{"no model", func(ti *taskInfo) { ti.models = nil }, "a task launched with no model"},
		{"no attempt", func(ti *taskInfo) { ti.maxAttempts = 0 }, "a task launched with 0 attempts at most"},
		{"fewer", func(ti *taskInfo) { ti.maxAttempts = -3 }, "a task launched with -3 attempts at most"},
		{"a negative depth", func(ti *taskInfo) { ti.root, ti.depth = "p", -1 }, "a task launched at depth -1"},
		{"a negative timeout", func(ti *taskInfo) { ti.extra().timeout = -1 }, "a task launched with a negative timeout"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ti := &taskInfo{id: "t", parent: "p", models: []Model{{ID: "m"}}, maxAttempts: 1, launchedAt: t0}
			tt.give(ti)
			dir := t.TempDir()
			seg, _ := writePayloads(t, dir, encoded(t, []record{{seq: 1, kind: recTaskLaunched, task: "t", at: t0, recordExt: &recordExt{spec: ti}}}))
			err := openImage(t, dir)
			require.Error(t, err)
			assert.Equal(t, fmt.Sprintf("journal %s at offset 0: record 1 (task_launched): ledger: %s", seg, tt.want), err.Error())
		})
	}
}

// MaxAttempts has no upper bound, and a journal can say anything: the room
// made for a task's attempts and sessions is a few, not MaxAttempts (a
// task that said 2^60 made the replay, or its second attempt, allocate
// without end).
func TestAHugeMaxAttemptsMakesRoomForAFew(t *testing.T) {
	led := newLedger(SequentialIDs())
	led.keepLog = true
	e, err := led.launch(&taskInfo{id: "t", parent: "p", models: []Model{{ID: "a"}, {ID: "b"}}, maxAttempts: 1 << 60, launchedAt: t0})
	require.NoError(t, err)
	require.NoError(t, led.bindSession(e, e.cur().ID, "s1", t0))
	_, next, err := led.scheduleRetry(e, "429", t0)
	require.NoError(t, err)
	require.NoError(t, led.bindSession(e, next.ID, "s2", t0))
	assert.LessOrEqual(t, cap(e.attempts), 8)
	assert.LessOrEqual(t, cap(e.sessions), 8)

	dir := t.TempDir()
	writePayloads(t, dir, encoded(t, led.log))
	j, err := OpenFileJournal(dir)
	require.NoError(t, err)
	m, err := Open(context.Background(), &benchHost{}, WithJournal(j))
	require.NoError(t, err)
	task, err := m.Task("t")
	require.NoError(t, err)
	assert.Len(t, task.Attempts, 2)
	require.NoError(t, m.Shutdown(context.Background()))
}

// imageOf is the segment files of a journal that holds recs.
func imageOf(t *testing.T, recs []record) map[string][]byte {
	t.Helper()
	dir := t.TempDir()
	seg, _ := writePayloads(t, dir, encoded(t, recs))
	b, err := os.ReadFile(seg)
	require.NoError(t, err)
	return map[string][]byte{filepath.Base(seg): b}
}

// Found probing Open with FuzzOpen's checks (every task ends): a session
// bound to the task it launched (or to a descendant of a task it launched)
// makes the task its own descendant: its turn waits at the children gate
// for its own end, forever. Such a journal (its host handed out the parent's
// session as the child's) is refused.
func TestOpenRefusesASessionBoundToATaskItLaunched(t *testing.T) {
	led := newLedger(SequentialIDs())
	led.keepLog = true
	a, err := led.launch(&taskInfo{id: "a", parent: "p", models: []Model{{ID: "m"}}, maxAttempts: 1, launchedAt: t0})
	require.NoError(t, err)
	require.NoError(t, led.bindSession(a, a.cur().ID, "s-a", t0))
	b, err := led.launch(&taskInfo{id: "b", parent: "s-a", models: []Model{{ID: "m"}}, maxAttempts: 1, launchedAt: t0})
	require.NoError(t, err)
	recs := slices.Clone(led.log)
	for _, tt := range []struct {
		name     string
		session  string
		ancestor string
	}{
		{"the session that launched it", "s-a", "b"},
		{"the session that launched its parent", "p", "a"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			bind := record{seq: recs[len(recs)-1].seq + 1, kind: recSessionBound, task: "b", at: t0, attempt: *b.cur()}
			bind.attempt.Status, bind.attempt.Pending, bind.attempt.SessionID = StatusRunning, "", tt.session
			dir := t.TempDir()
			seg, offs := writePayloads(t, dir, encoded(t, append(slices.Clone(recs), bind)))
			err := openImage(t, dir)
			require.Error(t, err)
			assert.Equal(t, fmt.Sprintf("journal %s at offset %d: record %d (session_bound): ledger: session %q launched task %s, an ancestor of the task it would run (or itself)",
				seg, offs[len(recs)], bind.seq, tt.session, tt.ancestor), err.Error())
		})
	}
}

// Records no life writes but that a journal can hold — notifications for
// tasks that are not there, closures of unknown roots, stops and answers
// out of place, times and numbers at their limits — are refused with an
// error that says where, or opened, and the restart ends every task.
func TestOpenSurvivesOrRefusesRecordsNoLifeWrites(t *testing.T) {
	ended := completedTasks(t, 1) // t0: attempt-1 in session s0, completed
	n := uint64(len(ended))
	led := newLedger(SequentialIDs())
	led.keepLog = true
	e, err := led.launch(&taskInfo{id: "r", parent: "p", models: []Model{{ID: "m"}}, maxAttempts: 2, launchedAt: t0})
	require.NoError(t, err)
	require.NoError(t, led.bindSession(e, e.cur().ID, "s-"+e.cur().ID, t0))
	running := led.log // r: attempt-1 running in s-attempt-1
	m := uint64(len(running))
	with := func(recs []record, more ...record) []record { return append(slices.Clone(recs), more...) }
	note := func(seq uint64, kind recordKind, task string, x *recordExt) record {
		return record{seq: seq, kind: kind, task: task, at: t0, recordExt: x}
	}
	launch := func(ti *taskInfo, pending PendingReason) []record {
		ti.id, ti.parent, ti.models, ti.maxAttempts = "f", "p", []Model{{ID: "m"}}, 1
		if ti.launchedAt.IsZero() {
			ti.launchedAt = t0
		}
		return []record{{seq: 1, kind: recTaskLaunched, task: "f", at: t0, recordExt: &recordExt{spec: ti}},
			{seq: 2, kind: recAttemptCreated, task: "f", at: t0, attempt: Attempt{ID: "fa", Token: "ft", Number: 1, Status: StatusPending, Pending: pending, Model: Model{ID: "m"}}}}
	}
	for _, tt := range []struct {
		name string
		give []record
	}{
		{"a final summary of no task", with(ended, note(n+1, recNotifyProduced, "zz", &recordExt{notice: &notice{id: "n1", seq: 1, kind: NotifyFinalSummary, parent: "p", attempt: "a9", text: "x"}}))},
		{"a round of unknown tasks", with(ended, note(n+1, recNotifyProduced, "", &recordExt{notice: &notice{id: "n1", seq: 1, kind: NotifyAllComplete, parent: "p", tasks: []string{"zz", "t0"}}}))},
		{"an answer to no invocation", with(ended, note(n+1, recNotifyProduced, "t0", &recordExt{notice: &notice{id: "n1", seq: 1, kind: NotifyAnswer, parent: "p", invocation: 7}}))},
		{"a closure notice of no closure", with(ended, note(n+1, recNotifyProduced, "", &recordExt{notice: &notice{id: "n1", seq: 1, kind: NotifyBranchClosed, parent: "p", closure: 99}}))},
		{"a notification of no kind", with(ended, note(n+1, recNotifyProduced, "", &recordExt{notice: &notice{id: "n1", seq: 1, kind: "weird", parent: "p"}}))},
		{"a notification for no one", with(ended, note(n+1, recNotifyProduced, "", &recordExt{notice: &notice{id: "n1", seq: 1, kind: NotifyFinalSummary}}))},
		{"a given-up delivery of nothing", with(ended, note(n+1, recNotifyDelivered, "", &recordExt{note: "given up: x", notice: &notice{seq: 5}}))},
		{"a closure of no task", with(ended, note(n+1, recClosureOpened, "", &recordExt{session: "p", note: "zz"}))},
		{"a closure of a root, open", with(running, note(m+1, recClosureOpened, "", &recordExt{session: "p"}))},
		{"a closure of a task, open", with(running, note(m+1, recClosureOpened, "", &recordExt{session: "s-attempt-1", note: "r"}))},
		{"the last epoch", with(ended, note(n+1, recEpoch, "", &recordExt{epoch: 1<<64 - 1}))},
		{"the last sequence", with(ended, note(1<<64-1, recEpoch, "", &recordExt{epoch: 3}))},
		{"a stop that completes", with(running, note(m+1, recStopRequested, "r", &recordExt{stop: StatusCompleted, note: "x"}))},
		{"a stop withdrawn, never asked", with(running, note(m+1, recStopWithdrawn, "r", &recordExt{note: "x"}))},
		{"an abort of no run", with(ended, record{seq: n + 1, kind: recAbortRequested, task: "zz", at: t0, attempt: Attempt{ID: "zz", SessionID: "s-zz"}})},
		{"a start of no attempt", with(ended, record{seq: n + 1, kind: recStartRequested, task: "zz", at: t0, attempt: Attempt{ID: "zz"}})},
		{"a retry of a running attempt", with(running, record{seq: m + 1, kind: recRetryScheduled, task: "r", at: t0, attempt: Attempt{ID: "attempt-1", Number: 1}})},
		{"an invocation", with(running, record{seq: m + 1, kind: recInvocationAdmitted, task: "r", at: t0, inv: &Invocation{N: 2, Prompt: "x"}})},
		{"an answer", with(running, record{seq: m + 1, kind: recAnswerFiled, task: "r", at: t0, inv: &Invocation{N: 1, Answer: &Answer{Text: "x"}}})},
		{"an answer after the end", with(ended, record{seq: n + 1, kind: recAnswerFiled, task: "t0", at: t0, inv: &Invocation{N: 1, Answer: &Answer{Text: "x"}}})},
		{"an invocation after the end", with(ended, record{seq: n + 1, kind: recInvocationAdmitted, task: "t0", at: t0, inv: &Invocation{N: 2, Prompt: "x"}})},
		{"a launch in the far future", launch(&taskInfo{launchedAt: time.Unix(1<<40, 0), x: &taskExtra{timeout: time.Hour}}, PendingAwaitingSession)},
		{"the longest timeouts", launch(&taskInfo{x: &taskExtra{timeout: 1<<63 - 1, attemptTimeout: 1<<63 - 1}}, PendingAwaitingSession)},
		{"a deep task", launch(&taskInfo{root: "p", depth: 1 << 40}, PendingAwaitingSession)},
		{"a pending reason no one gives", launch(&taskInfo{}, "weird")},
		{"queued", launch(&taskInfo{}, PendingQueued)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			checkOpenImage(t, nil, imageOf(t, tt.give), false)
			checkOpenImage(t, nil, imageOf(t, tt.give), true) // past every deadline
		})
	}
}

// FuzzOpen found: an attempt record that gave an attempt a session without
// binding it (a new attempt created with one, a pending reason recorded
// with one) passed the ledger's checks; the restart then bound the session
// the host found for the attempt, was refused, and ended the task with that
// session left running. Only a bind gives an attempt its session.
func TestOnlyABindGivesAnAttemptItsSession(t *testing.T) {
	led := newLedger(SequentialIDs())
	led.keepLog = true
	e, err := led.launch(&taskInfo{id: "t", parent: "p", models: []Model{{ID: "m"}}, maxAttempts: 2, launchedAt: t0})
	require.NoError(t, err)
	launched := slices.Clone(led.log)
	created := launched[len(launched)-1]
	pending, err := led.pendingRecord(e, e.cur().ID, PendingQueued, t0)
	require.NoError(t, err)
	pending.seq, pending.task = created.seq+1, "t"
	for _, tt := range []struct {
		name string
		recs []record
		want string
	}{
		{"created with a session", func() []record {
			recs := slices.Clone(launched)
			recs[len(recs)-1].attempt.SessionID = "s-x"
			return recs
		}(), "(attempt_created): ledger: transition not allowed: a new attempt must be pending, with no session, and number 1"},
		{"pending with a session", func() []record {
			p := pending
			p.attempt.SessionID = "s-x"
			return append(slices.Clone(launched), p)
		}(), "(attempt_pending): ledger: attempt attempt-1: only a bind gives it a session"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			seg, offs := writePayloads(t, dir, encoded(t, tt.recs))
			last := tt.recs[len(tt.recs)-1]
			err := openImage(t, dir)
			require.Error(t, err)
			assert.Equal(t, fmt.Sprintf("journal %s at offset %d: record %d %s", seg, offs[len(offs)-1], last.seq, tt.want), err.Error())
		})
	}
	// And the live ledger refuses them too.
	p := pending
	p.attempt.SessionID = "s-x"
	assert.Error(t, led.put(e, &p))
}
