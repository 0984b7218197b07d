package bgtaskhttp_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/internal/testkit"
	"github.com/bgtask/bgtask/mirror"
)

// sseEvent is one event of a stream, or one comment.
type sseEvent struct {
	id, kind, data, comment string
}

// seq is the event's sequence, from its id.
func (e sseEvent) seq() uint64 {
	var epoch, seq uint64
	_, _ = fmt.Sscanf(e.id, "%d:%d", &epoch, &seq)
	return seq
}

// sse is an open event stream.
type sse struct {
	resp *http.Response
	rd   *bufio.Reader
	stop context.CancelFunc
}

// openStream opens /events (path may add a query) with the headers, and
// requires a 200.
func (s *svc) openStream(t *testing.T, path string, header map[string]string) *sse {
	t.Helper()
	c, err := s.tryStream(path, header)
	require.NoError(t, err)
	return c
}

func (s *svc) tryStream(path string, header map[string]string) (*sse, error) {
	ctx, stop := context.WithCancel(s.ctx)
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.srv.URL+path, nil)
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := s.srv.Client().Do(req)
	if err != nil {
		stop()
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		stop()
		return nil, fmt.Errorf("%d %s", resp.StatusCode, b)
	}
	return &sse{resp: resp, rd: bufio.NewReader(resp.Body), stop: stop}, nil
}

// next reads the next event or comment.
func (c *sse) next() (sseEvent, error) {
	var e sseEvent
	for {
		line, err := c.rd.ReadString('\n')
		if err != nil {
			return e, err
		}
		line = strings.TrimSuffix(line, "\n")
		switch {
		case line == "" && (e.kind != "" || e.comment != ""):
			return e, nil
		case strings.HasPrefix(line, ": "):
			e.comment = line[2:]
		case strings.HasPrefix(line, "id: "):
			e.id = line[4:]
		case strings.HasPrefix(line, "event: "):
			e.kind = line[7:]
		case strings.HasPrefix(line, "data: "):
			e.data = line[6:]
		}
	}
}

func (c *sse) mustNext(t *testing.T) sseEvent {
	t.Helper()
	e, err := c.next()
	require.NoError(t, err)
	return e
}

func (c *sse) close() {
	c.stop()
	c.resp.Body.Close()
}

// notes counts what the streams tell (WithStreamNote), and lets a test
// wait for them.
type notes struct {
	mu     sync.Mutex
	counts map[string]int
	wake   chan struct{}
	hold   func(event string) // called before counting, outside mu
}

func newNotes() *notes { return &notes{counts: map[string]int{}, wake: make(chan struct{})} }

func (n *notes) note(event string) {
	if n.hold != nil {
		n.hold(event)
	}
	n.mu.Lock()
	n.counts[event]++
	close(n.wake)
	n.wake = make(chan struct{})
	n.mu.Unlock()
}

func (n *notes) count(event string) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.counts[event]
}

// await waits until event was told at least k times.
func (n *notes) await(ctx context.Context, event string, k int) error {
	for {
		n.mu.Lock()
		got, wake := n.counts[event], n.wake
		n.mu.Unlock()
		if got >= k {
			return nil
		}
		select {
		case <-wake:
		case <-ctx.Done():
			return fmt.Errorf("%d %q of %d: %w", got, event, k, ctx.Err())
		}
	}
}

// churn launches n tasks and completes each, telling progress after each.
func (s *svc) churn(n int, progress chan<- int) error {
	for i := range n {
		task, err := s.m.Launch(s.ctx, bgtask.Spec{ParentSessionID: "chat", Prompt: "p", Models: []bgtask.Model{{ID: "m"}}})
		if err != nil {
			return err
		}
		if task, err = bgtasktest.WaitStatus(s.ctx, s.m, task.ID, bgtask.StatusRunning); err != nil {
			return err
		}
		if err := s.host.Idle(task.SessionID, "done"); err != nil {
			return err
		}
		progress <- i
	}
	return nil
}

// follower reads a stream as the Client does — reconnecting with the last
// id after a lag — into a mirror, and checks that each connection's
// changes follow its snapshot (or the id it resumed from) one by one.
type follower struct {
	mir      mirror.Mirror
	lags     int
	resumes  int
	problems []string
}

