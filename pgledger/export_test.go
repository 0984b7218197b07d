package pgledger

// abandon stops the journal as a crash would: its writer and heartbeat
// end, its lease is left to expire, and nothing more it is given lands.
func (j *Journal) abandon() {
	j.mu.Lock()
	if j.failed == nil {
		j.failed = ErrClosed
	}
	j.closed = true
	j.mu.Unlock()
	close(j.stop)
	j.done.Wait()
}
