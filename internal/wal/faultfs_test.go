package wal_test

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask/internal/wal"
)

// errInjected is what the fault FS fails with.
var errInjected = errors.New("injected fault")

// faultFS is the operating system's file system with hooks: a test arms a
// hook (set) and the next calls of that kind go through it. A nil hook
// passes the call through. Hooks run outside faultFS.mu.
type faultFS struct {
	mu        sync.Mutex
	syncs     int // File.Sync and SyncData calls on segment files (seg-*)
	dataSyncs int // those of them after a Write of records (so: rounds, or units)
	onSync    func(name string) error
	onWrite   func(name string, f *os.File, p []byte) (int, error)
	onWriteAt func(name string, f *os.File, p []byte, off int64) (int, error)
	onRename  func(oldpath, newpath string) error
	onRemove  func(name string) error
	onSyncDir func(dir string) error // before a SyncDir: an error fails it

	// Durability model (nil maps: off): each segment's content as its
	// last sync left it (a truncation counts at once), and which files
	// were created since their directory was last fsynced (a crash may
	// lose them).
	durable  map[string][]byte
	unlinked map[string]bool
	// moved maps the old name to the new of each rename no fsync of the
	// old name's directory has made durable: a crash may find the file
	// under its old name still.
	moved map[string]string

	open map[*faultFile]bool // renamed along with their file
}

// pageSize is the unit a crash keeps or loses of writes not yet synced.
const pageSize = 4 << 10

// trackDurability turns the durability model on; snapshot uses it.
func (fs *faultFS) trackDurability() {
	fs.durable = map[string][]byte{}
	fs.unlinked = map[string]bool{}
	fs.moved = map[string]string{}
}

// snapshot copies into to what of from's segments would survive a power
// cut now: each segment as its last sync left it, and no file whose
// creation no directory fsync has made durable.
func (fs *faultFS) snapshot(t *testing.T, from, to string) {
	t.Helper()
	fs.crash(t, from, to, nil)
}

// crashModel says what a crash keeps of the writes since a file's last
// sync: whether a size change, and which pages (by index in the file).
type crashModel struct {
	size func() bool
	page func(i int) bool
}

// snapshotTorn is snapshot where the writes since a segment's last sync
// are not all lost: each 4 KiB page they changed is kept or lost at
// random (pages of a file reach the disk in any order), the rest is as
// the last sync left it, and a size change is kept or lost at random too
// (bytes the new size covers that were never written read as zeros).
func (fs *faultFS) snapshotTorn(t *testing.T, from, to string, rng *rand.Rand) {
	t.Helper()
	coin := func() bool { return rng.IntN(2) == 0 }
	fs.crash(t, from, to, &crashModel{size: coin, page: func(int) bool { return coin() }})
}

// crash is snapshot, or with a model snapshotTorn's crash as it says.
func (fs *faultFS) crash(t *testing.T, from, to string, model *crashModel) {
	t.Helper()
	fs.mu.Lock()
	defer fs.mu.Unlock()
	require.NotNil(t, fs.durable, "trackDurability first")
	fs.crashDir(t, from, to, model)
}

// crashDir is crash of one directory and those below it (a repair's
// copy). fs.mu is held.
func (fs *faultFS) crashDir(t *testing.T, from, to string, model *crashModel) {
	t.Helper()
	ents, err := os.ReadDir(from)
	require.NoError(t, err)
	for _, e := range ents {
		path := filepath.Join(from, e.Name())
		if e.IsDir() {
			require.NoError(t, os.Mkdir(filepath.Join(to, e.Name()), 0o755))
			fs.crashDir(t, path, filepath.Join(to, e.Name()), model)
			continue
		}
		if !isSeg(path) || fs.unlinked[path] {
			continue
		}
		img := fs.durable[path]
		if model != nil {
			cur, err := os.ReadFile(path)
			require.NoError(t, err)
			img = tornImage(img, cur, model)
		}
		require.NoError(t, os.WriteFile(filepath.Join(to, e.Name()), img, 0o644))
	}
	for oldpath, newpath := range fs.moved {
		if filepath.Dir(oldpath) == filepath.Clean(from) {
			require.NoError(t, os.WriteFile(filepath.Join(to, filepath.Base(oldpath)), fs.durable[newpath], 0o644))
		}
	}
}

