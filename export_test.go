package bgtask

import "testing"

// SetEpochForTest sets m's epoch, as if its process life had begun at
// another wall-clock time. Call it before m's epoch is read (Subscribe,
// Snapshot).
func SetEpochForTest(m *Manager, epoch uint64) {
	m.mu.Lock()
	defer m.unlock()
	m.changes.epoch = epoch
}

// RecvForTest is recv for the external test package: it receives from c,
// failing t naming what if nothing comes within hangBound.
func RecvForTest[T any](t testing.TB, c <-chan T, what string, args ...any) T {
	t.Helper()
	return recv(t, c, what, args...)
}

// RecvAllForTest is recvAll for the external test package: it receives
// from c until it is closed, failing t naming what if that takes longer
// than hangBound between values.
func RecvAllForTest[T any](t testing.TB, c <-chan T, what string, args ...any) []T {
	t.Helper()
	return recvAll(t, c, what, args...)
}
