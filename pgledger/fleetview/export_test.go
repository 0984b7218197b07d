package fleetview

// ClosuresRead is a channel that hears each time v read the closures'
// records again.
func ClosuresRead(v *View) <-chan struct{} {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.read == nil {
		v.read = make(chan struct{}, 1)
	}
	return v.read
}
