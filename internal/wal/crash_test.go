package wal_test

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask/internal/wal"
)

// crashAt writes payloads through an FS that persists only the first
// budget bytes of the segment (later writes "succeed" and vanish, as if
// the machine crashed before they reached the disk), abandons the Log,
// and checks what a fresh Open with the real file system recovers.
func crashAt(t *testing.T, payloads [][]byte, budget int64, group bool) {
	t.Helper()
	dir := t.TempDir()
	fs := &faultFS{onWrite: dropAfter(budget)}
	l := open(t, dir, wal.Options{FS: fs})
	if group {
		var bs []*wal.Batch
		for i := 0; i < len(payloads); i += 3 {
			bs = append(bs, l.Append(payloads[i:min(i+3, len(payloads))]))
		}
		for _, b := range bs {
			require.NoError(t, b.Wait())
		}
	} else {
		appendEach(t, l, payloads...)
	}
	// The crash: nothing more reaches the disk; close the log.
	require.NoError(t, l.Close())

	offs := offsets(payloads)
	whole := 0 // records entirely within the budget
	for whole < len(payloads) && offs[whole+1] <= budget {
		whole++
	}
	seg := lastSegment(t, dir)
	require.Equal(t, min(budget, offs[len(payloads)]), fileSize(t, seg), "the simulated crash kept %d bytes", budget)

	l2, err := wal.Open(dir, wal.Options{})
	require.NoError(t, err, "a crash leaves at most a torn tail")
	equalRecords(t, payloads[:whole], l2.Records(), "every record within the budget, nothing partial")
	if budget > offs[whole] && whole < len(payloads) { // cut inside record whole
		if torn := l2.Torn(); assert.NotNil(t, torn, "the cut record is reported torn") {
			assert.Equal(t, offs[whole], torn.Offset)
			assert.Equal(t, budget-offs[whole], torn.Bytes)
			assert.Equal(t, filepath.Base(seg), filepath.Base(torn.File))
		}
		assert.Equal(t, offs[whole], fileSize(t, seg))
	} else {
		assert.Nil(t, l2.Torn(), "a crash at a record boundary tears nothing")
	}
	appendEach(t, l2, []byte("after recovery"))
	require.NoError(t, l2.Close())
	equalRecords(t, concat(payloads[:whole], [][]byte{[]byte("after recovery")}), reopen(t, dir))
}

func crashPayloads() [][]byte {
	ps := [][]byte{
		[]byte("a"), {}, []byte("a record of medium length"), bytes.Repeat([]byte("x"), 300),
		[]byte("z"), {}, {}, bytes.Repeat([]byte{0}, 17), []byte("the last record"),
	}
	return ps
}

func TestCrashAtEveryRecordBoundary(t *testing.T) {
	payloads := crashPayloads()
	for i, off := range offsets(payloads) {
		t.Run(fmt.Sprintf("after %d records (offset %d)", i, off), func(t *testing.T) {
			crashAt(t, payloads, off, i%2 == 1)
		})
	}
}

func TestCrashInsideRecords(t *testing.T) {
	payloads := crashPayloads()
	offs := offsets(payloads)
	rng := rand.New(rand.NewPCG(7, 11))
	var cuts []int64
	for i := range payloads {
		start, end := offs[i], offs[i+1]
		cuts = append(cuts, start+1, start+headerSize-1) // inside the header
		if end-start > headerSize+1 {
			cuts = append(cuts, start+headerSize+1+rng.Int64N(end-start-headerSize-1)) // inside the payload
		}
	}
	for _, cut := range cuts {
		t.Run(fmt.Sprintf("offset %d", cut), func(t *testing.T) {
			crashAt(t, payloads, cut, cut%2 == 0)
		})
	}
}

// TestCrashChild runs a child process that appends records, prints how
// many are acknowledged after each Wait, and exits with appends still in
// flight; every acknowledged record must be in the journal, in order.
func TestCrashChild(t *testing.T) {
	if os.Getenv("WAL_CRASH_CHILD") == "1" {
		crashChild()
		return
	}
	const acked, inFlight = 60, 40
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashChild$")
	cmd.Env = append(os.Environ(),
		"WAL_CRASH_CHILD=1",
		"WAL_CRASH_DIR="+dir,
		"WAL_CRASH_N="+strconv.Itoa(acked),
		"WAL_CRASH_IN_FLIGHT="+strconv.Itoa(inFlight))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	require.True(t, errors.As(err, &exit), "the child must exit with an error: %v\nstderr: %s", err, stderr.String())
	require.Equal(t, 1, exit.ExitCode(), "stderr: %s", stderr.String())

	seen := 0
	sc := bufio.NewScanner(&stdout)
	for sc.Scan() {
		if n, ok := strings.CutPrefix(sc.Text(), "acked "); ok {
			v, err := strconv.Atoi(n)
			require.NoError(t, err)
			require.Equal(t, seen+1, v, "acknowledgements count up")
			seen = v
		}
	}
	require.Equal(t, acked, seen, "the child acknowledged all it was told to; stdout: %s", stdout.String())

	l := open(t, dir, wal.Options{})
	got := strs(l.Records())
	require.NoError(t, l.Close())
	require.GreaterOrEqual(t, len(got), seen, "every acknowledged record survives")
	require.LessOrEqual(t, len(got), acked+inFlight)
	for i, s := range got {
		require.Equal(t, childRecord(i), s, "record %d: the journal is the child's records in order, without gaps", i)
	}
}

