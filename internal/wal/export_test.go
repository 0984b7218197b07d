package wal

import "os"

// SegmentFiles lists dir's segment files, in order, as a Log reads them.
func SegmentFiles(dir string) ([]string, error) {
	ns, err := segmentsIn(osFS{}, dir)
	names := make([]string, len(ns))
	for i, n := range ns {
		names[i] = segName(n)
	}
	return names, err
}

// UnitBytes is W of the package doc: the most one write and sync covers.
const UnitBytes = unitBytes

// GrowBytes is the chunk of zeros a preallocated segment grows by.
const GrowBytes = growBytes

// Fdatasync is the sync a Log uses for an *os.File.
func Fdatasync(f *os.File) error { return fdatasync(f) }
