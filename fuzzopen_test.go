package bgtask

// FuzzOpen: Open never panics and never hangs on what a crash, a bad disk
// or a bad actor leaves. The images are the crash harness's (every step of
// its first life, as the journal stood after it), mutated by the fuzz
// input: bytes flipped, files cut or truncated, garbage inserted, records
// reordered, duplicated, dropped or their batch flags changed, and a
// record's payload replaced or patched with its checksums made good again,
// so that it passes the file format's checks and reaches the decoder and
// the ledger. Each is opened as a restart would: either Open fails with an
// error that names the file and the offset, or it succeeds and the
// restart keeps its promises — all of them (checkRestart) if the image
// reads as the journal after some step (a crash-consistent image), else
// the ones a journal nobody wrote still owes: every task ends, Shutdown
// returns, nothing leaks (TestMain's goleak).

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"hash/crc32"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask/internal/clock"
	"github.com/bgtask/bgtask/internal/codec"
	"github.com/bgtask/bgtask/internal/wal"
)

// crashTapeFile keeps the crash harness's first life, taped: the images
// FuzzOpen mutates are then the same bytes in every process (two runs of
// the scenario differ in their times, and in the order of some
// deliveries), so what the fuzzer finds reproduces. -update writes it
// again from a run of the scenario.
const crashTapeFile = "testdata/crash_scenario.tape"

const crashTapeMagic = "bgtask crash tape 1\n"

// encodeCrashTape is run as crashTapeFile holds it: the magic, when the
// first life began, then each step: whether it is a compaction, and its
// records' Data.
func encodeCrashTape(run *crashRun) []byte {
	w := codec.Writer{B: []byte(crashTapeMagic)}
	w.Int(run.start.UnixNano())
	w.Uint(uint64(len(run.tape)))
	for _, st := range run.tape {
		w.Bool(st.compact)
		w.Uint(uint64(len(st.recs)))
		for _, r := range st.recs {
			w.String(string(r.Data))
		}
	}
	return w.B
}

// loadCrashTape reads crashTapeFile.
func loadCrashTape(t testing.TB) *crashRun {
	t.Helper()
	b, err := os.ReadFile(crashTapeFile)
	require.NoError(t, err, "go test -run TestCrashTape -update writes it")
	require.True(t, bytes.HasPrefix(b, []byte(crashTapeMagic)), "%s is a crash tape", crashTapeFile)
	d := codec.Reader{B: b[len(crashTapeMagic):]}
	run := &crashRun{start: time.Unix(0, d.Int())}
	for n := d.Uint(); n > 0 && d.Err() == nil; n-- {
		st := tapeStep{compact: d.Bool()}
		for k := d.Uint(); k > 0 && d.Err() == nil; k-- {
			data := []byte(d.String())
			rec, err := decodeData(data, 0, nil)
			require.NoError(t, err)
			st.recs = append(st.recs, recordOf(&rec, data))
		}
		run.tape = append(run.tape, st)
	}
	require.NoError(t, d.Err())
	return run
}

// The tape FuzzOpen starts from is a first life of the crash harness:
// every record decodes, and its steps are the journal's commits and its
// compaction, numbered in order. With -update it is taped again.
func TestCrashTape(t *testing.T) {
	if *update {
		run := runCrashScenario(t)
		require.NoError(t, os.WriteFile(crashTapeFile, encodeCrashTape(run), 0o644))
	}
	run := loadCrashTape(t)
	var seq uint64
	compactions := 0
	for k, st := range run.tape {
		require.NotEmpty(t, st.recs, "step %d", k)
		if st.compact {
			compactions++
			continue
		}
		for _, r := range st.recs {
			require.Greater(t, r.Seq, seq, "step %d: records in sequence order", k)
			seq = r.Seq
		}
	}
	require.Equal(t, 1, compactions)
}

// segImage is one segment file of an image: its bytes up to its last
// non-zero one, and its size (the rest is zeros: preallocated space).
type segImage struct {
	name string
	data []byte
	size int
}

// bytes is the segment file.
func (s segImage) bytes() []byte {
	b := make([]byte, s.size)
	copy(b, s.data)
	return b
}

// openBase is what FuzzOpen mutates: the image of the journal after each
// step of the taped first life, what it reads as, and what the world saw
// by then.
type openBase struct {
	start   time.Time
	images  [][]segImage
	reads   map[[32]byte]int // the image's payloads (hashed) → the step it reads as
	history [][]record       // every record committed by step k: what the world saw
}

