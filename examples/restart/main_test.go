package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bgtask/bgtask"
)

// TestMain runs the service and the harness roles when the demo re-runs
// this binary as them; otherwise the tests.
func TestMain(m *testing.M) {
	if os.Getenv(role) != "" {
		if err := dispatch(""); err != nil {
			os.Stderr.WriteString("restart: " + err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

func TestAKilledHarnessRecoversItsTasksOnRestart(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var buf bytes.Buffer
	require.NoError(t, run(ctx, &buf, ""), buf.String())
	out := buf.String()
	assert.Contains(t, out, "harness 1 killed mid-flight (exit 3)")
	assert.Equal(t, 3, strings.Count(out, "\nrecovered "), out)
	assert.Contains(t, out, `completed: "finished while the harness was down"`, "the child that ended while no harness was up keeps its answer")
	assert.Equal(t, 2, strings.Count(out, `completed: "done after the restart"`), "the live children were re-adopted and seen through")
	assert.Contains(t, out, "every parent got its final summary exactly once")
}

func TestKeepLeavesTheJournalForCmdBgtask(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	dir := filepath.Join(t.TempDir(), "demo")
	var buf bytes.Buffer
	require.NoError(t, run(ctx, &buf, dir), buf.String())
	assert.Contains(t, buf.String(), "the journal is kept in "+dir)
	v, err := bgtask.ReadFileJournal(dir)
	require.NoError(t, err)
	require.Len(t, v.Tasks, 3)
	for _, task := range v.Tasks {
		assert.Equal(t, bgtask.StatusCompleted, task.Status, task.ID)
	}
	epochs := 0
	for _, r := range v.Records {
		if r.Kind == "epoch" {
			epochs++
		}
	}
	assert.Equal(t, 2, epochs, "the two harness lives: the restart is in the journal")

	err = run(ctx, &buf, dir)
	assert.ErrorContains(t, err, "the directory is not empty", "a second run does not mix its journal into the first's")
}