func (f *follower) follow(s *svc, first *sse, until func() uint64) error {
	c, last, lastID := first, uint64(0), ""
	for {
		e, err := c.next()
		if err != nil {
			c.close()
			return err
		}
		switch {
		case e.kind == "snapshot":
			var snap bgtask.Snapshot
			if err := json.Unmarshal([]byte(e.data), &snap); err != nil {
				return err
			}
			f.mir.ApplySnapshot(snap)
			last, lastID = snap.Seq, e.id
		case e.comment == "resumed":
			f.resumes++
		case e.kind == "change":
			var ch bgtask.Change
			if err := json.Unmarshal([]byte(e.data), &ch); err != nil {
				return err
			}
			if ch.Seq != last+1 {
				f.problems = append(f.problems, fmt.Sprintf("change %d after %d", ch.Seq, last))
			}
			f.mir.ApplyChange(ch)
			last, lastID = ch.Seq, e.id
		case e.kind == "lagged":
			f.lags++
			c.close()
			if c, err = s.tryStream("/events", map[string]string{"Last-Event-ID": lastID}); err != nil {
				return err
			}
		}
		if u := until(); u != 0 && last >= u {
			c.close()
			return nil
		}
	}
}

// Clients that join while changes flow each get a snapshot and then every
// later change, one by one, in order; with a small window they lag and
// resync, and still end where the Manager is.
func TestEveryStreamGetsASnapshotThenEveryLaterChangeInOrder(t *testing.T) {
	for _, window := range []int{4 << 20, 2 << 10} {
		t.Run(fmt.Sprint(window), func(t *testing.T) {
			s := newSvc(t, bgtaskhttp.Options{StreamBuffer: window, Keepalive: 5 * time.Millisecond})
			s.running(t, "chat")
			const tasks, clients = 120, 6
			progress := make(chan int, tasks)
			churned := make(chan error, 1)
			go func() { churned <- s.churn(tasks, progress) }()
			var final struct {
				sync.Mutex
				seq uint64
			}
			until := func() uint64 { final.Lock(); defer final.Unlock(); return final.seq }
			fs := make([]*follower, clients)
			followed := make(chan error, clients)
			for i := range clients {
				for p := range progress { // join once a few more tasks ended
					if p >= i*tasks/clients {
						break
					}
				}
				fs[i] = &follower{}
				first := s.openStream(t, "/events", nil)
				go func() { followed <- fs[i].follow(s, first, until) }()
			}
			require.NoError(t, <-churned)
			// A burst: one closure ends many tasks at once.
			burst := s.running(t, "burst")
			for range 30 {
				s.running(t, burst.SessionID)
			}
			_, err := s.m.Stop(s.ctx, bgtask.Target{Session: "burst"})
			require.NoError(t, err)
			want := s.m.Snapshot()
			final.Lock()
			final.seq = want.Seq
			final.Unlock()
			for range clients {
				require.NoError(t, <-followed)
			}
			lags := 0
			for i, f := range fs {
				assert.Empty(t, f.problems, "client %d", i)
				lags += f.lags
				got := f.mir.Tasks()
				require.Len(t, got, len(want.Tasks), "client %d", i)
				for k := range got {
					assert.Equal(t, want.Tasks[k].ID, got[k].ID)
					assert.Equal(t, want.Tasks[k].Revision, got[k].Revision, "client %d, %s", i, got[k].ID)
				}
			}
			if window == 4<<20 {
				assert.Zero(t, lags, "the window held every change")
			}
			t.Logf("window %d: %d lags", window, lags)
		})
	}
}