var (
	openBaseOnce sync.Once
	openBaseVal  *openBase
)

// fuzzOpenBase builds the base images, once per process.
func fuzzOpenBase(t testing.TB) *openBase {
	t.Helper()
	openBaseOnce.Do(func() {
		run := loadCrashTape(t)
		snaps := snapshots(t, run.tape)
		b := &openBase{start: run.start, reads: map[[32]byte]int{}, history: make([][]record, len(snaps))}
		for k, st := range run.tape {
			b.history[k+1] = b.history[k]
			if st.compact {
				continue
			}
			for _, r := range st.recs {
				rec, err := decodeRecord(r)
				require.NoError(t, err)
				b.history[k+1] = append(slices.Clip(b.history[k+1]), rec)
			}
		}
		for k, snap := range snaps {
			var img []segImage
			for name, data := range snap {
				last := len(data)
				for last > 0 && data[last-1] == 0 {
					last--
				}
				img = append(img, segImage{name: name, data: slices.Clone(data[:last]), size: len(data)})
			}
			sort.Slice(img, func(i, j int) bool { return img[i].name < img[j].name })
			b.images = append(b.images, img)
			dir, _ := recordsIn(t, snap) // every record decodes
			payloads, _, err := wal.ReadOnly(dir, wal.Options{})
			require.NoError(t, err)
			if _, dup := b.reads[readsKey(payloads)]; !dup {
				b.reads[readsKey(payloads)] = k
			}
		}
		openBaseVal = b
	})
	require.NotNil(t, openBaseVal, "the base images were built")
	return openBaseVal
}

// readAs reports the step whose image reads as payloads, if any.
func (b *openBase) readAs(payloads [][]byte) (int, bool) {
	if b == nil {
		return 0, false
	}
	k, ok := b.reads[readsKey(payloads)]
	return k, ok
}

// readsKey identifies a list of payloads.
func readsKey(payloads [][]byte) [32]byte {
	h := sha256.New()
	for _, p := range payloads {
		h.Write(binary.AppendUvarint(nil, uint64(len(p))))
		h.Write(p)
	}
	var k [32]byte
	h.Sum(k[:0])
	return k
}

// noSyncFS is the operating system's file system without syncs: an
// image is opened hundreds of times a second, and no test here crashes
// the machine.
type noSyncFS struct{}

type noSyncFile struct{ *os.File }

func (noSyncFile) Sync() error     { return nil }
func (noSyncFile) SyncData() error { return nil }

func (noSyncFS) OpenFile(name string, flag int, perm os.FileMode) (wal.File, error) {
	f, err := os.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return noSyncFile{f}, nil
}
func (noSyncFS) Rename(a, b string) error                     { return os.Rename(a, b) }
func (noSyncFS) Remove(name string) error                     { return os.Remove(name) }
func (noSyncFS) ReadDir(name string) ([]os.DirEntry, error)   { return os.ReadDir(name) }
func (noSyncFS) MkdirAll(path string, perm os.FileMode) error { return os.MkdirAll(path, perm) }
func (noSyncFS) SyncDir(string) error                         { return nil }

func withoutSyncs() FileJournalOption {
	return fileOption(func(o *wal.Options) error { o.FS = noSyncFS{}; return nil })
}

// Mutations: a fuzz input's ops are read op by op (a byte, then its
// operands); a script that ends early reads zeros.
const (
	opFlip      = iota // a byte of the records (or just after them) flipped
	opCrashCut         // zeros from a byte to the records' end: a crash that lost the rest of its unit
	opTruncate         // the file cut short at a byte
	opGarbage          // bytes inserted, near the records or anywhere in the file
	opReplace          // a record's payload replaced by the input's bytes, its checksums made good
	opPatch            // a byte of a record's payload changed, its checksums made good
	opVarint           // a uvarint in a record's payload replaced by another (a length of 2^60, say)
	opReorder          // records swapped, duplicated, dropped; a batch or base flag toggled
	opRecordCut        // zeros after a record: a crash that kept the records before it
	opField            // a field of a record, decoded, set to a value the journal holds elsewhere (or a limit), re-encoded
	opCount
)

// script reads a fuzz input's mutations.
type script struct{ b []byte }

func (s *script) byte() byte {
	if len(s.b) == 0 {
		return 0
	}
	c := s.b[0]
	s.b = s.b[1:]
	return c
}

func (s *script) u16() int { return int(s.byte()) | int(s.byte())<<8 }
func (s *script) u24() int { return s.u16() | int(s.byte())<<16 }