func childRecord(i int) string { return fmt.Sprintf("child-record-%05d", i) }

// crashChild is the child of TestCrashChild: it never returns.
func crashChild() {
	n, _ := strconv.Atoi(os.Getenv("WAL_CRASH_N"))
	inFlight, _ := strconv.Atoi(os.Getenv("WAL_CRASH_IN_FLIGHT"))
	l, err := wal.Open(os.Getenv("WAL_CRASH_DIR"), wal.Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, "open:", err)
		os.Exit(2)
	}
	for i := range n {
		if err := l.Append([][]byte{[]byte(childRecord(i))}).Wait(); err != nil {
			fmt.Fprintln(os.Stderr, "append:", err)
			os.Exit(2)
		}
		fmt.Fprintf(os.Stdout, "acked %d\n", i+1)
	}
	// Appends the writer may be in the middle of when the process dies.
	var last *wal.Batch
	for i := n; i < n+inFlight; i++ {
		last = l.Append([][]byte{[]byte(childRecord(i))})
	}
	if last != nil {
		go func() { _ = last.Wait() }() // writes them all, in order
	}
	os.Exit(1)
}

// TestCrashKeepsEveryAcknowledgedRecord models a power cut: only what an
// fsync covered (and files a directory fsync made durable) survives.
// Concurrent appenders fill several segments; then, with the writer held
// inside an fsync and more batches written but not durable, the machine
// "crashes". The journal recovered from what is durable holds every
// acknowledged record, per appender in order, and nothing else.
func TestCrashKeepsEveryAcknowledgedRecord(t *testing.T) {
	const goroutines, perG = 4, 25
	fs := &faultFS{}
	fs.trackDurability()
	dir := t.TempDir()
	l := open(t, dir, wal.Options{FS: fs, SegmentBytes: 250})

	var wg sync.WaitGroup
	errs := make(chan error, goroutines*perG)
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perG {
				errs <- l.Append([][]byte{fmt.Appendf(nil, "g%d-%02d", g, i)}).Wait()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Greater(t, len(segments(t, dir)), 2)

	g := newGate()
	fs.set(func(fs *faultFS) {
		fs.onSync = func(string) error { _, err := g.hold(); return err }
	})
	inFlight := waiting(l.Append(recs("in-flight", 3)))
	<-g.entered // written, not yet durable
	queued := l.Append(recs("queued", 2))
	crashed := t.TempDir()
	fs.snapshot(t, dir, crashed)
	g.release <- errInjected
	assert.ErrorIs(t, <-inFlight, errInjected)
	_ = queued.Wait() // refused, or written after the fault (TestFailStopQueuedBehindFault); after the crash either way
	_ = l.Close()

	l2 := open(t, crashed, wal.Options{})
	got := l2.Records()
	require.NoError(t, l2.Close())
	perGoroutine := make([][]string, goroutines)
	for _, p := range got {
		var gi, i int
		_, err := fmt.Sscanf(string(p), "g%d-%d", &gi, &i)
		require.NoError(t, err, "only acknowledged records: %q", p)
		perGoroutine[gi] = append(perGoroutine[gi], string(p))
	}
	for gi := range goroutines {
		var want []string
		for i := range perG {
			want = append(want, fmt.Sprintf("g%d-%02d", gi, i))
		}
		assert.Equal(t, want, perGoroutine[gi], "appender %d", gi)
	}
}

// TestCrashNewJournalIsDurable: the first segment of a new journal is
// durable (its directory entry too) once the first append is acknowledged.
func TestCrashNewJournalIsDurable(t *testing.T) {
	fs := &faultFS{}
	fs.trackDurability()
	dir := t.TempDir()
	l := open(t, dir, wal.Options{FS: fs})
	want := recs("first", 2)
	require.NoError(t, l.Append(want).Wait())
	crashed := t.TempDir()
	fs.snapshot(t, dir, crashed)
	require.NoError(t, l.Close())
	equalRecords(t, want, reopen(t, crashed))
}
