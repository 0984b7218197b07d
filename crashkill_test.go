package bgtask

// The crash harness's other half: the first life (crashScenario) runs in a
// child process — this test binary, run again — on a real file journal,
// and the parent kills it with SIGKILL at chosen points: after the child
// said a given batch was durable (early, in a retry, at an Extend, in the
// children gate, at a branch closure, after the compaction, near the end,
// after the end) and once at a random moment. After each kill the parent
// reopens the directory the dead child left, as a restart would, on the
// session service the journal implies (the child's own world died with
// it), drives it until every task ended, and checks every promise
// (checkRestart). It also checks the kill lost nothing the child was told
// was durable, and left the journal as a prefix of the commits: what it
// held after some batch, never part of one. With -crash.long the child is
// killed after every batch.
//
// What the world saw is every record committed before the kill, including
// those a compaction then dropped from the journal: so the child also
// writes each batch (and each compaction) to a side file, "history", in
// commit order, before the journal has it. A process kill loses nothing a
// write returned from, so the side file holds at least what the journal
// holds; the parent finds which prefix of it the journal is, and that
// prefix is the history of this crash.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask/internal/wal"
)

const (
	killChildEnv   = "BGTASK_CRASHKILL_CHILD"
	killDirEnv     = "BGTASK_CRASHKILL_DIR"
	killHistoryEnv = "BGTASK_CRASHKILL_HISTORY"
)

// killStep is one line of the side file: a batch appended, or a compaction
// to the records it keeps.
type killStep struct {
	Compact bool        `json:"compact,omitempty"`
	Recs    []killEntry `json:"recs"`
}

type killEntry struct {
	Seq  uint64 `json:"seq"`
	Data []byte `json:"data"`
}

// killJournal is the child's journal: a file journal that writes every
// batch and compaction to the side file before handing it on, and prints
// "durable N" once batch N (and so every batch before it: the file
// journal makes them durable in order) is durable.
type killJournal struct {
	Journal
	side    *os.File
	mu      sync.Mutex
	n       int // batches appended
	durable int // the last batch reported durable
}

func (j *killJournal) note(compact bool, b []Record) {
	st := killStep{Compact: compact, Recs: make([]killEntry, len(b))}
	for i := range b {
		st.Recs[i] = killEntry{Seq: b[i].Seq, Data: b[i].Data}
	}
	line, err := json.Marshal(st)
	if err == nil {
		_, err = j.side.Write(append(line, '\n')) // one write: a kill keeps it whole, or its line is cut (and ignored)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "crash child: history:", err)
		os.Exit(2)
	}
}

func (j *killJournal) Append(b []Record) Commit {
	j.mu.Lock()
	j.n++
	n := j.n
	j.note(false, b)
	j.mu.Unlock()
	return killCommit{j: j, c: j.Journal.Append(b), n: n}
}

func (j *killJournal) Compact(keep []Record) error {
	j.mu.Lock()
	j.note(true, keep)
	j.mu.Unlock()
	return j.Journal.Compact(keep)
}

type killCommit struct {
	j *killJournal
	c Commit
	n int
}

func (c killCommit) Wait() error {
	err := c.c.Wait()
	if err == nil {
		c.j.mu.Lock()
		if c.n > c.j.durable {
			c.j.durable = c.n
			fmt.Fprintf(os.Stdout, "durable %d\n", c.n)
		}
		c.j.mu.Unlock()
	}
	return err
}

// crashKillChild is the child: the first life on the journal in the
// directory the parent gave, then "done N", then it waits to be killed.
// It never returns (but for a failure, which the parent reports).
func crashKillChild(t *testing.T) {
	fj, err := OpenFileJournal(os.Getenv(killDirEnv))
	require.NoError(t, err)
	side, err := os.OpenFile(os.Getenv(killHistoryEnv), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	require.NoError(t, err)
	j := &killJournal{Journal: fj, side: side}
	w := newCrashWorld()
	fmt.Fprintln(os.Stdout, "begin")
	m, err := Open(context.Background(), w, append(crashOptions(), WithJournal(j), WithNotifier(&crashRecorder{}))...)
	require.NoError(t, err)
	crashScenario(t, m, w)
	j.mu.Lock()
	fmt.Fprintf(os.Stdout, "done %d\n", j.n)
	j.mu.Unlock()
	// Killed here, or, should the parent be gone (its end of stdin
	// closes), or never kill it, gone without a trace.
	eof := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(eof)
	}()
	select {
	case <-eof:
	case <-time.After(time.Minute):
	}
	os.Exit(0)
}