func (s *script) bytes(n int) []byte {
	n = min(n, len(s.b))
	p := s.b[:n]
	s.b = s.b[n:]
	return p
}

// varints are the values opVarint writes by preference.
var varints = []uint64{0, 1, 2, 127, 128, 255, 1 << 16, 1<<31 - 1, 1 << 31, 1 << 32, 1 << 40, 1 << 60, 1 << 62, 1 << 63, 1<<64 - 1, 3}

// frame is a record of a segment: its header's flags and its payload.
type frame struct {
	flags   uint32
	payload []byte
}

const (
	frameMore = 1 << 30
	frameBase = 1 << 31
)

var castagnoliTable = crc32.MakeTable(crc32.Castagnoli)

// frames parses seg's records up to the first that is not whole with good
// checksums; end is where they end.
func frames(seg []byte) (fs []frame, end int) {
	for end+12 <= len(seg) {
		field := binary.LittleEndian.Uint32(seg[end:])
		n := int(field &^ (frameMore | frameBase))
		if crc32.Checksum(seg[end:end+4], castagnoliTable) != binary.LittleEndian.Uint32(seg[end+4:]) || n > len(seg)-end-12 {
			break
		}
		p := seg[end+12 : end+12+n]
		if crc32.Checksum(p, castagnoliTable) != binary.LittleEndian.Uint32(seg[end+8:]) {
			break
		}
		fs = append(fs, frame{flags: field & (frameMore | frameBase), payload: p})
		end += 12 + n
	}
	return fs, end
}

// appendFrames appends fs to b as a segment holds them, with good
// checksums.
func appendFrames(b []byte, fs []frame) []byte {
	for _, f := range fs {
		b = binary.LittleEndian.AppendUint32(b, uint32(len(f.payload))|f.flags)
		b = binary.LittleEndian.AppendUint32(b, crc32.Checksum(b[len(b)-4:], castagnoliTable))
		b = binary.LittleEndian.AppendUint32(b, crc32.Checksum(f.payload, castagnoliTable))
		b = append(b, f.payload...)
	}
	return b
}

// mutate makes the files of img, mutated by ops (at most 16 of them).
func mutate(img []segImage, ops []byte) map[string][]byte {
	files := make(map[string][]byte, len(img))
	names := make([]string, 0, len(img))
	for _, s := range img {
		files[s.name] = s.bytes()
		names = append(names, s.name)
	}
	if len(names) == 0 {
		return files
	}
	s := &script{b: ops}
	for n := 0; n < 16 && len(s.b) > 0; n++ {
		op := int(s.byte()) % opCount
		name := names[int(s.byte())%len(names)]
		seg := files[name]
		fs, end := frames(seg)
		reframed := false
		switch op {
		case opFlip:
			if lim := min(len(seg), end+64); lim > 0 {
				seg[s.u24()%lim] ^= s.byte() | 1
			}
		case opCrashCut:
			clear(seg[s.u24()%(end+1) : end])
		case opTruncate:
			seg = seg[:s.u24()%(len(seg)+1)]
		case opGarbage:
			at := s.u24()
			if s.byte()&1 == 0 {
				at %= end + 1
			} else {
				at %= len(seg) + 1
			}
			g := s.bytes(int(s.byte())%64 + 1)
			seg = slices.Insert(seg, at, g...)
		case opReplace, opPatch, opVarint:
			if len(fs) == 0 {
				break
			}
			i := s.u16() % len(fs)
			old := fs[i].payload
			var p []byte
			switch op {
			case opReplace:
				keep := 0
				if s.byte()&1 == 1 {
					keep = min(2, len(old)) // the mark and the format: the fuzz bytes are the record's
				}
				p = append(slices.Clip(old[:keep]), s.bytes(s.u16()%2048)...)
			case opPatch:
				p = slices.Clone(old)
				if len(p) > 0 {
					p[s.u16()%len(p)] ^= s.byte() | 1
				}
			case opVarint:
				j := s.u16() % (len(old) + 1)
				var v uint64
				if sel := s.byte(); int(sel) < len(varints) {
					v = varints[sel]
				} else {
					v = uint64(s.u24())
				}
				w := 1
				if _, k := binary.Uvarint(old[j:]); k > 0 {
					w = k
				}
				w = min(w, len(old)-j)
				p = append(binary.AppendUvarint(slices.Clone(old[:j]), v), old[j+w:]...)
			}
			fs[i].payload = p
			reframed = true
		case opReorder:
			if len(fs) == 0 {
				break
			}
			sub, i, j := s.byte()%5, s.u16()%len(fs), s.u16()%len(fs)
			switch sub {
			case 0:
				fs[i], fs[j] = fs[j], fs[i]
			case 1:
				fs = slices.Insert(fs, j, fs[i])
			case 2:
				fs = slices.Delete(fs, i, i+1)
			case 3:
				fs[i].flags ^= frameMore
			case 4:
				fs[i].flags ^= frameBase
			}
			reframed = true
		case opField:
			if len(fs) == 0 {
				break
			}
			i := s.u16() % len(fs)
			if p, ok := mutateField(fs, i, s); ok {
				fs[i].payload = p
				reframed = true
			}
		case opRecordCut:
			i := s.u16() % (len(fs) + 1)
			at := 0
			for _, f := range fs[:i] {
				at += 12 + len(f.payload)
			}
			clear(seg[at:end])
		}
		if reframed {
			seg = append(appendFrames(nil, fs), seg[end:]...)
		}
		files[name] = seg
	}
	return files
}

