//go:build !linux

package wal

import "os"

// fdatasync is f.Sync where there is no fdatasync to call.
func fdatasync(f *os.File) error { return f.Sync() }
