package bgtask

import (
	"context"
	"slices"
	"testing"

	"github.com/bgtask/bgtask/internal/clock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// copyWhen is copyRecs once the records kept satisfy ok (await): a
// commit's append may come after what it holds is visible in memory, so
// a crash copied at once could miss it.
func (j *memJournal) copyWhen(t *testing.T, ok func([]Record) bool) []Record {
	t.Helper()
	j.await(t, ok)
	return j.copyRecs()
}

// hasKind says whether recs hold a record of kind for task.
func hasKind(recs []Record, task, kind string) bool {
	return slices.ContainsFunc(recs, func(r Record) bool { return r.TaskID == task && r.Kind == kind })
}

// copyRecs is what the journal holds now: what a crash leaves.
func (j *memJournal) copyRecs() []Record {
	j.mu.Lock()
	defer j.mu.Unlock()
	out := make([]Record, len(j.recs))
	for i, r := range j.recs {
		r.Data = append([]byte(nil), r.Data...)
		out[i] = r
	}
	return out
}

// Notifications produced and not delivered are delivered again after a
// restart, in order, with the same Notification.ID (README "Durable").
// Here a parent's delivery is stuck on its first notification while its
// round of twenty tasks ends: twenty-one are produced, none delivered, when the
// process dies. The next life delivers all twenty-one, in their order.
func TestARestartRedeliversWhatWasNotDeliveredInOrder(t *testing.T) {
	ctx := testCtx(t)
	j := &memJournal{}
	release := make(chan struct{})
	stuck := NotifierFunc(func(ctx context.Context, _ Notification) error {
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	})
	m1, err := Open(ctx, &testHost{}, WithJournal(j), WithNotifier(stuck), WithIDs(SequentialIDs()), WithClock(clock.NewFake(t0)))
	require.NoError(t, err)
	var tasks []Task
	for range 20 {
		task, err := m1.Launch(ctx, Spec{ParentSessionID: "p", Prompt: "p", Models: oneModel})
		require.NoError(t, err)
		tasks = append(tasks, waitStatus(t, m1, task.ID, StatusRunning))
	}
	for _, task := range tasks {
		require.NoError(t, m1.Observe(Event{SessionID: task.SessionID, Kind: SessionIdle, Text: "done " + task.ID}))
		_, err := m1.Wait(ctx, task.ID) // durable: its final summary with it
		require.NoError(t, err)
	}
	crashed := j.copyRecs() // the process dies here: nothing was delivered
	close(release)
	require.NoError(t, m1.Shutdown(ctx))

	type owed struct {
		seq uint64
		id  string
	}
	var want []owed
	for _, r := range crashed {
		rec, err := decodeRecord(r)
		require.NoError(t, err)
		if rec.kind == recNotifyProduced {
			want = append(want, owed{rec.notice.seq, rec.notice.id})
		}
	}
	require.Len(t, want, 21, "twenty final summaries and the round's all_complete")

	rec := &recorder{}
	m2, err := Open(ctx, &testHost{}, WithJournal(&memJournal{recs: crashed}), WithNotifier(rec), WithIDs(SequentialIDs()), WithClock(clock.NewFake(t0)))
	require.NoError(t, err)
	require.NoError(t, m2.Shutdown(ctx)) // delivers what is queued before it returns
	var got []owed
	for _, n := range rec.All() {
		got = append(got, owed{n.Seq, n.ID})
	}
	assert.Equal(t, want, got, "every notification owed, once, in the order it was produced, with its ID")
}
