package wal

// SegmentFiles lists dir's segment files, in order, as a Log reads them.
func SegmentFiles(dir string) ([]string, error) {
	ns, err := segmentsIn(osFS{}, dir)
	names := make([]string, len(ns))
	for i, n := range ns {
		names[i] = segName(n)
	}
	return names, err
}