// killed is what a child killed left.
type killed struct {
	dir, history string
	start        time.Time     // before the child began
	out          []string      // what it printed
	durable      int           // the last batch it said was durable
	done         int           // batches appended by the end of the scenario; -1 if it did not get there
	took         time.Duration // from "begin" (the first life's start) to "done"
}

// killChild runs the child, and kills it once kill says so (after a line
// it printed), or once after passed since its first life began (if > 0),
// or once it printed "done".
// Every wait is bounded: a child that hangs is killed and fails the test.
func killChild(t *testing.T, kill func(durable int) bool, after time.Duration) killed {
	t.Helper()
	base := t.TempDir()
	k := killed{dir: filepath.Join(base, "journal"), history: filepath.Join(base, "history"), done: -1}
	require.NoError(t, os.Mkdir(k.dir, 0o755))

	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashByKillingAProcess$")
	cmd.Env = append(os.Environ(), killChildEnv+"=1", killDirEnv+"="+k.dir, killHistoryEnv+"="+k.history)
	outR, outW, err := os.Pipe()
	require.NoError(t, err)
	defer outR.Close()
	inR, inW, err := os.Pipe()
	require.NoError(t, err)
	defer inW.Close() // after the child is gone: until then it waits to be killed
	cmd.Stdin, cmd.Stdout, cmd.Stderr = inR, outW, outW
	k.start = time.Now()
	err = cmd.Start()
	outW.Close()
	inR.Close()
	require.NoError(t, err)
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	reaped := false
	lines, quit := make(chan string, 64), make(chan struct{})
	defer func() { // also when the test fails first: the child goes too
		close(quit)
		if !reaped {
			_ = cmd.Process.Kill()
			_ = waitBounded(exited)
		}
	}()
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(outR)
		sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			case <-quit:
				return
			}
		}
	}()
	output := func() string { return strings.Join(k.out, "\n") }
	var fire <-chan time.Time // armed at "begin", with after > 0
	var begun time.Time
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	deadline := time.NewTimer(60 * time.Second)
	defer deadline.Stop()
	stop := func() {
		_ = cmd.Process.Kill()
	}
	hung := ""
	for alive := true; alive; {
		select {
		case line, ok := <-lines:
			if !ok {
				stop()
				err, reaped = waitBounded(exited), true
				t.Fatalf("the child exited (%v) before it was killed; its output:\n%s", err, output())
			}
			k.out = append(k.out, line)
			if line == "begin" {
				begun = time.Now()
				if after > 0 {
					timer = time.NewTimer(after)
					fire = timer.C
				}
			} else if n, ok := strings.CutPrefix(line, "durable "); ok {
				v, err := strconv.Atoi(n)
				require.NoError(t, err, line)
				require.Greater(t, v, k.durable, "durable batches count up")
				k.durable = v
				if kill != nil && kill(v) {
					stop()
					alive = false
				}
			} else if n, ok := strings.CutPrefix(line, "done "); ok {
				k.done, err = strconv.Atoi(n)
				require.NoError(t, err, line)
				k.took = time.Since(begun)
				stop()
				alive = false
			}
		case <-fire:
			stop()
			alive = false
		case <-deadline.C:
			stop()
			alive = false
			hung = "the child did not reach its kill point in 60s: killed"
		}
	}
	// Killed: its output ends (what it printed before the kill is read),
	// then it is reaped.
	drain := time.NewTimer(10 * time.Second)
	defer drain.Stop()
	for open := true; open; {
		select {
		case line, ok := <-lines:
			if !ok {
				open = false
				break
			}
			k.out = append(k.out, line)
			if n, ok := strings.CutPrefix(line, "durable "); ok {
				if v, err := strconv.Atoi(n); err == nil && v > k.durable {
					k.durable = v
				}
			}
		case <-drain.C:
			t.Fatalf("the killed child's output did not end in 10s; its output:\n%s", output())
		}
	}
	err, reaped = waitBounded(exited), true
	if hung != "" {
		t.Fatalf("%s; its output:\n%s", hung, output())
	}
	var exit *exec.ExitError
	require.True(t, errors.As(err, &exit), "the child was killed (%v); its output:\n%s", err, output())
	require.Equal(t, -1, exit.ExitCode(), "the child died of the kill (%v); its output:\n%s", err, output())
	require.NotContains(t, output(), "DATA RACE", "the first life ran without a race")
	return k
}

