package bgtask

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask/internal/wal"
)

var allStatuses = []Status{StatusPending, StatusRunning, StatusCompleted, StatusError, StatusCancelled, StatusInterrupt}

func TestTransitionTable(t *testing.T) {
	allowed := map[[2]Status]bool{
		{StatusPending, StatusPending}:   true,
		{StatusPending, StatusRunning}:   true,
		{StatusPending, StatusError}:     true,
		{StatusPending, StatusCancelled}: true,
		{StatusPending, StatusInterrupt}: true,
		{StatusRunning, StatusCompleted}: true,
		{StatusRunning, StatusError}:     true,
		{StatusRunning, StatusCancelled}: true,
		{StatusRunning, StatusInterrupt}: true,
	}
	for _, from := range allStatuses {
		for _, to := range allStatuses {
			assert.Equal(t, allowed[[2]Status{from, to}], canTransition(from, to), "%s → %s", from, to)
		}
		if from.Terminal() {
			for _, to := range allStatuses {
				assert.False(t, canTransition(from, to), "terminal %s must not move to %s", from, to)
			}
		}
		assert.False(t, canTransition(from, "paused"), "an unknown status is never allowed")
		assert.False(t, canTransition("paused", from))
	}
	assert.ElementsMatch(t, allStatuses, statusList[:], "the dense table covers every status")
}

func TestStatusTerminal(t *testing.T) {
	for _, s := range allStatuses {
		want := s != StatusPending && s != StatusRunning
		assert.Equal(t, want, s.Terminal(), s)
	}
	assert.False(t, Status("bogus").Terminal())
}

func newTestLedger(t *testing.T) (*ledger, *entry) {
	t.Helper()
	l := newLedger(SequentialIDs())
	l.recordAll()
	e, err := l.launch(&taskInfo{id: "task-1", parent: "p", models: mustModels(t, "a/one", "b/two"), maxAttempts: 2, launchedAt: t0})
	require.NoError(t, err)
	return l, e
}

func TestLedgerRefusesWritesToTerminalAttempts(t *testing.T) {
	l, e := newTestLedger(t)
	first := e.cur().ID
	require.NoError(t, l.bindSession(e, first, "ses-1", t0))
	require.NoError(t, l.finalize(e, first, StatusCompleted, "", "answer", t0))
	frozen := *e.cur()
	rev := e.revision
	records := len(recordsOf(l, e.id))

	assert.ErrorIs(t, l.finalize(e, first, StatusError, "late", "", t0), errTerminalAttempt)
	assert.ErrorIs(t, l.finalize(e, first, StatusCompleted, "", "other", t0), errTerminalAttempt)
	assert.ErrorIs(t, l.setPending(e, first, PendingQueued, t0), errTerminalAttempt)
	assert.ErrorIs(t, l.bindSession(e, first, "ses-9", t0), errTerminalAttempt)
	assert.Equal(t, frozen, *e.cur(), "the terminal attempt is unchanged")
	assert.Equal(t, rev, e.revision)
	assert.Len(t, recordsOf(l, e.id), records, "refused writes append nothing")
}

func TestLedgerRefusesWritesToSupersededAttempts(t *testing.T) {
	l, e := newTestLedger(t)
	first := e.cur().ID
	require.NoError(t, l.bindSession(e, first, "ses-1", t0))
	failed, next, err := l.scheduleRetry(e, "Too Many Requests", t0)
	require.NoError(t, err)
	assert.Equal(t, first, failed.ID)
	assert.Equal(t, StatusError, failed.Status)
	assert.Equal(t, next.ID, e.cur().ID)
	assert.Equal(t, StatusPending, next.Status)
	assert.Equal(t, "b/two", next.Model.String())

	assert.ErrorIs(t, l.bindSession(e, first, "ses-2", t0), errTerminalAttempt)
	require.NoError(t, l.bindSession(e, next.ID, "ses-2", t0))
	assert.Error(t, l.bindSession(e, next.ID, "ses-3", t0), "bound twice")
}

func TestLedgerRetryOrderIsFinalizeThenCreate(t *testing.T) {
	l, e := newTestLedger(t)
	require.NoError(t, l.bindSession(e, e.cur().ID, "ses-1", t0))
	_, _, err := l.scheduleRetry(e, "x", t0)
	require.NoError(t, err)
	var kinds []recordKind
	for _, r := range recordsOf(l, e.id) {
		kinds = append(kinds, r.kind)
	}
	assert.Equal(t, []recordKind{
		recTaskLaunched, recAttemptCreated, recSessionBound,
		recAttemptFinal, recRetryScheduled, recAttemptCreated,
	}, kinds)
	recs := recordsOf(l, e.id)
	for i := 1; i < len(recs); i++ {
		assert.Greater(t, recs[i].seq, recs[i-1].seq, "sequence grows")
	}
}

