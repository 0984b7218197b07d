package wal_test

import (
	"errors"
	"io"
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
	syncs     int // File.Sync calls on segment files (seg-*)
	onSync    func(name string) error
	onWrite   func(name string, f *os.File, p []byte) (int, error)
	onRename  func(oldpath, newpath string) error
	onRemove  func(name string) error
	onSyncDir func(dir string) error

	// Durability model (nil maps: off): how much of each segment an
	// fsync has made durable, and which files were created since their
	// directory was last fsynced (a crash may lose them).
	synced   map[string]int64
	unlinked map[string]bool
}

// trackDurability turns the durability model on; snapshot uses it.
func (fs *faultFS) trackDurability() {
	fs.synced = map[string]int64{}
	fs.unlinked = map[string]bool{}
}

// snapshot copies into to what of from's segments would survive a power
// cut now: each segment up to what its last fsync covered, and no file
// whose creation no directory fsync has made durable.
func (fs *faultFS) snapshot(t *testing.T, from, to string) {
	t.Helper()
	fs.mu.Lock()
	defer fs.mu.Unlock()
	require.NotNil(t, fs.synced, "trackDurability first")
	ents, err := os.ReadDir(from)
	require.NoError(t, err)
	for _, e := range ents {
		path := filepath.Join(from, e.Name())
		if !isSeg(path) || fs.unlinked[path] {
			continue
		}
		data, err := os.ReadFile(path)
		require.NoError(t, err)
		n := min(fs.synced[path], int64(len(data)))
		require.NoError(t, os.WriteFile(filepath.Join(to, e.Name()), data[:n], 0o644))
	}
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
	fs.onSync, fs.onWrite, fs.onRename, fs.onRemove, fs.onSyncDir = nil, nil, nil, nil, nil
}

func (fs *faultFS) syncCount() int {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return fs.syncs
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
	if fs.unlinked != nil && errors.Is(statErr, os.ErrNotExist) {
		fs.unlinked[name] = true
	}
	fs.mu.Unlock()
	return &faultFile{fs: fs, name: name, f: f}, nil
}

func (fs *faultFS) Rename(oldpath, newpath string) error {
	fs.mu.Lock()
	hook := fs.onRename
	fs.mu.Unlock()
	if hook != nil {
		return hook(oldpath, newpath)
	}
	if err := os.Rename(oldpath, newpath); err != nil {
		return err
	}
	fs.mu.Lock()
	if fs.synced != nil { // the new name is durable at the next SyncDir
		fs.synced[newpath] = fs.synced[oldpath]
		fs.unlinked[newpath] = true
		delete(fs.synced, oldpath)
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
	return os.Remove(name)
}

func (fs *faultFS) ReadDir(name string) ([]os.DirEntry, error) { return os.ReadDir(name) }

func (fs *faultFS) MkdirAll(path string, perm os.FileMode) error { return os.MkdirAll(path, perm) }

func (fs *faultFS) SyncDir(dir string) error {
	fs.mu.Lock()
	hook := fs.onSyncDir
	fs.mu.Unlock()
	if hook != nil {
		return hook(dir)
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
	fs.mu.Unlock()
	return nil
}

type faultFile struct {
	fs   *faultFS
	name string
	f    *os.File
}

func (f *faultFile) Read(p []byte) (int, error)                   { return f.f.Read(p) }
func (f *faultFile) Close() error                                 { return f.f.Close() }
func (f *faultFile) Seek(offset int64, whence int) (int64, error) { return f.f.Seek(offset, whence) }
func (f *faultFile) Fd() uintptr                                  { return f.f.Fd() }

func (f *faultFile) Truncate(size int64) error {
	if err := f.f.Truncate(size); err != nil {
		return err
	}
	f.fs.mu.Lock()
	if f.fs.synced != nil && f.fs.synced[f.name] > size {
		f.fs.synced[f.name] = size
	}
	f.fs.mu.Unlock()
	return nil
}

func (f *faultFile) Write(p []byte) (int, error) {
	f.fs.mu.Lock()
	hook := f.fs.onWrite
	f.fs.mu.Unlock()
	if hook != nil && isSeg(f.name) {
		return hook(f.name, f.f, p)
	}
	return f.f.Write(p)
}

func (f *faultFile) Sync() error {
	if !isSeg(f.name) {
		return f.f.Sync()
	}
	f.fs.mu.Lock()
	f.fs.syncs++
	hook := f.fs.onSync
	f.fs.mu.Unlock()
	if hook != nil {
		if err := hook(f.name); err != nil {
			return err
		}
	}
	if err := f.f.Sync(); err != nil {
		return err
	}
	fi, err := f.f.Stat()
	if err != nil {
		return err
	}
	f.fs.mu.Lock()
	if f.fs.synced != nil {
		f.fs.synced[f.name] = fi.Size()
	}
	f.fs.mu.Unlock()
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