// words are the values a record's fields take in fs (ids, sessions,
// tokens), the values no record holds, and the limits: what opField sets a
// field to.
func words(fs []frame) []string {
	set := map[string]bool{"": true, "zz": true}
	for _, f := range fs {
		rec, err := unpackData(f.payload, nil)
		if err != nil {
			continue
		}
		a := &rec.attempt
		for _, w := range []string{rec.task, a.ID, a.Token, a.SessionID} {
			set[w] = true
		}
		if rec.recordExt != nil {
			set[rec.session], set[rec.note] = true, true
			if rec.spec != nil {
				set[rec.spec.parent], set[rec.spec.root] = true, true
			}
			if rec.notice != nil {
				set[rec.notice.id], set[rec.notice.attempt] = true, true
			}
		}
	}
	out := make([]string, 0, len(set))
	for w := range set {
		out = append(out, w)
	}
	sort.Strings(out)
	return out
}

var (
	fieldStatuses = []Status{StatusPending, StatusRunning, StatusCompleted, StatusError, StatusCancelled, StatusInterrupt, "", "weird"}
	fieldReasons  = []PendingReason{PendingQueued, PendingAwaitingSession, PendingSessionFailed, PendingRetryDelay, "", "weird"}
	fieldNotices  = []NotificationKind{NotifyRetryScheduled, NotifyRetrySessionReady, NotifyFinalSummary, NotifyAnswer, NotifyAllComplete, NotifyBranchClosed, ""}
	fieldNumbers  = []uint64{0, 1, 2, 3, 4, 7, 1 << 31, 1 << 62, 1<<64 - 1}
)

// mutateField decodes the record of fs[i], sets one of its fields (chosen
// by s) to a value from words, a status, a reason, a number, or nothing,
// and returns it encoded; false if the record does not decode, or the
// result does not encode.
func mutateField(fs []frame, i int, s *script) ([]byte, bool) {
	rec, err := unpackData(fs[i].payload, nil)
	if err != nil {
		return nil, false
	}
	ws := words(fs)
	word := func() string { return ws[int(s.byte())%len(ws)] }
	number := func() uint64 { return fieldNumbers[int(s.byte())%len(fieldNumbers)] }
	x := rec.recordExt
	if x == nil {
		x = &recordExt{}
	}
	a := &rec.attempt
	switch s.byte() % 20 {
	case 0:
		rec.kind = recordKind(1 + int(s.byte())%(len(recordKindNames)-1))
	case 1:
		rec.seq = number()
	case 2:
		rec.task = word()
	case 3:
		a.ID = word()
	case 4:
		a.Status = fieldStatuses[int(s.byte())%len(fieldStatuses)]
	case 5:
		a.Pending = fieldReasons[int(s.byte())%len(fieldReasons)]
	case 6:
		a.SessionID = word()
	case 7:
		a.Number = int(number())
	case 8:
		a.Token = word()
	case 9:
		x.stop = fieldStatuses[int(s.byte())%len(fieldStatuses)]
		rec.recordExt = x
	case 10:
		if x.notice == nil {
			x.notice = &notice{}
		}
		switch s.byte() % 5 {
		case 0:
			x.notice.kind = fieldNotices[int(s.byte())%len(fieldNotices)]
		case 1:
			x.notice.seq = number()
		case 2:
			x.notice.attempt = word()
		case 3:
			x.notice.tasks = append(x.notice.tasks, word())
		case 4:
			x.notice.invocation = int(number())
		}
		rec.recordExt = x
	case 11:
		rec.recordExt = nil
	case 12:
		rec.inv = nil
	case 13:
		if x.spec == nil {
			break
		}
		switch s.byte() % 6 {
		case 0:
			x.spec.parent = word()
		case 1:
			x.spec.extra().key = word()
		case 2:
			x.spec.extra().continues, x.spec.extra().resume = word(), word()
		case 3:
			x.spec.maxAttempts = int(number())
		case 4:
			x.spec.models = x.spec.models[:len(x.spec.models)/2]
		case 5:
			x.spec.root, x.spec.depth = word(), int(number())
		}
	case 14:
		rec.evidence = evidence{output: word(), finish: word(), reason: Reason(word())}
	case 15:
		if rec.inv == nil {
			rec.inv = &Invocation{}
		}
		rec.inv.N = int(number())
		if s.byte()&1 == 1 {
			rec.inv.Answer = &Answer{Text: word()}
		}
	case 16:
		switch s.byte() % 3 {
		case 0:
			rec.at = time.Time{}
		case 1:
			a.StartedAt = time.Time{}
		case 2:
			a.CompletedAt = time.Unix(int64(number()>>1), 0)
		}
	case 17:
		x.session, x.note = word(), word()
		rec.recordExt = x
	case 18:
		x.epoch, x.opened = number(), number()
		rec.recordExt = x
	case 19:
		a.Error, a.Result = word(), word()
	}
	p, err := encodePayloads([]record{rec})
	if err != nil {
		return nil, false
	}
	return p[0], true
}