func TestLedgerRefusesASecondLiveAttemptAndDuplicateSessions(t *testing.T) {
	l, e := newTestLedger(t)
	extra, err := l.newAttempt(2, e.info.modelFor(2))
	require.NoError(t, err)
	_, err = l.apply(record{kind: recAttemptCreated, at: t0, task: e.info.id, attempt: extra})
	assert.ErrorIs(t, err, errBadTransition, "a new attempt while the current one is live")
	require.NoError(t, l.bindSession(e, e.cur().ID, "ses-1", t0))

	_, other := func() (*ledger, *entry) {
		o, err := l.launch(&taskInfo{id: "task-2", parent: "p", models: mustModels(t, "a/one"), maxAttempts: 1, launchedAt: t0})
		require.NoError(t, err)
		return l, o
	}()
	assert.Error(t, l.bindSession(other, other.cur().ID, "ses-1", t0), "a session belongs to one attempt")
	_, err = l.launch(&taskInfo{id: "task-2", parent: "p", models: mustModels(t, "a/one"), maxAttempts: 1})
	assert.Error(t, err, "task ids are unique")
}

func TestLedgerRefusesPendingToCompleted(t *testing.T) {
	l, e := newTestLedger(t)
	assert.ErrorIs(t, l.finalize(e, e.cur().ID, StatusCompleted, "", "x", t0), errBadTransition)
	assert.ErrorIs(t, l.finalize(e, e.cur().ID, StatusRunning, "", "", t0), errBadTransition)
}