// tornImage is what a crash leaves, by model, of a file whose last sync
// left durable and whose content is now cur (see snapshotTorn).
func tornImage(durable, cur []byte, model *crashModel) []byte {
	n := len(durable)
	if len(cur) != n && model.size() {
		n = len(cur)
	}
	img := make([]byte, n)
	copy(img, durable)
	for p := 0; p < n && p < len(cur); p += pageSize {
		e := min(p+pageSize, n, len(cur))
		if !bytes.Equal(img[p:e], cur[p:e]) && model.page(p/pageSize) {
			copy(img[p:e], cur[p:e])
		}
	}
	return img
}

// unsynced reports whether a segment holds data its last sync did not
// make durable (zeros written after its end do not count).
func (fs *faultFS) unsynced(name string) bool {
	cur, err := os.ReadFile(name)
	if err != nil {
		return false
	}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	d := fs.durable[name]
	if len(cur) < len(d) {
		return false
	}
	return !bytes.Equal(cur[:len(d)], d) || !bytes.Equal(cur[len(d):], make([]byte, len(cur)-len(d)))
}

var _ wal.FS = (*faultFS)(nil)

// set changes hooks while a Log may be using the FS.
func (fs *faultFS) set(change func(fs *faultFS)) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	change(fs)
}

// clear disarms every hook (for use with set).
func (fs *faultFS) clear() {
	fs.onSync, fs.onWrite, fs.onWriteAt, fs.onRename, fs.onRemove, fs.onSyncDir = nil, nil, nil, nil, nil, nil
}

func (fs *faultFS) syncCount() int {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return fs.syncs
}

func (fs *faultFS) dataSyncCount() int {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return fs.dataSyncs
}

// isSeg: a segment file, or a compaction's temporary one.
func isSeg(name string) bool { return strings.HasPrefix(filepath.Base(name), "seg-") }

func (fs *faultFS) OpenFile(name string, flag int, perm os.FileMode) (wal.File, error) {
	_, statErr := os.Stat(name)
	f, err := os.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if fs.durable != nil && isSeg(name) {
		_, known := fs.durable[name]
		switch {
		case errors.Is(statErr, os.ErrNotExist):
			fs.unlinked[name] = true
			fs.durable[name] = []byte{}
		case flag&os.O_TRUNC != 0:
			fs.durable[name] = []byte{}
		case !known: // there before the model: durable as it is
			data, err := os.ReadFile(name)
			if err != nil {
				f.Close()
				return nil, err
			}
			fs.durable[name] = data
		}
	}
	ff := &faultFile{fs: fs, name: name, f: f}
	if fs.open == nil {
		fs.open = map[*faultFile]bool{}
	}
	fs.open[ff] = true
	return ff, nil
}

func (fs *faultFS) Rename(oldpath, newpath string) error {
	fs.mu.Lock()
	hook := fs.onRename
	fs.mu.Unlock()
	if hook != nil {
		return hook(oldpath, newpath)
	}
	return fs.rename(oldpath, newpath)
}

// rename is Rename with no hook: a hook may call it to rename as the
// model says.
func (fs *faultFS) rename(oldpath, newpath string) error {
	if err := os.Rename(oldpath, newpath); err != nil {
		return err
	}
	fs.mu.Lock()
	if fs.durable != nil { // the new name is durable at the next SyncDir of its directory, the old one gone at its own's
		d, known := fs.durable[oldpath]
		if !known && isSeg(oldpath) { // there before the model: durable as it is
			d, _ = os.ReadFile(newpath)
		}
		if isSeg(oldpath) && !fs.unlinked[oldpath] {
			fs.moved[oldpath] = newpath
		}
		fs.durable[newpath] = d
		fs.unlinked[newpath] = true
		delete(fs.durable, oldpath)
		delete(fs.unlinked, oldpath)
	}
	for f := range fs.open {
		if f.name == oldpath {
			f.name = newpath
		}
	}
	fs.mu.Unlock()
	return nil
}

func (fs *faultFS) Remove(name string) error {
	fs.mu.Lock()
	hook := fs.onRemove
	fs.mu.Unlock()
	if hook != nil {
		return hook(name)
	}
	if err := os.Remove(name); err != nil {
		return err
	}
	fs.mu.Lock()
	delete(fs.durable, name)
	fs.mu.Unlock()
	return nil
}

func (fs *faultFS) ReadDir(name string) ([]os.DirEntry, error) { return os.ReadDir(name) }

func (fs *faultFS) MkdirAll(path string, perm os.FileMode) error { return os.MkdirAll(path, perm) }

