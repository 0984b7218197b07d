//go:build linux

package wal

import (
	"os"
	"syscall"
)

// fdatasync makes f's data durable, and of its metadata only what reading
// the data needs (its size): overwriting preallocated zeros then commits
// no metadata at all, where fsync would still write the inode's times.
func fdatasync(f *os.File) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		for {
			if serr = syscall.Fdatasync(int(fd)); serr != syscall.EINTR {
				return
			}
		}
	}); err != nil {
		return err
	}
	if serr != nil {
		return &os.PathError{Op: "fdatasync", Path: f.Name(), Err: serr}
	}
	return nil
}
