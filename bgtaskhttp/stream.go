package bgtaskhttp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bgtask/bgtask"
)

// The event stream.
//
// Every client of one Handler is served from one Manager subscription, a
// feed: the first client starts it, the last to leave stops it and waits
// for it to end. The feed's goroutine only moves each change into a
// window, the latest changes up to Options.StreamBuffer bytes, which the
// clients read, each at its own place; the first client to write a change
// encodes it, as the SSE frame every client writes (so the feed keeps up
// with the Manager however busy the clients keep the CPUs). A client whose
// place left the window is told it lagged, and dropped. The latest
// snapshot is encoded once and kept: a client that joins gets it and the
// window's changes after it, and a new one is taken only once the window
// no longer holds every change after the kept one. So a client costs the
// server its connection, its place and the batch of shared changes it is
// writing (at most batchLen); every write is under
// Options.StreamWriteTimeout, so one that does not read is let go once the
// kernel's buffers are full. The window itself is kept once (its array
// may hold about as many again of the changes that left it, until it
// grows), and so is the snapshot, except that a client still writing an
// older one keeps that one.

const (
	// batchLen bounds the changes a client takes from the window to
	// write at once.
	batchLen = 64
	// unencodedCost is what a change counts in the window until it is
	// encoded (about what one encodes to); then it counts its bytes.
	unencodedCost = 1 << 10
	// maxDepth bounds the walk up a task's tree (digest.note).
	maxDepth = 1000
)

// frame is the encoded snapshot: its seq and its bytes, shared.
type frame struct {
	seq uint64
	b   []byte
}

// entry is a change in the window, encoded once, by the first client to
// write it.
type entry struct {
	seq uint64
	// counts is what it counts in feed.bytes while in the window
	// (unencodedCost, then its frame's length), and -1 once it left.
	counts atomic.Int64

	mu  sync.Mutex
	c   *marked // until encoded
	b   []byte  // the SSE frame, once encoded
	err error
}

// marked is a change as the stream sends it: with what a page needs to
// tell whether it shows it (view.js), which the feed knows (digest).
type marked struct {
	*bgtask.Change
	// Was is the status the task had before ("" for a task the feed had
	// not seen: new); Top, the task at the top of its tree (its own id
	// for a task launched from no task's session).
	Was bgtask.Status `json:"was,omitempty"`
	Top string        `json:"top,omitempty"`
}

// digest is what a feed knows of every task: its status and parent, and
// which task each session is. It lets the stream say of each change the
// status the task had and the top of its tree, without a snapshot.
type digest struct {
	tasks map[string]mark   // by task id
	owner map[string]string // session → task id
	limit int               // past this many tasks, it is taken again from a snapshot
}

type mark struct {
	status bgtask.Status
	parent string
}

// digestOf is the digest of s.
func digestOf(s bgtask.Snapshot) *digest {
	d := &digest{tasks: make(map[string]mark, len(s.Tasks)), owner: map[string]string{}, limit: max(2*len(s.Tasks), 100_000)}
	for i := range s.Tasks {
		d.note(&s.Tasks[i])
	}
	return d
}

// note takes t's change in, and returns the status t had and its top.
func (d *digest) note(t *bgtask.Task) (was bgtask.Status, top string) {
	was = d.tasks[t.ID].status
	d.tasks[t.ID] = mark{status: t.Status, parent: t.ParentSessionID}
	for _, a := range t.Attempts {
		if a.SessionID != "" {
			d.owner[a.SessionID] = t.ID
		}
	}
	top = t.ID
	for steps, up := 0, t.ParentSessionID; steps < maxDepth; steps++ {
		id, ok := d.owner[up]
		if !ok || id == top {
			break
		}
		top, up = id, d.tasks[id].parent
	}
	return was, top
}

// full says the digest has grown past its bound (tasks the Manager forgot
// are still in it): the feed takes it again from a snapshot.
func (d *digest) full() bool { return len(d.tasks) > d.limit }

// frame returns e's SSE frame, encoding it if no client did yet.
func (e *entry) frame(h *hub, f *feed) ([]byte, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.c == nil {
		return e.b, e.err
	}
	h.tell("encoded")
	b, err := json.Marshal(e.c)
	e.c = nil // what it kept of the task is let go
	if err != nil {
		e.err = err
		return nil, err
	}
	e.b = event("change", f.epoch, e.seq, b)
	// Count its bytes from now on, unless it left the window (the feed
	// took off what it counted then, whichever came first).
	if was := e.counts.Load(); was >= 0 && e.counts.CompareAndSwap(was, int64(len(e.b))) {
		f.bytes.Add(int64(len(e.b)) - was)
	}
	return e.b, nil
}