func (fs *faultFS) SyncDir(dir string) error {
	fs.mu.Lock()
	hook := fs.onSyncDir
	fs.mu.Unlock()
	if hook != nil { // before the sync, as onSync: an error fails it
		if err := hook(dir); err != nil {
			return err
		}
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return err
	}
	fs.mu.Lock()
	for name := range fs.unlinked {
		if filepath.Dir(name) == filepath.Clean(dir) {
			delete(fs.unlinked, name)
		}
	}
	for name := range fs.moved {
		if filepath.Dir(name) == filepath.Clean(dir) {
			delete(fs.moved, name)
		}
	}
	fs.mu.Unlock()
	return nil
}

type faultFile struct {
	fs    *faultFS
	name  string // guarded by fs.mu (Rename changes it)
	f     *os.File
	wrote bool // a Write since the last sync
}

func (f *faultFile) Read(p []byte) (int, error) { return f.f.Read(p) }

func (f *faultFile) Close() error {
	f.fs.mu.Lock()
	delete(f.fs.open, f)
	f.fs.mu.Unlock()
	return f.f.Close()
}

func (f *faultFile) Seek(offset int64, whence int) (int64, error) { return f.f.Seek(offset, whence) }
func (f *faultFile) Fd() uintptr                                  { return f.f.Fd() }

func (f *faultFile) Truncate(size int64) error {
	if err := f.f.Truncate(size); err != nil {
		return err
	}
	f.fs.mu.Lock()
	if d, ok := f.fs.durable[f.name]; ok && int64(len(d)) > size { // durable at once
		f.fs.durable[f.name] = d[:size]
	}
	f.fs.mu.Unlock()
	return nil
}

func (f *faultFile) Write(p []byte) (int, error) {
	f.fs.mu.Lock()
	hook, name := f.fs.onWrite, f.name
	f.fs.mu.Unlock()
	f.wrote = true
	if hook != nil && isSeg(name) {
		return hook(name, f.f, p)
	}
	return f.f.Write(p)
}

func (f *faultFile) WriteAt(p []byte, off int64) (int, error) {
	f.fs.mu.Lock()
	hook, name := f.fs.onWriteAt, f.name
	f.fs.mu.Unlock()
	if hook != nil && isSeg(name) {
		return hook(name, f.f, p, off)
	}
	return f.f.WriteAt(p, off)
}

func (f *faultFile) Sync() error     { return f.sync(f.f.Sync) }
func (f *faultFile) SyncData() error { return f.sync(func() error { return wal.Fdatasync(f.f) }) }

// sync runs the onSync hook (segments only), then do, then updates the
// durability model.
func (f *faultFile) sync(do func() error) error {
	f.fs.mu.Lock()
	name := f.name
	if !isSeg(name) {
		f.fs.mu.Unlock()
		return do()
	}
	f.fs.syncs++
	if f.wrote {
		f.fs.dataSyncs++
	}
	f.wrote = false
	hook := f.fs.onSync
	f.fs.mu.Unlock()
	if hook != nil {
		if err := hook(name); err != nil {
			return err
		}
	}
	if err := do(); err != nil {
		return err
	}
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	if f.fs.durable != nil {
		data, err := os.ReadFile(f.name)
		if err != nil {
			return err
		}
		f.fs.durable[f.name] = data
	}
	return nil
}

// dropAfter is an onWrite hook that persists a segment's bytes up to
// offset budget and silently drops the rest, reporting success: what a
// crash leaves of writes that reached the page cache but not the disk.
func dropAfter(budget int64) func(name string, f *os.File, p []byte) (int, error) {
	return func(name string, f *os.File, p []byte) (int, error) {
		pos, err := f.Seek(0, io.SeekCurrent)
		if err != nil {
			return 0, err
		}
		keep := min(max(budget-pos, 0), int64(len(p)))
		if keep > 0 {
			if n, err := f.Write(p[:keep]); err != nil {
				return n, err
			}
		}
		return len(p), nil
	}
}

// gate holds the first call that goes through it until the test releases
// it with the call's result; later calls pass (nil) at once.
type gate struct {
	once    sync.Once
	entered chan struct{} // closed when the first call arrives
	release chan error    // the first call's result
}

// waiting waits for b on a goroutine of its own (the waiter writes: with
// no waiter nothing is written) and hands back what Wait returned.
func waiting(b *wal.Batch) <-chan error {
	done := make(chan error, 1)
	go func() { done <- b.Wait() }()
	return done
}

func newGate() *gate {
	return &gate{entered: make(chan struct{}), release: make(chan error, 1)}
}

// hold reports whether this call is the held one and, if so, blocks until
// released and returns the released error.
func (g *gate) hold() (bool, error) {
	first := false
	g.once.Do(func() { first = true })
	if !first {
		return false, nil
	}
	close(g.entered)
	return true, <-g.release
}