// One snapshot serves every client that joins before the window moved
// past it, and each change is encoded once, whatever the clients.
func TestStreamsShareOneSnapshotAndOneEncodingOfEachChange(t *testing.T) {
	n := newNotes()
	s := newSvc(t, bgtaskhttp.WithStreamNote(bgtaskhttp.Options{StreamBuffer: 8 << 10}, n.note))
	a := s.running(t, "chat")
	var cs []*sse
	var first sseEvent
	for range 8 {
		c := s.openStream(t, "/events", nil)
		defer c.close()
		first = c.mustNext(t)
		assert.Equal(t, "snapshot", first.kind)
		cs = append(cs, c)
	}
	assert.Equal(t, 1, n.count("snapshot"), "one snapshot for them all")
	// upTo reads every client up to the change with text in it, and
	// returns its seq.
	upTo := func(cs []*sse, text string) uint64 {
		var seq uint64
		for _, c := range cs {
			e := c.mustNext(t)
			for ; !strings.Contains(e.data, text); e = c.mustNext(t) {
				require.Equal(t, "change", e.kind)
			}
			seq = e.seq()
		}
		return seq
	}
	require.NoError(t, s.host.Emit(bgtask.Event{Kind: bgtask.SessionBusy, SessionID: a.SessionID, Progress: "step 1"}))
	last := upTo(cs, `"step 1"`)
	assert.Equal(t, int(last-first.seq()), n.count("encoded"), "each change encoded once, for the 8 clients")

	// A client that joins now gets the kept snapshot and the changes after it.
	late := s.openStream(t, "/events", nil)
	defer late.close()
	assert.Equal(t, first.id, late.mustNext(t).id, "the kept snapshot")
	upTo([]*sse{late}, `"step 1"`)
	assert.Equal(t, 1, n.count("snapshot"))

	// Past the window, the kept snapshot no longer serves: one new one.
	cs = append(cs, late)
	for i := range 20 {
		text := fmt.Sprintf("step %02d", i+2)
		require.NoError(t, s.host.Emit(bgtask.Event{Kind: bgtask.SessionBusy, SessionID: a.SessionID, Progress: text + strings.Repeat(".", 500)}))
		last = upTo(cs, `"progress":"`+text)
	}
	newer := s.openStream(t, "/events", nil)
	defer newer.close()
	e := newer.mustNext(t)
	assert.Equal(t, "snapshot", e.kind)
	assert.Equal(t, last, e.seq())
	assert.Equal(t, 2, n.count("snapshot"))
	assert.Equal(t, int(last-first.seq()), n.count("encoded"))
}

// A page renders at a seq and subscribes from there (?lastEventId=): no
// snapshot when it missed nothing the server holds; the header, sent on a
// reconnect, wins.
func TestAStreamResumesFromTheIdAPageNames(t *testing.T) {
	n := newNotes()
	s := newSvc(t, bgtaskhttp.WithStreamNote(bgtaskhttp.Options{Keepalive: time.Hour}, n.note))
	a := s.running(t, "chat")
	keep := s.openStream(t, "/events", nil) // the feed runs while the page renders
	defer keep.close()
	require.Equal(t, "snapshot", keep.mustNext(t).kind)
	page := s.m.Snapshot()
	at := fmt.Sprintf("%d:%d", page.Epoch, page.Seq)

	c := s.openStream(t, "/events?lastEventId="+at, nil)
	assert.Equal(t, "resumed", c.mustNext(t).comment)
	require.NoError(t, s.host.Emit(bgtask.Event{Kind: bgtask.SessionBusy, SessionID: a.SessionID, Progress: "later"}))
	e := c.mustNext(t)
	assert.Equal(t, "change", e.kind)
	assert.Equal(t, page.Seq+1, e.seq())
	c.close()

	missed := s.openStream(t, "/events?lastEventId="+at, nil) // it missed one change, still held
	e = missed.mustNext(t)
	assert.Equal(t, "resumed", e.comment)
	e = missed.mustNext(t)
	assert.Equal(t, page.Seq+1, e.seq(), "the change it missed")
	missed.close()

	for _, id := range []string{"1:0", "nonsense", fmt.Sprintf("%d:%d", page.Epoch, page.Seq+1000)} {
		other := s.openStream(t, "/events?lastEventId="+id, nil)
		assert.Equal(t, "snapshot", other.mustNext(t).kind, id)
		other.close()
	}
	header := s.openStream(t, "/events?lastEventId=1:0", map[string]string{"Last-Event-ID": at})
	assert.Equal(t, "resumed", header.mustNext(t).comment, "the header wins")
	header.close()
	assert.Equal(t, 1, n.count("snapshot"), "the kept one serves those that could not resume")
}