// hub serves the event stream of one Handler.
type hub struct {
	m            Source
	buffer       int // the feed's subscription buffer
	window       int // bytes of changes kept
	max          int // streams at once
	keepalive    time.Duration
	writeTimeout time.Duration
	note         func(event string) // tests: see tell

	mu      sync.Mutex
	streams int   // connected, at most max
	cur     *feed // the feed a client joins; nil: none runs
}

func newHub(m Source, o Options) *hub {
	return &hub{m: m, buffer: o.Buffer, window: o.StreamBuffer, max: o.MaxStreams,
		keepalive: o.Keepalive, writeTimeout: o.StreamWriteTimeout, note: o.streamNote}
}

// tell tells a test what the streams do: "digest" (a feed reads a
// snapshot for its digest), "snapshot" (one is taken for a client),
// "changed" (a change entered the window), "encoded" (a change was),
// "writing" (a stream writes its first event), "flushed" (a stream sent
// what it wrote), "ended" (a feed is about to end), "left" (a stream
// ended, and its feed too if it was the last).
func (h *hub) tell(event string) {
	if h.note != nil {
		h.note(event)
	}
}

// feed is one Manager subscription and the window of its changes.
type feed struct {
	ready chan struct{} // closed once subscribed and a snapshot is kept, or on failure (err)
	err   error         // why it could not start; read after ready
	stop  context.CancelFunc
	done  chan struct{} // closed when run returned

	clients int // joined, and not yet left; guarded by hub.mu

	epoch uint64       // set before ready is closed
	bytes atomic.Int64 // what the window's entries count
	// window is the latest, set before ready is closed. run replaces it
	// and clients read it without a lock, so that neither waits on the
	// other however busy the CPUs are.
	window atomic.Pointer[window]

	mu       sync.Mutex    // guards what follows, set before ready is closed
	snap     frame         // the latest snapshot encoded
	building chan struct{} // a client is taking a snapshot for the others
}

// window is the latest changes as of one moment; never changed once
// published.
type window struct {
	entries []*entry      // at most Options.StreamBuffer bytes, and at least the last
	base    int           // the absolute index of entries[0]
	dropped uint64        // every change up to it may be missing from entries: it left the window, or came before the subscription
	seq     uint64        // the latest change's (or the first snapshot's)
	more    chan struct{} // closed once a later window is published
	ended   error         // why the subscription ended; nil while it runs
}

// join counts a new stream and returns the feed it reads, starting one if
// none runs.
func (h *hub) join() (*feed, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.streams >= h.max {
		return nil, errTooManyStreams
	}
	h.streams++
	f := h.cur
	if f == nil {
		ctx, stop := context.WithCancel(context.Background())
		f = &feed{ready: make(chan struct{}), stop: stop, done: make(chan struct{})}
		h.cur = f
		go h.run(ctx, f) // owned by the feed's clients: the last to leave stops and joins it
	}
	f.clients++
	return f, nil
}

// leave ends a stream; the last client of a feed stops it, and returns
// once it ended.
func (h *hub) leave(f *feed) {
	h.mu.Lock()
	h.streams--
	f.clients--
	last := f.clients == 0
	if last && h.cur == f {
		h.cur = nil
	}
	h.mu.Unlock()
	if last {
		f.stop()
		<-f.done
	}
}

// retire makes f, which ended, one no client joins.
func (h *hub) retire(f *feed) {
	h.mu.Lock()
	if h.cur == f {
		h.cur = nil
	}
	h.mu.Unlock()
}

