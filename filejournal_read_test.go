package bgtask

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/bgtask/bgtask/internal/clock"
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

// A model skipped for a cooldown and a health reset by hand each read as
// one line that says what happened: which model, why, until when, where
// the attempt went; which target was reset.
func TestReadFileJournalDescribesASkipAndAHealthReset(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dir := t.TempDir()
	j, err := OpenFileJournal(dir)
	require.NoError(t, err)
	t0 := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	host := NewFuncHost(func(_ context.Context, run Run) (string, error) {
		if run.Model.Provider == "a" {
			return "", throttledErr{after: 30 * time.Second}
		}
		return "ok", nil
	})
	m, err := Open(ctx, host, WithJournal(j), WithClock(clock.NewFake(t0)), WithIDs(SequentialIDs()), WithHealth(HealthPolicy{}))
	require.NoError(t, err)
	first, err := m.Launch(ctx, Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one", "b/two")})
	require.NoError(t, err)
	_, err = m.Wait(ctx, first.ID) // a/one answers 429: it cools for 30s
	require.NoError(t, err)
	second, err := m.Launch(ctx, Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one", "b/two")})
	require.NoError(t, err)
	done, err := m.Wait(ctx, second.ID)
	require.NoError(t, err)
	require.Len(t, done.Skips, 1, "the second task skips the cooling model")
	require.NoError(t, m.ResetHealth(ctx, "a/one"))
	require.NoError(t, m.Shutdown(ctx))

	v, err := ReadFileJournal(dir)
	require.NoError(t, err)
	var skips, resets []RecordView
	for _, r := range v.Records {
		switch r.Kind {
		case "model_skipped":
			skips = append(skips, r)
		case "health_reset":
			resets = append(resets, r)
		}
	}
	require.Len(t, skips, 1)
	assert.Equal(t, second.ID, skips[0].TaskID)
	assert.Equal(t, "attempt 1 skipped a/one, cooling (rate_limited until 2026-12-02T10:00:30Z): it runs on b/two", skips[0].Change)
	require.Len(t, resets, 1)
	assert.Empty(t, resets[0].TaskID, "a reset is manager-wide")
	assert.Equal(t, "health of a/one reset by hand: its cooldown ended", resets[0].Change)

	var seen []string
	for _, r := range v.RecordsOf(done) {
		seen = append(seen, r.Kind)
	}
	assert.Contains(t, seen, "model_skipped", "the task's own records list its skip")
}
