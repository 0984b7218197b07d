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
// budget bytes of records in the segment (later writes "succeed" and
// vanish, as if the machine crashed before they reached the disk; the
// zeros of preallocation are written as usual), abandons the Log, and
// checks what a fresh Open with the real file system recovers.
func crashAt(t *testing.T, payloads [][]byte, budget int64, group, prealloc bool) {
	t.Helper()
	dir := t.TempDir()
	fs := &faultFS{onWrite: dropAfter(budget)}
	opts := wal.Options{NoPrealloc: !prealloc}
	l := open(t, dir, wal.Options{FS: fs, NoPrealloc: !prealloc})
	per := 1 // records per batch
	if group {
		per = 3
	}
	var batches [][][]byte
	for i := 0; i < len(payloads); i += per {
		batches = append(batches, payloads[i:min(i+per, len(payloads))])
	}
	if group {
		var bs []*wal.Batch
		for _, b := range batches {
			bs = append(bs, l.Append(b))
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
	enc, kept := encodeBatches(batches...), min(budget, offs[len(payloads)])
	seg := lastSegment(t, dir)
	data := readFile(t, seg)
	require.True(t, bytes.Equal(enc[:kept], data[:kept]), "the simulated crash kept %d bytes", budget)
	if prealloc {
		require.True(t, allZero(data[kept:]), "and zeros after them")
	} else {
		require.Equal(t, kept, int64(len(data)), "and nothing after them")
	}
	// The records the crash left whole: on disk as written (bytes it lost
	// may have been zeros anyway, where zeros were).
	whole := 0
	for whole < len(payloads) && offs[whole+1] <= int64(len(data)) && bytes.Equal(enc[offs[whole]:offs[whole+1]], data[offs[whole]:offs[whole+1]]) {
		whole++
	}

	// A batch is read whole or not at all: the records of the batch the
	// crash cut go with it.
	cut := whole - whole%per
	if whole == len(payloads) {
		cut = whole
	}
	l2, err := wal.Open(dir, opts)
	require.NoError(t, err, "a crash leaves at most a torn tail")
	equalRecords(t, payloads[:cut], l2.Records(), "every batch within the budget, nothing partial")
	if !allZero(data[offs[whole]:]) || cut < whole { // cut inside record whole, or inside a batch
		if torn := l2.Torn(); assert.NotNil(t, torn, "the cut record or batch is reported torn") {
			assert.Equal(t, offs[cut], torn.Offset)
			assert.Equal(t, int64(len(data))-offs[cut], torn.Bytes)
			assert.Equal(t, filepath.Base(seg), filepath.Base(torn.File))
		}
		assert.Equal(t, offs[cut], fileSize(t, seg))
		whole = cut
	} else {
		assert.Nil(t, l2.Torn(), "a crash at a record boundary (or that left only zeros of the record cut) tears nothing")
		if !prealloc {
			assert.Equal(t, offs[whole], fileSize(t, seg), "without preallocation a zero tail is cut too")
		}
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
	for _, lay := range layouts {
		for i, off := range offsets(payloads) {
			t.Run(fmt.Sprintf("%s/after %d records (offset %d)", lay.name, i, off), func(t *testing.T) {
				crashAt(t, payloads, off, i%2 == 1, lay.prealloc)
			})
		}
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
	for _, lay := range layouts {
		for _, cut := range cuts {
			t.Run(fmt.Sprintf("%s/offset %d", lay.name, cut), func(t *testing.T) {
				crashAt(t, payloads, cut, cut%2 == 0, lay.prealloc)
			})
		}
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

// TestCrashKeepsEveryAcknowledgedRecord models a power cut: only what a
// sync covered (and files a directory fsync made durable) survives.
// Concurrent appenders fill several segments; then, with the writer held
// inside the sync of a round (written, not yet durable) and more batches
// queued, the machine "crashes". The journal recovered from what is
// durable holds every acknowledged record, per appender in order, and
// nothing else. With preallocation the crash may also keep any subset of
// the round's pages (snapshotTorn): then a prefix of the round's records
// may survive too, never a record half-written or out of order.
func TestCrashKeepsEveryAcknowledgedRecord(t *testing.T) {
	for _, lay := range layouts {
		t.Run(lay.name, func(t *testing.T) { testCrashKeepsEveryAcknowledgedRecord(t, lay.prealloc) })
	}
}

func testCrashKeepsEveryAcknowledgedRecord(t *testing.T, prealloc bool) {
	const goroutines, perG = 4, 25
	fs := &faultFS{}
	fs.trackDurability()
	dir := t.TempDir()
	l := open(t, dir, wal.Options{FS: fs, SegmentBytes: 250, NoPrealloc: !prealloc})

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
		fs.onSync = func(name string) error {
			if !fs.unsynced(name) {
				return nil // not the round's sync (preallocated zeros)
			}
			_, err := g.hold()
			return err
		}
	})
	var flight [][]byte // over several pages
	for i := range 6 {
		flight = append(flight, fmt.Appendf(nil, "in-flight-%d-%s", i, bytes.Repeat([]byte{'a' + byte(i)}, 2000)))
	}
	inFlight := waiting(l.Append(flight))
	<-g.entered // written, not yet durable
	queued := l.Append(recs("queued", 2))
	crashed := t.TempDir()
	fs.snapshot(t, dir, crashed)
	var torn []string
	for seed := range uint64(8) {
		if prealloc {
			torn = append(torn, t.TempDir())
			fs.snapshotTorn(t, dir, torn[seed], rand.New(rand.NewPCG(seed, 5)))
		}
	}
	g.release <- errInjected
	assert.ErrorIs(t, <-inFlight, errInjected)
	_ = queued.Wait() // refused, or written after the fault (TestFailStopQueuedBehindFault); after the crash either way
	_ = l.Close()

	checkAcked(t, crashed, goroutines, perG, nil)
	for _, dir := range torn {
		checkAcked(t, dir, goroutines, perG, flight)
	}
}

// checkAcked opens a crashed journal of TestCrashKeepsEveryAcknowledgedRecord:
// every appender's records in order, then at most a prefix of extra.
func checkAcked(t *testing.T, dir string, goroutines, perG int, extra [][]byte) {
	t.Helper()
	l2 := open(t, dir, wal.Options{})
	got := l2.Records()
	require.NoError(t, l2.Close())
	perGoroutine := make([][]string, goroutines)
	acked := 0
	for _, p := range got {
		var gi, i int
		if _, err := fmt.Sscanf(string(p), "g%d-%d", &gi, &i); err != nil {
			break
		}
		perGoroutine[gi] = append(perGoroutine[gi], string(p))
		acked++
	}
	assert.Equal(t, strs(extra[:min(len(got)-acked, len(extra))]), strs(got[acked:]), "only acknowledged records, then a prefix of the round in flight")
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

// TestCrashAtEverySync crashes (in a copy) at every sync of a preallocated
// journal's life — rounds of one unit and of several, a record longer
// than a unit, the zeros' own syncs, rotations, a compaction — both as
// the durability model says (what was synced) and with a random subset of
// the pages written since. Each copy reads (ReadOnly and Open alike) as
// the log's records up to some point at or after the last acknowledged
// one: nothing acknowledged lost, nothing half-written, nothing out of
// order; across the compaction, the old log or the compacted one.
func TestCrashAtEverySync(t *testing.T) {
	fs := &faultFS{}
	fs.trackDurability()
	dir := t.TempDir()
	l := open(t, dir, wal.Options{FS: fs, SegmentBytes: 300 << 10})

	var (
		phase       int      // 0 before the compaction, 1 in it, 2 after
		before      [][]byte // what phase 0 appended
		keep, after [][]byte // the compaction's records, and phase 2's
		acked       int      // records of the current phase acknowledged
		crashes     int
	)
	check := func(crashed string) {
		got := recovered(t, crashed)
		old := phase <= 1 && len(got) >= acked && len(got) <= len(before) && equalPrefix(before, got)
		compacted := phase >= 1 && len(got) >= len(keep) && equalPrefix(keep, got[:len(keep)]) &&
			len(got)-len(keep) >= acked*(phase/2) && equalPrefix(after, got[len(keep):])
		require.True(t, old || compacted, "crash %d (phase %d, %d acknowledged): %d records", crashes, phase, acked, len(got))
	}
	fs.set(func(fs *faultFS) {
		fs.onSync = func(string) error {
			crashes++
			crashed := t.TempDir()
			fs.snapshot(t, dir, crashed)
			check(crashed)
			for seed := range uint64(3) {
				crashed := t.TempDir()
				fs.snapshotTorn(t, dir, crashed, rand.New(rand.NewPCG(uint64(crashes), seed)))
				check(crashed)
			}
			return nil
		}
	})
	// appendRound appends batches and waits for the last one: the first
	// Wait writes them all in one round.
	appendRound := func(log *[][]byte, batches ...[][]byte) {
		var last *wal.Batch
		for _, b := range batches {
			last = l.Append(b)
			*log = append(*log, b...)
		}
		require.NoError(t, last.Wait())
		acked = len(*log)
	}
	n := 0
	batch := func(k, size int) [][]byte { return numbered(&n, k, size) }
	for i := range 20 {
		appendRound(&before, batch(3, 150), batch(1+i%3, 1000))
	}
	appendRound(&before, batch(27, 10<<10))                                         // a round of two units
	appendRound(&before, batch(1, 100), batch(1, wal.UnitBytes+5000), batch(2, 10)) // a record longer than a unit
	for range 6 {
		appendRound(&before, batch(2, 3000))
	}
	require.Greater(t, len(segments(t, dir)), 1, "rotated")

	phase = 1
	for i := 0; i < len(before); i += 5 {
		keep = append(keep, before[i])
	}
	require.NoError(t, l.Compact(keep))
	phase, acked = 2, 0
	for range 6 {
		appendRound(&after, batch(3, 2000))
	}
	appendRound(&after, batch(20, 20<<10)) // past the segment size: a rotation
	require.NoError(t, l.Close())
	t.Logf("%d crashes, each checked as synced and with 3 random subsets of the pages written since", crashes)
	equalRecords(t, concat(keep, after), reopen(t, dir))
}

// numbered makes k records of size bytes and more, each unique: numbered
// on from *n.
func numbered(n *int, k, size int) [][]byte {
	var b [][]byte
	for range k {
		*n++
		b = append(b, fmt.Appendf(nil, "%05d-%s", *n, bytes.Repeat([]byte{byte('a' + *n%26)}, size)))
	}
	return b
}

// recovered reads a crashed journal as ReadOnly does, then as Open does
// (which cuts a torn tail), and checks they agree.
func recovered(t *testing.T, dir string) [][]byte {
	t.Helper()
	ro, _, err := wal.ReadOnly(dir, wal.Options{})
	require.NoError(t, err, "a crash leaves at most a torn tail")
	l, err := wal.Open(dir, wal.Options{})
	require.NoError(t, err)
	got := l.Records()
	require.NoError(t, l.Close())
	require.Equal(t, strs(ro), strs(got), "ReadOnly and Open read the same records")
	return got
}

// equalPrefix reports whether got is a prefix of want.
func equalPrefix(want, got [][]byte) bool {
	if len(got) > len(want) {
		return false
	}
	for i := range got {
		if !bytes.Equal(want[i], got[i]) {
			return false
		}
	}
	return true
}