// run subscribes, keeps a first snapshot, then moves every change into the
// window until the subscription ends.
func (h *hub) run(ctx context.Context, f *feed) {
	defer close(f.done)
	defer h.tell("ended")
	fail := func(err error) {
		h.retire(f)
		f.err = err
		close(f.ready)
	}
	sub, err := h.m.Subscribe(ctx, h.buffer)
	if err != nil {
		fail(err)
		return
	}
	defer sub.Close()
	// After subscribing: every later change is on sub.C. It is not encoded
	// (a client that needs a snapshot takes one: most resume): it is only
	// where the window starts, and the digest.
	h.tell("digest")
	snap := h.m.Snapshot()
	d := digestOf(snap)
	f.epoch = snap.Epoch
	f.window.Store(&window{dropped: snap.Seq, seq: snap.Seq, more: make(chan struct{})})
	snap = bgtask.Snapshot{}
	close(f.ready)

	for {
		c, open := <-sub.C
		if !open {
			break
		}
		w := f.window.Load()
		next := &window{entries: w.entries, base: w.base, dropped: w.dropped, more: make(chan struct{})}
		// Take what else is there (some), so that clients wake once for a
		// burst.
		for k := 1; open; k++ {
			change := c // each entry its own
			if d.full() {
				// The Manager forgot what the digest still holds. (The
				// changes between the new snapshot and this one are noted
				// twice: their Was may be their own status.)
				h.tell("digest")
				d = digestOf(h.m.Snapshot())
			}
			was, top := d.note(&change.Task)
			e := &entry{seq: c.Seq, c: &marked{Change: &change, Was: was, Top: top}}
			e.counts.Store(unencodedCost)
			f.bytes.Add(unencodedCost)
			next.entries = append(next.entries, e) // after the end of every window published: none sees it
			next.seq = c.Seq
			h.tell("changed")
			if len(sub.C) == 0 || k == 256 {
				break // the next receive would wait, or the clients have waited long enough
			}
			c, open = <-sub.C
		}
		n := 0
		for ; f.bytes.Load() > int64(h.window) && n < len(next.entries)-1; n++ {
			old := next.entries[n]
			f.bytes.Add(-old.counts.Swap(-1))
			next.dropped = max(next.dropped, old.seq)
		}
		next.entries, next.base = next.entries[n:], next.base+n
		f.window.Store(next)
		close(w.more)
	}
	h.retire(f)
	err = sub.Err()
	if err == nil {
		err = ctx.Err()
	}
	w := f.window.Load()
	last := *w
	last.ended, last.more = err, make(chan struct{})
	close(last.more)
	f.window.Store(&last)
	close(w.more)
}

// taken is a snapshot, encoded.
type taken struct {
	frame
	epoch uint64
}

// snapshot takes and encodes a snapshot.
func (h *hub) snapshot() (taken, error) {
	h.tell("snapshot")
	s := h.m.Snapshot()
	b, err := json.Marshal(s)
	if err != nil {
		return taken{}, err
	}
	return taken{frame{seq: s.Seq, b: event("snapshot", s.Epoch, s.Seq, b)}, s.Epoch}, nil
}

// event is one SSE event (data is JSON: one line).
func event(kind string, epoch, seq uint64, data []byte) []byte {
	b := make([]byte, 0, len(data)+64)
	b = append(b, "id: "...)
	b = append(b, eventID(epoch, seq)...)
	b = append(b, "\nevent: "...)
	b = append(b, kind...)
	b = append(b, "\ndata: "...)
	b = append(b, data...)
	return append(b, "\n\n"...)
}

// start places a client in f's stream. A client that has every change up
// to the (epoch, seq) it names, and that f still holds every change after,
// resumes (first is nil); any other gets a snapshot. It returns the
// absolute index of the first entry the client reads and the seq up to
// which it has every change (entries up to it are skipped).
func (h *hub) start(ctx context.Context, f *feed, epoch, seq uint64, resume bool) (first []byte, cursor int, last uint64, err error) {
	f.mu.Lock()
	for waited := false; ; waited = true {
		w := f.window.Load()
		switch {
		case resume && epoch == f.epoch && seq >= w.dropped && seq <= max(w.seq, f.snap.seq):
			f.mu.Unlock()
			return nil, w.base, seq, nil
		case f.snap.b != nil && f.snap.seq >= w.dropped: // the kept snapshot and the window are every change
			first, last = f.snap.b, f.snap.seq
			f.mu.Unlock()
			return first, w.base, last, nil
		}
		if f.building == nil || waited {
			// Take one: every change after what the window holds now is
			// read from the window, and the snapshot has every change
			// before.
			cursor = w.base + len(w.entries)
			break
		}
		wait := f.building // another client takes one: it may do
		f.mu.Unlock()
		select {
		case <-wait:
		case <-ctx.Done():
			return nil, 0, 0, ctx.Err()
		}
		f.mu.Lock()
	}
	var mine chan struct{}
	if f.building == nil {
		mine = make(chan struct{})
		f.building = mine
	}
	f.mu.Unlock()
	snap, err := h.snapshot()
	f.mu.Lock()
	if err == nil && snap.seq > f.snap.seq {
		f.snap = snap.frame
	}
	if mine != nil {
		f.building = nil
		close(mine)
	}
	f.mu.Unlock()
	return snap.b, cursor, snap.seq, err
}

