package bgtask

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestFileJournalOptions: WithSegmentSize rolls the journal over into
// more segment files, WithSyncEachCommit and a nil option are accepted,
// and what the journal holds replays whole in the next process.
func TestFileJournalOptions(t *testing.T) {
	dir := t.TempDir()
	fn := func(_ context.Context, run Run) (string, error) { return "done " + run.TaskID, nil }
	j, err := OpenFileJournal(dir, WithSegmentSize(2048), WithSyncEachCommit(), nil)
	require.NoError(t, err)
	m, err := Open(context.Background(), NewFuncHost(fn), WithJournal(j))
	require.NoError(t, err)
	var ids []string
	for i := range 20 {
		task, err := m.Launch(context.Background(), Spec{ParentSessionID: "p", Prompt: fmt.Sprint("job ", i), Models: []Model{{ID: "m"}}})
		require.NoError(t, err)
		ids = append(ids, task.ID)
	}
	for _, id := range ids {
		task, err := m.Wait(context.Background(), id)
		require.NoError(t, err)
		require.Equal(t, StatusCompleted, task.Status)
	}
	require.NoError(t, m.Shutdown(context.Background()))

	segs, err := filepath.Glob(filepath.Join(dir, "seg-*.log"))
	require.NoError(t, err)
	require.Greater(t, len(segs), 1, "2 KiB segments: twenty lifecycles take more than one")
	for _, s := range segs[:len(segs)-1] {
		fi, err := os.Stat(s)
		require.NoError(t, err)
		require.Less(t, fi.Size(), int64(64<<10), "%s: a segment is rolled over near its size, not at the 64 MiB default", s)
	}

	j2, err := OpenFileJournal(dir)
	require.NoError(t, err)
	m2, err := Open(context.Background(), NewFuncHost(fn), WithJournal(j2))
	require.NoError(t, err)
	defer func() { require.NoError(t, m2.Shutdown(context.Background())) }()
	for _, id := range ids {
		task, err := m2.Task(id)
		require.NoError(t, err, id)
		require.Equal(t, StatusCompleted, task.Status)
		require.Equal(t, "done "+id, task.Result)
	}
}