// requireLocated: err, Open's (or ReadFileJournal's) refusal of an image,
// names the file and the offset, and is no panic made an error.
func requireLocated(t *testing.T, err error) {
	t.Helper()
	msg := err.Error()
	require.Contains(t, msg, "seg-", "the error names the file: %v", err)
	require.Contains(t, msg, " at offset ", "the error names the offset: %v", err)
	require.NotContains(t, msg, "panic", "a record Open cannot read is an error, never a panic: %v", err)
}

// checkOpenImage writes files and opens them as a restart would, on a
// world that answers truthfully for what they hold: Open fails with an
// error that names the file and the offset, or the restart keeps its
// promises (every one of them if the image reads as the journal after
// some step of base's; base nil: images of no first life, begun at t0).
func checkOpenImage(t *testing.T, base *openBase, files map[string][]byte, late bool) {
	watchdog := time.AfterFunc(time.Minute, func() {
		debug.SetTraceback("all")
		panic("FuzzOpen: an image kept Open (or the restart after it) from returning for a minute")
	})
	defer watchdog.Stop()
	dir := t.TempDir()
	for n, b := range files {
		require.NoError(t, os.WriteFile(filepath.Join(dir, n), b, 0o644))
	}
	// What the image holds, as a restart reads it.
	payloads, _, rerr := wal.ReadOnly(dir, wal.Options{})
	var recs []record
	decoded := rerr == nil
	for _, p := range payloads {
		rec, err := unpackData(p, nil)
		if err != nil {
			decoded = false
			break
		}
		recs = append(recs, rec)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, r := range recs {
				t.Logf("record %d %s %s %s: %s", r.seq, r.kind, r.task, r.attempt.ID, describe(&r))
			}
		}
	})
	_, verr := ReadFileJournal(dir)
	if verr != nil {
		requireLocated(t, verr)
	}
	fj, err := OpenFileJournal(dir, withoutSyncs())
	if err != nil {
		require.Error(t, rerr, "Open refuses only what ReadOnly refuses: %v", err)
		requireLocated(t, err)
		return
	}
	require.NoError(t, rerr, "Open reads what ReadOnly reads")
	start := t0
	if base != nil {
		start = base.start
	}
	if k, ok := base.readAs(payloads); ok && decoded {
		// A crash-consistent image: it reads as the journal after step k.
		checkRestart(t, fj, recs, base.history[k], base.start, late)
		return
	}
	w := newCrashWorld()
	if decoded {
		w = worldOf(recs)
	}
	now := start.Add(time.Minute)
	if late {
		now = start.Add(2 * time.Hour)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m, err := Open(ctx, w, append(crashOptions(), WithJournal(fj), WithNotifier(&crashRecorder{w: w}), WithClock(clock.NewFake(now)))...)
	if err != nil {
		requireLocated(t, err)
		return
	}
	require.True(t, decoded, "Open took an image whose records do not all decode")
	require.NoError(t, verr, "ReadFileJournal reads what Open takes")
	drive(t, m, w)
	require.NoError(t, m.notes.lanes.Wait(ctx))
	attempts := map[string]string{} // attempt → task
	for _, task := range m.Snapshot().Tasks {
		require.True(t, task.Status.Terminal(), "task %s ended", task.ID)
		for i, a := range task.Attempts {
			require.Equal(t, i+1, a.Number, "task %s: attempts numbered in order", task.ID)
			attempts[a.ID] = task.ID
		}
	}
	require.NoError(t, m.Shutdown(ctx))
	// No run of a task the restart knows is left running (but a session
	// a delivery woke for another turn: a journal that says a task ended
	// before its child's summary reached it, which no life writes, has the
	// summary delivered after the restart, and the session takes it).
	w.mu.Lock()
	defer w.mu.Unlock()
	for sid, s := range w.sess {
		if task, ok := attempts[s.attempt]; ok && !s.woken {
			require.NotEqual(t, SessionStateAlive, s.state, "session %s of task %s is still running, the task ended", sid, task)
		}
	}
}