// waitBounded is the child's exit, which a kill makes prompt.
func waitBounded(exited <-chan error) error {
	select {
	case err := <-exited:
		return err
	case <-time.After(10 * time.Second):
		return errors.New("the child did not exit 10s after it was killed")
	}
}

// readKillHistory reads the side file: its whole lines (a kill may cut the
// last, written before the journal had its batch).
func readKillHistory(t *testing.T, path string) []killStep {
	t.Helper()
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) { // killed before the first life began
		return nil
	}
	require.NoError(t, err)
	var steps []killStep
	for len(b) > 0 {
		i := bytes.IndexByte(b, '\n')
		if i < 0 {
			break
		}
		var st killStep
		require.NoError(t, json.Unmarshal(b[:i], &st))
		steps = append(steps, st)
		b = b[i+1:]
	}
	return steps
}

// killedAt is where the kill left the journal: it holds what the first at
// steps of the side file made of it (a batch whole or not at all), the
// first appends batches of them. history is their records: every record
// committed durably up to the kill, the compacted ones too. recs are the
// records the journal holds.
func killedAt(t *testing.T, k killed) (steps []killStep, at, appends int, history, recs []record) {
	t.Helper()
	steps = readKillHistory(t, k.history)
	payloads, _, err := wal.ReadOnly(k.dir, wal.Options{})
	require.NoError(t, err, "the journal a kill left reads")
	for _, p := range payloads {
		rec, err := unpackData(p, nil)
		require.NoError(t, err)
		recs = append(recs, rec)
	}
	same := func(image [][]byte) bool {
		if len(image) != len(payloads) {
			return false
		}
		for i := range image {
			if len(payloads[i]) == 0 || payloads[i][0] != dataMark || !bytes.Equal(image[i], payloads[i][1:]) {
				return false
			}
		}
		return true
	}
	var image [][]byte
	at = -1
	if same(image) {
		at = 0
	}
	for i, st := range steps {
		if st.Compact {
			image = image[:0:0]
		}
		for _, e := range st.Recs {
			image = append(image, e.Data)
		}
		if same(image) {
			at = i + 1
		}
	}
	require.GreaterOrEqual(t, at, 0, "the journal (%d records) is what the child's commits made of it after some batch, never part of one", len(payloads))
	for _, st := range steps[:at] {
		if st.Compact {
			continue
		}
		appends++
		for _, e := range st.Recs {
			rec, err := decodeRecord(Record{Seq: e.Seq, Data: e.Data})
			require.NoError(t, err)
			history = append(history, rec)
		}
	}
	require.GreaterOrEqual(t, appends, k.durable, "every batch the child was told was durable survived its kill")
	return steps, at, appends, history, recs
}

// killPoint is a kill after the child said batch n was durable.
type killPoint struct {
	name string
	n    int
}