// serve streams to one client.
func (h *hub) serve(w http.ResponseWriter, r *http.Request) {
	rc := http.NewResponseController(w)
	// Each write has its own deadline, which replaces the server's
	// WriteTimeout: that one does not end the stream.
	deadline := func() error { return rc.SetWriteDeadline(time.Now().Add(h.writeTimeout)) }
	if err := deadline(); err != nil {
		writeError(w, fmt.Errorf("bgtaskhttp: the event stream needs a connection it can set write deadlines on: %w", err))
		return
	}
	f, err := h.join()
	if err != nil {
		writeError(w, err)
		return
	}
	defer func() {
		h.leave(f)
		h.tell("left")
	}()
	ctx := r.Context()
	select {
	case <-f.ready:
	case <-ctx.Done():
		return
	}
	if f.err != nil {
		writeError(w, f.err)
		return
	}
	epoch, seq, resume := lastEventID(r)
	first, cursor, last, err := h.start(ctx, f, epoch, seq, resume)
	if err != nil {
		writeError(w, err)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	if first == nil {
		first = []byte(": resumed\n\n")
	}
	h.tell("writing")
	write := func(b []byte) bool {
		_ = deadline()
		_, err := w.Write(b)
		return err == nil
	}
	flush := func() bool {
		_ = deadline()
		if rc.Flush() != nil {
			return false
		}
		h.tell("flushed")
		return true
	}
	if !write(first) || !flush() {
		return
	}
	first = nil // the snapshot is not kept by this client
	tick := time.NewTicker(h.keepalive)
	defer tick.Stop()
	batch := make([]*entry, 0, batchLen)
	for {
		win := f.window.Load()
		behind := cursor < win.base
		if !behind {
			from := win.entries[cursor-win.base:]
			batch = append(batch, from[:min(len(from), batchLen)]...)
		}
		switch ended := win.ended; {
		case behind || len(batch) == 0 && errors.Is(ended, bgtask.ErrLagged):
			// It fell behind by more than the window (or the feed did):
			// it reconnects, and resyncs.
			_ = write([]byte("event: lagged\ndata: {}\n\n")) && flush()
			return
		case len(batch) > 0:
			for _, e := range batch {
				if e.seq <= last {
					continue // the snapshot (or the client) has it
				}
				b, err := e.frame(h, f)
				if err != nil || !write(b) {
					return
				}
				last = e.seq
			}
			if !flush() {
				return
			}
			cursor += len(batch)
			clear(batch) // the changes are not kept by this client
			batch = batch[:0]
			continue
		case ended != nil:
			return
		}
		select {
		case <-win.more:
		case <-tick.C:
			if !write([]byte(": keepalive\n\n")) || !flush() {
				return
			}
		case <-ctx.Done():
			return
		}
	}
}

// lastEventID reads the (epoch, seq) a reconnecting client has: the
// Last-Event-ID header, or else the lastEventId query parameter (a page
// that rendered a snapshot names it so, as EventSource sends no header on
// its first connection).
func lastEventID(r *http.Request) (epoch, seq uint64, ok bool) {
	id := r.Header.Get("Last-Event-ID")
	if id == "" {
		id = r.URL.Query().Get("lastEventId")
	}
	return parseEventID(id)
}

// eventID is the SSE id of a change: its epoch and sequence.
func eventID(epoch, seq uint64) string {
	return strconv.FormatUint(epoch, 10) + ":" + strconv.FormatUint(seq, 10)
}

// parseEventID reads what eventID wrote.
func parseEventID(s string) (epoch, seq uint64, ok bool) {
	a, b, found := strings.Cut(s, ":")
	if !found {
		return 0, 0, false
	}
	e, err1 := strconv.ParseUint(a, 10, 64)
	q, err2 := strconv.ParseUint(b, 10, 64)
	return e, q, err1 == nil && err2 == nil
}