// FuzzOpen: see the top of this file. The input chooses an image (the
// journal after that step of the taped first life), whether the restart
// comes past every deadline, and the mutations (see mutate).
func FuzzOpen(f *testing.F) {
	base := fuzzOpenBase(f)
	u16 := func(v int) []byte { return []byte{byte(v), byte(v >> 8)} }
	u24 := func(v int) []byte { return []byte{byte(v), byte(v >> 8), byte(v >> 16)} }
	op := func(code int, operands ...[]byte) []byte {
		b := []byte{byte(code), 0} // the first segment
		for _, o := range operands {
			b = append(b, o...)
		}
		return b
	}
	rng := rand.New(rand.NewPCG(27, 2))
	for k, img := range base.images {
		f.Add(uint8(k), k%2 == 1, []byte(nil))
		if k == 0 || len(img) == 0 {
			continue
		}
		// The last unit (the step's records, in the last segment), cut at
		// every record boundary and at a byte.
		fs, end := frames(img[len(img)-1].bytes())
		from, kept := 0, 0
		if prev := base.images[k-1]; len(prev) > 0 && prev[len(prev)-1].name == img[len(img)-1].name {
			pfs, pend := frames(prev[len(prev)-1].bytes())
			from, kept = pend, len(pfs)
		}
		if k%4 == 0 {
			for i := kept; i < len(fs); i++ {
				f.Add(uint8(k), i%2 == 0, op(opRecordCut, u16(i)))
			}
		}
		if end > from+1 && k%3 == 0 {
			f.Add(uint8(k), false, op(opCrashCut, u24(from+1+rng.IntN(end-from-1))))
		}
	}
	last := uint8(len(base.images) - 1)
	mid := uint8(len(base.images) / 2)
	for _, seed := range [][]byte{
		op(opFlip, u24(5), []byte{0x40}),
		op(opTruncate, u24(100)),
		op(opGarbage, u24(30), []byte{0, 8}, bytes.Repeat([]byte{0xAB}, 9)),
		op(opReplace, u16(3), []byte{1}, u16(5), []byte{1, 2, 3, 4, 5}),
		op(opPatch, u16(7), u16(9), []byte{0x80}),
		op(opVarint, u16(1), u16(3), []byte{11}),  // a length of 2^60 (the kind)
		op(opVarint, u16(4), u16(12), []byte{11}), // one further in
		op(opReorder, []byte{0}, u16(2), u16(6)),
		op(opReorder, []byte{1}, u16(2), u16(6)),
		op(opReorder, []byte{2}, u16(4), u16(0)),
		op(opReorder, []byte{3}, u16(8), u16(0)),
		op(opReorder, []byte{4}, u16(8), u16(0)),
		op(opField, u16(5), []byte{4, 2}),      // an attempt's status
		op(opField, u16(9), []byte{6, 3}),      // an attempt's session
		op(opField, u16(2), []byte{13, 0, 5}),  // a spec's parent
		op(opField, u16(12), []byte{10, 0, 2}), // a notification's kind
		op(opField, u16(3), []byte{11}),        // what only some kinds carry, gone
	} {
		f.Add(mid, false, seed)
		f.Add(last, true, seed)
	}
	f.Fuzz(func(t *testing.T, image uint8, late bool, ops []byte) {
		if len(ops) > 1<<12 {
			return
		}
		img := base.images[int(image)%len(base.images)]
		checkOpenImage(t, base, mutate(img, ops), late)
	})
}