// killPoints are the points to kill at, found in the batches of a whole
// first life (steps): its batch numbers may vary a little from life to
// life (concurrent commits share a batch or not), which only moves a kill
// by a batch or so.
func killPoints(t *testing.T, steps []killStep) []killPoint {
	t.Helper()
	var out []killPoint
	have := map[string]bool{}
	add := func(name string, n int) {
		if !have[name] {
			have[name] = true
			out = append(out, killPoint{name, n})
		}
	}
	n, compacted := 0, false
	for _, st := range steps {
		if st.Compact {
			compacted = true
			continue
		}
		n++
		if compacted {
			add("after the compaction", n)
		}
		for _, e := range st.Recs {
			rec, err := decodeRecord(Record{Seq: e.Seq, Data: e.Data})
			require.NoError(t, err)
			switch {
			case rec.kind == recRetryScheduled:
				add("in a retry", n)
			case rec.kind == recInvocationAdmitted:
				add("at an Extend", n)
			case rec.kind == recTaskLaunched && strings.HasPrefix(rec.spec.parent, "s-"):
				add("in the children gate (a child launched)", n)
			case rec.kind == recNotifyProduced && rec.notice.kind == NotifyFinalSummary && strings.HasPrefix(rec.notice.parent, "s-"):
				add("in the children gate (a child's summary)", n)
			case rec.kind == recClosureOpened:
				add("in a branch closure", n)
			}
		}
	}
	for _, want := range []string{"in a retry", "at an Extend", "in the children gate (a child launched)", "in the children gate (a child's summary)", "in a branch closure", "after the compaction"} {
		require.True(t, have[want], "the first life has a point %s", want)
	}
	out = append([]killPoint{{"early", 2}}, out...)
	out = append(out, killPoint{"near the end", n - 1})
	return out
}

// TestCrashByKillingAProcess: see the top of this file.
func TestCrashByKillingAProcess(t *testing.T) {
	if os.Getenv(killChildEnv) == "1" {
		crashKillChild(t)
		return
	}
	if testing.Short() {
		t.Skip("runs the first life in child processes")
	}
	began := time.Now()
	runs := 0
	check := func(t *testing.T, k killed, point string, late bool) {
		t.Helper()
		runs++
		steps, at, appends, history, recs := killedAt(t, k)
		last := "nothing"
		if len(history) > 0 {
			last = history[len(history)-1].kind.String()
		}
		t.Logf("%s: killed after it said batch %d was durable; the journal holds %d of the %d steps (batches, compactions) the child began (%d batches; %d records, %d committed in all), the last record committed %s",
			point, k.durable, at, len(steps), appends, len(recs), len(history), last)
		fj, err := OpenFileJournal(k.dir)
		require.NoError(t, err, "the journal a kill left opens")
		checkRestart(t, fj, recs, history, k.start, late)
	}

	// A whole first life, killed once it is done: where the other kill
	// points are is read from its batches.
	var ref killed
	var points []killPoint
	if !t.Run("after the end", func(t *testing.T) {
		ref = killChild(t, nil, 0)
		require.GreaterOrEqual(t, ref.done, 0, "the first life ran to its end")
		points = killPoints(t, readKillHistory(t, ref.history))
		check(t, ref, "after the end", false)
	}) {
		return
	}
	if *crashLong {
		points = points[:0]
		for n := 1; n <= ref.done; n++ {
			points = append(points, killPoint{fmt.Sprintf("batch %d", n), n})
		}
	}
	for i, p := range points {
		if !t.Run(fmt.Sprintf("%s, batch %d", p.name, p.n), func(t *testing.T) {
			k := killChild(t, func(durable int) bool { return durable >= p.n }, 0)
			check(t, k, p.name, i%2 == 0)
		}) {
			return
		}
	}
	seed := uint64(time.Now().UnixNano())
	after := time.Duration(rand.New(rand.NewPCG(seed, 0)).Int64N(int64(ref.took)) + 1)
	t.Run("at a random moment", func(t *testing.T) {
		t.Logf("killed %v after its first life began (seed %d; a whole first life took %v)", after, seed, ref.took)
		k := killChild(t, nil, after)
		check(t, k, "at a random moment", true)
	})
	t.Logf("%d kills checked in %v", runs, time.Since(began).Round(time.Millisecond))
}