// No more than MaxStreams at once; one that left makes room.
func TestStreamsAreCapped(t *testing.T) {
	n := newNotes()
	s := newSvc(t, bgtaskhttp.WithStreamNote(bgtaskhttp.Options{MaxStreams: 2}, n.note))
	a := s.openStream(t, "/events", nil)
	b := s.openStream(t, "/events", nil)
	defer b.close()
	_, err := s.tryStream("/events", nil)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "503")
	assert.Contains(t, err.Error(), "too_many_streams")
	a.close()
	require.NoError(t, n.await(s.ctx, "left", 1))
	c := s.openStream(t, "/events", nil)
	c.close()
}

// A client further behind than the window is told it lagged, and let go.
func TestAStreamFurtherBehindThanTheWindowIsToldItLagged(t *testing.T) {
	n := newNotes()
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	n.hold = func(event string) {
		if event == "flushed" {
			once.Do(func() { // the client's handler stops after its snapshot
				close(held)
				<-release
			})
		}
	}
	s := newSvc(t, bgtaskhttp.WithStreamNote(bgtaskhttp.Options{StreamBuffer: 4 << 10}, n.note))
	a := s.running(t, "chat")
	c := s.openStream(t, "/events", nil)
	defer c.close()
	<-held
	n.mu.Lock()
	before := n.counts["changed"]
	n.mu.Unlock()
	for i := range 20 {
		require.NoError(t, s.host.Emit(bgtask.Event{Kind: bgtask.SessionBusy, SessionID: a.SessionID, Progress: fmt.Sprint(i, strings.Repeat(".", 500))}))
	}
	// The feed took all twenty into its window (and so past it) before
	// the client reads on: else it could read the first ones in time.
	require.NoError(t, n.await(s.ctx, "changed", before+20))
	close(release)
	assert.Equal(t, "snapshot", c.mustNext(t).kind)
	assert.Equal(t, "lagged", c.mustNext(t).kind)
	_, err := c.next()
	assert.ErrorIs(t, err, io.EOF, "the stream ends")
}

// At Shutdown the streams end, and a new one is refused.
func TestShutdownEndsTheStreams(t *testing.T) {
	n := newNotes()
	s := newSvc(t, bgtaskhttp.WithStreamNote(bgtaskhttp.Options{}, n.note))
	c := s.openStream(t, "/events", nil)
	defer c.close()
	assert.Equal(t, "snapshot", c.mustNext(t).kind)
	require.NoError(t, s.m.Shutdown(s.ctx))
	_, err := c.next()
	assert.ErrorIs(t, err, io.EOF)
	require.NoError(t, n.await(s.ctx, "left", 1))
	_, err = s.tryStream("/events", nil)
	assert.ErrorContains(t, err, "shutdown")
}

// Once every client left, nothing of the streams runs: the last to leave
// waited for the feed to end.
//
// "ended" is counted once the feed's hold returns, just before the feed
// closes its done channel; so a last client that waited for the feed told
// "left" after it, whatever the scheduler does. (A goroutine's exit itself
// is seen by no channel: the feed's goroutine may still be returning from
// run when the last "left" is told, so the test does not look for it in
// the stacks; goleak's retries see it gone.)
func TestNothingRunsOnceTheClientsLeft(t *testing.T) {
	n := newNotes()
	n.hold = func(event string) {
		if event == "ended" { // a feed slow to end: a last client that did not wait for it tells "left" first
			tm := time.NewTimer(100 * time.Millisecond)
			<-tm.C
		}
	}
	s := newSvc(t, bgtaskhttp.WithStreamNote(bgtaskhttp.Options{}, n.note))
	s.running(t, "chat")
	_, err := s.c.Snapshot(s.ctx) // the client's idle connection is not the streams'
	require.NoError(t, err)
	base := goleak.IgnoreCurrent()
	for range 2 {
		var cs []*sse
		for range 5 {
			c := s.openStream(t, "/events", nil)
			assert.Equal(t, "snapshot", c.mustNext(t).kind)
			cs = append(cs, c)
		}
		for _, c := range cs {
			c.close()
		}
		require.NoError(t, n.await(s.ctx, "left", 5))
		assert.Equal(t, 1, n.count("ended"), "the last to leave joined the feed")
		s.srv.Client().CloseIdleConnections()
		goleak.VerifyNone(t, base)
		n = newNotesFrom(n)
	}
}

