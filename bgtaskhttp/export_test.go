package bgtaskhttp

// WithStreamNote makes the Handler's event streams tell f what they do
// (see hub.tell).
func WithStreamNote(o Options, f func(event string)) Options {
	o.streamNote = f
	return o
}
