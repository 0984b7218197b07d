package bgtask

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A directory that is not a journal is an error, not an empty view: an
// operator who mistyped the path must not read "no tasks".
func TestReadFileJournalRefusesADirectoryThatIsNoJournal(t *testing.T) {
	empty := t.TempDir()
	other := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(other, "notes.txt"), []byte("hello"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(other, "seg-x.log"), nil, 0o644))
	file := filepath.Join(other, "notes.txt")
	for name, dir := range map[string]string{"missing": filepath.Join(empty, "nope"), "empty": empty, "other files": other, "a file": file} {
		t.Run(name, func(t *testing.T) {
			_, err := ReadFileJournal(dir)
			require.Error(t, err)
			assert.Contains(t, err.Error(), dir+" is not a journal")
			if name != "a file" {
				assert.ErrorIs(t, err, fs.ErrNotExist)
			}
		})
	}

	fresh := t.TempDir() // a journal just opened, with nothing in it yet, is one
	j, err := OpenFileJournal(fresh)
	require.NoError(t, err)
	require.NoError(t, j.Close())
	v, err := ReadFileJournal(fresh)
	require.NoError(t, err)
	assert.Empty(t, v.Tasks)
}

// Records holds the manager-wide records too: each process life's epoch
// (a restart), and a parent's all_complete, named by its parent session.
func TestReadFileJournalShowsEpochsAndParentLevelRecords(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dir := t.TempDir()
	// A host whose aborts fail: Shutdown leaves the run running, as a
	// crash would, and the next life takes it over.
	host := &testHost{abort: func(context.Context, string) error { return errors.New("unreachable") }}
	life := func() (*Manager, *recorder) {
		j, err := OpenFileJournal(dir)
		require.NoError(t, err)
		rec := &recorder{}
		m, err := Open(ctx, host, WithJournal(j), WithNotifier(rec), WithIDs(SequentialIDs()))
		require.NoError(t, err)
		return m, rec
	}
	m, _ := life()
	task, err := m.Launch(ctx, Spec{ParentSessionID: "chat", Models: mustModels(t, "p/m")})
	require.NoError(t, err)
	waitFor(t, m, task.ID, func(t Task) bool { return t.Status == StatusRunning })
	require.Error(t, m.Shutdown(ctx), "the run is left: the next life ends it")

	m, rec := life()
	ended, err := m.Wait(ctx, task.ID) // the run lost across the restart
	require.NoError(t, err)
	require.Equal(t, StatusInterrupt, ended.Status)
	_, err = m.WaitParent(ctx, "chat")
	require.NoError(t, err)
	require.NoError(t, m.Shutdown(ctx))
	require.Contains(t, rec.Kinds(""), NotifyAllComplete)

	v, err := ReadFileJournal(dir)
	require.NoError(t, err)
	var epochs, allComplete []RecordView
	for _, r := range v.Records {
		switch {
		case r.Kind == "epoch":
			epochs = append(epochs, r)
		case r.Kind == "notification_produced" && r.TaskID == "":
			allComplete = append(allComplete, r)
		}
	}
	require.Len(t, epochs, 2, "one per process life")
	var bound, final uint64
	for _, r := range v.Records {
		switch {
		case r.Kind == "session_bound":
			bound = r.Seq
		case r.Kind == "attempt_finalized":
			final = r.Seq
		}
	}
	assert.True(t, bound < epochs[1].Seq && epochs[1].Seq < final, "the restart is seen between the run's binding and its end")
	assert.Empty(t, epochs[1].TaskID)
	assert.Contains(t, epochs[1].Change, "process life")
	require.Len(t, allComplete, 1)
	assert.Equal(t, "chat", allComplete[0].ParentSessionID)
	assert.Contains(t, allComplete[0].Change, "all_complete")
	for _, r := range v.Records {
		if r.Kind == "task_launched" {
			assert.Equal(t, "chat", r.ParentSessionID, "a launch names its parent")
		}
	}
}