// newNotesFrom starts the counts again, for the same Handler.
func newNotesFrom(n *notes) *notes {
	n.mu.Lock()
	defer n.mu.Unlock()
	clear(n.counts)
	return n
}

// Never-reading clients: each costs the server a bounded amount of memory
// whatever the snapshot's size and the changes meanwhile (both are encoded
// once, for all), and each is dropped once a write waited
// StreamWriteTimeout.
func TestNeverReadingStreamsAreDroppedAndCostLittle(t *testing.T) {
	const (
		tasks    = 3000
		clients  = 100
		perConn  = 64 << 10 // the bound the README states (~32 KB), with room
		promptSz = 3 << 10  // so the snapshot (~10 MB) is more than the kernel takes
		changes  = 300
	)
	host := bgtasktest.NewHost()
	m := testkit.MustOpen(host, bgtask.WithIDs(bgtask.SequentialIDs()))
	host.Attach(m)
	defer func() { assert.NoError(t, m.Shutdown(context.Background())) }()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	prompt := strings.Repeat("p", promptSz)
	var ids, sessions []string
	for range tasks {
		task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Prompt: prompt, Models: []bgtask.Model{{ID: "m"}}})
		require.NoError(t, err)
		ids = append(ids, task.ID)
	}
	for _, id := range ids { // a quiet Manager, so that what grows is the streams'
		task, err := bgtasktest.WaitStatus(ctx, m, id, bgtask.StatusRunning)
		require.NoError(t, err)
		sessions = append(sessions, task.SessionID)
	}
	snapshotSize := len(mustJSON(t, m.Snapshot()))

	// serve serves m to n never-reading clients, and returns when each
	// began its first write, and a channel told of each connection closed.
	serve := func(n int, o bgtaskhttp.Options) (*notes, <-chan time.Time) {
		notes := newNotes()
		closed := make(chan time.Time, n)
		srv := httptest.NewUnstartedServer(bgtaskhttp.Handler(m, bgtaskhttp.WithStreamNote(o, notes.note)))
		srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
			if s == http.StateClosed {
				closed <- time.Now()
			}
		}
		srv.Start()
		t.Cleanup(srv.Close)
		for range n {
			c, err := net.Dial("tcp", srv.Listener.Addr().String())
			require.NoError(t, err)
			t.Cleanup(func() { c.Close() })
			_, err = io.WriteString(c, "GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n") // and never reads
			require.NoError(t, err)
		}
		require.NoError(t, notes.await(ctx, "writing", n))
		return notes, closed
	}

	// What they cost, while they are connected: the snapshot once, and a
	// bounded amount a client; then the changes meanwhile, once.
	before := memInUse()
	notes, _ := serve(clients, bgtaskhttp.Options{MaxStreams: clients, StreamWriteTimeout: time.Minute})
	connected := memInUse()
	grew := int64(connected) - int64(before)
	shared := snapshotSize + 4*1024*int(unsafe.Sizeof(bgtask.Change{})) // the snapshot, and the subscription's buffer
	t.Logf("%d never-reading clients of a %.1f MB snapshot: the server grew %.1f MB, %.1f KB a client beyond the %.1f MB the streams share",
		clients, float64(snapshotSize)/1e6, float64(grew)/1e6, float64(grew-int64(shared))/clients/1e3, float64(shared)/1e6)
	assert.Less(t, grew, int64(shared+clients*perConn), "one snapshot, and a bounded cost a client")
	assert.Equal(t, 1, notes.count("snapshot"), "encoded once")
	for i := range changes {
		require.NoError(t, host.Emit(bgtask.Event{Kind: bgtask.SessionBusy, SessionID: sessions[i], Progress: "step"}))
	}
	require.NoError(t, notes.await(ctx, "changed", 2*changes)) // progress and activity
	assert.Zero(t, notes.count("encoded"), "none is encoded for clients that take nothing")
	grew = int64(memInUse()) - int64(connected)
	t.Logf("then %d changes: the server grew %.1f MB, %.1f KB a change", 2*changes, float64(grew)/1e6, float64(grew)/(2*changes)/1e3)
	assert.Less(t, grew, int64(2*changes*4<<10), "the changes are kept once, not once a client")

	// When they are dropped.
	const timeout = 300 * time.Millisecond
	_, closed := serve(10, bgtaskhttp.Options{StreamWriteTimeout: timeout})
	writing := time.Now()
	for range 10 {
		select {
		case <-closed:
		case <-ctx.Done():
			t.Fatal("a never-reading client was not dropped")
		}
	}
	took := time.Since(writing)
	t.Logf("dropped within %v of their first write (StreamWriteTimeout %v)", took.Round(time.Millisecond), timeout)
	assert.Less(t, took, timeout+time.Second, "dropped at the write timeout")
}