func TestModelStringAndParse(t *testing.T) {
	tests := []struct {
		give    string
		want    Model
		wantErr bool
	}{
		{give: "openai/gpt-5.4-mini", want: Model{Provider: "openai", ID: "gpt-5.4-mini"}},
		{give: "openrouter/meta/llama-4", want: Model{Provider: "openrouter", ID: "meta/llama-4"}},
		{give: "gpt-primary", want: Model{ID: "gpt-primary"}},
		{give: "", wantErr: true},
		{give: "/x", wantErr: true},
		{give: "x/", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.give, func(t *testing.T) {
			got, err := ParseModel(tt.give)
			if tt.wantErr {
				assert.Error(t, err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
			assert.Equal(t, tt.give, got.String())
		})
	}
	assert.Equal(t, "anthropic/claude-sonnet-4.5 (thinking)", Model{Provider: "anthropic", ID: "claude-sonnet-4.5", Variant: "thinking"}.String())
}

func TestLedgerTiesRecordKindToStatus(t *testing.T) {
	l, e := newTestLedger(t)
	a := *e.cur()
	bad := []record{
		{kind: recAttemptPending, attempt: func() Attempt { x := a; x.Pending = ""; return x }()},
		{kind: recAttemptFinal, attempt: func() Attempt { x := a; x.Status = StatusError; return x }()}, // no CompletedAt
		{kind: recSessionBound, attempt: func() Attempt { x := a; x.SessionID = "s"; return x }()},      // still pending
	}
	for _, r := range bad {
		r.task, r.at = e.info.id, t0
		_, err := l.apply(r)
		assert.ErrorIs(t, err, errBadTransition, r.kind.String())
	}
	assert.Equal(t, a, *e.cur())
}

type dupIDs struct{}

func (dupIDs) NewID(kind string) string { return kind + "-same" }

func TestDuplicateIDsAreRefusedBeforeAnythingIsRecorded(t *testing.T) {
	l := newLedger(dupIDs{})
	e, err := l.launch(&taskInfo{id: "t1", parent: "p", models: mustModels(t, "a/one", "b/two"), maxAttempts: 2, launchedAt: t0})
	require.NoError(t, err)
	_, err = l.launch(&taskInfo{id: "t1", parent: "p", models: mustModels(t, "a/one"), maxAttempts: 1, launchedAt: t0})
	assert.Error(t, err)
	_, err = l.launch(&taskInfo{id: "t2", parent: "p", models: mustModels(t, "a/one"), maxAttempts: 1, launchedAt: t0})
	assert.Error(t, err, "attempt id reused")
	assert.NotContains(t, l.tasks, "t2", "a refused launch leaves no trace")

	require.NoError(t, l.bindSession(e, e.cur().ID, "ses-1", t0))
	before := *e.cur()
	_, _, err = l.scheduleRetry(e, "x", t0)
	assert.Error(t, err)
	assert.Equal(t, before, *e.cur(), "a refused retry leaves the current attempt running")
}

// A record round-trips the journal's encoding exactly, and any cut of it
// is an error, never a panic.
func TestRecordEncodingRoundTripsAndRefusesCuts(t *testing.T) {
	at := time.Date(2026, 12, 1, 9, 30, 0, 42, time.FixedZone("", -5*3600))
	rec := record{seq: 7, kind: recTaskLaunched, task: "t1", at: at, recordExt: &recordExt{spec: &taskInfo{
		id: "t1", parent: "p", description: "d", agent: "a", prompt: "q", maxAttempts: 2, launchedAt: at,
		models: []Model{{Provider: "x", ID: "1", Variant: "v"}, {Provider: "y", ID: "2"}}, metadata: map[string]string{"k": "v"},
	}}}
	enc, err := encodeRecord(&rec)
	require.NoError(t, err)
	assert.Equal(t, "task_launched", enc.Kind)
	got, err := decodeRecord(enc)
	require.NoError(t, err)
	assert.Equal(t, *rec.spec, *got.spec)
	assert.True(t, got.at.Equal(at))
	for cut := range len(enc.Data) {
		_, err := decodeRecord(Record{Seq: 7, Data: enc.Data[:cut]})
		assert.Error(t, err, "cut at %d", cut)
	}
}

// The file journal stores a record's Data alone, behind a zero byte, and
// still reads a payload packed the way it was written before (the
// Record's fields, then Data): Replay gives the same Record either way,
// and the ledger reads the same record.
func TestTheFileJournalReadsBothPayloadFormats(t *testing.T) {
	at := time.Date(2026, 12, 1, 9, 30, 0, 0, time.UTC)
	recs := []record{
		{seq: 1, kind: recTaskLaunched, task: "t1", at: at, recordExt: &recordExt{spec: &taskInfo{id: "t1", parent: "p", maxAttempts: 1, launchedAt: at, models: []Model{{Provider: "x", ID: "1"}}}}},
		{seq: 2, kind: recSessionBound, task: "t1", at: at, attempt: Attempt{ID: "a1", Token: "k1", SessionID: "s1", Number: 1, Status: StatusRunning, Model: Model{Provider: "x", ID: "1"}, StartedAt: at}},
	}
	payloads, err := encodePayloads(recs)
	require.NoError(t, err)
	for i, rec := range recs {
		want, err := encodeRecord(&rec)
		require.NoError(t, err)
		assert.Equal(t, append([]byte{dataMark}, want.Data...), payloads[i], "a zero byte, then Data")
		for _, p := range [][]byte{payloads[i], packRecord(&want)} {
			r, got, err := unpackRecord(p)
			require.NoError(t, err)
			assert.Equal(t, want, r, "the Record, with its fields")
			again, err := unpackData(p, nil)
			require.NoError(t, err)
			assert.Equal(t, got, again)
			assert.Equal(t, rec.seq, got.seq)
			assert.Equal(t, rec.kind, got.kind)
			assert.Equal(t, rec.attempt.SessionID, got.attempt.SessionID)
		}
	}
	_, _, err = unpackRecord([]byte{dataMark})
	assert.Error(t, err, "a zero byte and no record")
}

// A file journal whose checksums hold but one of whose records is not a
// record bgtask wrote — far into the replay, where the records are decoded
// on a goroutine of their own — is refused by Open with an error naming
// the record, and the decoding goroutine is gone (TestMain's goleak).
func TestOpenRefusesAnUndecodableRecordFarIntoTheReplay(t *testing.T) {
	for _, at := range []int{0, replayChunk / 2, 3*replayChunk + 5} {
		dir := t.TempDir()
		l, err := wal.Open(dir, wal.Options{})
		require.NoError(t, err)
		led := newLedger(SequentialIDs())
		led.keepLog = true
		t0 := time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC)
		var payloads [][]byte
		for i := 0; len(payloads) < 4*replayChunk; i++ {
			e, err := led.launch(&taskInfo{id: fmt.Sprintf("t%d", i), parent: "p", models: []Model{{ID: "m"}}, maxAttempts: 1, launchedAt: t0})
			require.NoError(t, err)
			require.NoError(t, led.bindSession(e, e.cur().ID, fmt.Sprintf("s%d", i), t0))
			require.NoError(t, led.finalize(e, e.cur().ID, StatusCompleted, "", "ok", t0))
			p, err := encodePayloads(led.log)
			require.NoError(t, err)
			payloads, led.log = append(payloads, p...), led.log[:0]
		}
		payloads[at] = []byte{dataMark, recordFormat, 0xff} // a sequence cut short
		require.NoError(t, l.Append(payloads).Wait())
		require.NoError(t, l.Close())
		j, err := OpenFileJournal(dir)
		require.NoError(t, err)
		m, err := Open(context.Background(), &benchHost{}, WithJournal(j))
		require.Error(t, err, "record %d", at)
		assert.Contains(t, err.Error(), "decoding record")
		if m != nil {
			_ = m.Shutdown(context.Background())
		}
	}
}
