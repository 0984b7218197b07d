package bgtask

// SetEpochForTest sets m's epoch, as if its process life had begun at
// another wall-clock time. Call it before m's epoch is read (Subscribe,
// Snapshot).
func SetEpochForTest(m *Manager, epoch uint64) {
	m.mu.Lock()
	defer m.unlock()
	m.changes.epoch = epoch
}