func mustJSON(t *testing.T, v any) []byte {
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return b
}

// memInUse is the live heap and the goroutine stacks, after two GCs (the
// second frees what sync.Pools kept, such as encoding/json's buffers).
func memInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc + ms.StackInuse
}

var _ = errors.New

// A server's ReadTimeout and WriteTimeout do not end a stream: each write
// has its own deadline.
func TestAStreamOutlivesTheServersTimeouts(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{Keepalive: 10 * time.Millisecond})
	srv := httptest.NewUnstartedServer(bgtaskhttp.Handler(s.m, bgtaskhttp.Options{Keepalive: 10 * time.Millisecond}))
	srv.Config.ReadTimeout, srv.Config.WriteTimeout = 50*time.Millisecond, 50*time.Millisecond
	srv.Start()
	defer srv.Close()
	ctx, cancel := context.WithCancel(s.ctx)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/events", nil)
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	c := &sse{resp: resp, rd: bufio.NewReader(resp.Body), stop: cancel}
	began := time.Now()
	for time.Since(began) < 300*time.Millisecond { // six times the server's timeouts
		_, err := c.next()
		require.NoError(t, err, "after %v", time.Since(began))
	}
}

// Each change says the status its task had ("" when new to the stream)
// and the task at the top of its tree, so a page can tell whether it
// shows it, and keep its counts, without asking the server.
func TestAChangeSaysWhatItsTaskWasAndItsTop(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	root := s.launchUnder(t, "chat", "root", nil)
	kid := s.launchUnder(t, root.SessionID, "kid", nil)
	st := s.openStream(t, "/events", nil)
	defer st.close()
	require.Equal(t, "snapshot", st.mustNext(t).kind)

	grandkid := s.launchUnder(t, kid.SessionID, "grandkid", nil)
	s.complete(t, grandkid)
	s.complete(t, kid)
	type said struct {
		Task struct {
			ID     string        `json:"id"`
			Status bgtask.Status `json:"status"`
		} `json:"task"`
		Was bgtask.Status `json:"was"`
		Top string        `json:"top"`
	}
	var got []said
	for len(got) == 0 || got[len(got)-1].Task.ID != kid.ID || got[len(got)-1].Task.Status != bgtask.StatusCompleted {
		e := st.mustNext(t)
		if e.kind != "change" {
			continue
		}
		var c said
		require.NoError(t, json.Unmarshal([]byte(e.data), &c))
		got = append(got, c)
	}
	first := got[0]
	assert.Equal(t, grandkid.ID, first.Task.ID)
	assert.Empty(t, first.Was, "new to the stream")
	for _, c := range got {
		assert.Equal(t, root.ID, c.Top, "%s's top is the root", c.Task.ID)
		if c.Task.ID == grandkid.ID && c.Task.Status == bgtask.StatusCompleted {
			assert.Equal(t, bgtask.StatusRunning, c.Was)
		}
	}
	last := got[len(got)-1]
	assert.Equal(t, bgtask.StatusRunning, last.Was, "the kid was running before it completed")
}
