package bgtaskhttp_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/internal/testkit"
)

// pollEvery is how often each poller reads a snapshot.
const pollEvery = time.Second

var fullLoad = flag.Bool("http.load", false, "run the load test at full size: 3,000 tasks, 200 streams, 20 snapshot pollers")

// Under load — tasks ending from several goroutines while many streams
// follow and pollers read snapshots — every stream gets every change, in
// order, and nothing of the streams runs once they left. It reports the
// latency from a task's end to each stream. Run it at full size, without
// -race (which slows it past what the streams keep), with
//
//	go test -run TestUnderLoad -v ./bgtaskhttp/ -args -http.load
func TestUnderLoadEveryStreamGetsEveryChangeInOrder(t *testing.T) {
	const endsPerSecond = 1000
	tasks, streams, pollers, enders := 300, 20, 4, 4
	if *fullLoad {
		tasks, streams, pollers = 3000, 200, 20
	}
	notes := newNotes()
	host := bgtasktest.NewHost()
	m := testkit.MustOpen(host, bgtask.WithIDs(bgtask.SequentialIDs()))
	host.Attach(m)
	defer func() { assert.NoError(t, m.Shutdown(context.Background())) }()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var sessions []string
	for range tasks {
		task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Prompt: "work", Models: []bgtask.Model{{ID: "m"}}})
		require.NoError(t, err)
		sessions = append(sessions, task.ID)
	}
	for i, id := range sessions {
		task, err := bgtasktest.WaitStatus(ctx, m, id, bgtask.StatusRunning)
		require.NoError(t, err)
		sessions[i] = task.SessionID
	}
	srv := httptest.NewServer(bgtaskhttp.Handler(m, bgtaskhttp.WithStreamNote(bgtaskhttp.Options{MaxStreams: streams, Keepalive: 50 * time.Millisecond}, func(e string) {
		if e == "writing" || e == "left" { // only these: the others would make the test the bottleneck
			notes.note(e)
		}
	})))
	defer srv.Close()
	base := goleak.IgnoreCurrent()

	var final atomic.Uint64 // the last seq, once every task ended
	type seen struct {
		at   []int64 // when each task's end arrived
		err  error
		last uint64
	}
	results := make(chan seen, streams)
	var bodies []io.Closer
	defer func() {
		for _, b := range bodies {
			b.Close()
		}
	}()
	for range streams {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/events", nil)
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		bodies = append(bodies, resp.Body)
		go func() {
			s := seen{at: make([]int64, tasks)}
			s.last, s.err = readLoad(resp.Body, s.at, &final)
			results <- s
		}()
	}
	require.NoError(t, notes.await(ctx, "writing", streams))

	stop := make(chan struct{})
	polled := make(chan error, pollers)
	var polls atomic.Int64
	for range pollers {
		go func() { polled <- poll(ctx, srv, stop, &polls) }()
	}

	// The tasks end at a steady rate, from several goroutines.
	ended := make([]atomic.Int64, tasks)
	next := make(chan int)
	done := make(chan error, enders)
	began := time.Now()
	for range enders {
		go func() {
			for i := range next {
				ended[i].Store(time.Now().UnixNano())
				if err := host.Idle(sessions[i], "done"); err != nil {
					done <- err
					for range next {
					}
					return
				}
			}
			done <- nil
		}()
	}
	tick := time.NewTicker(time.Second / endsPerSecond * 10)
	for i := 0; i < tasks; i += 10 {
		<-tick.C
		for k := i; k < min(i+10, tasks); k++ {
			next <- k
		}
	}
	tick.Stop()
	close(next)
	for range enders {
		require.NoError(t, <-done)
	}
	endedIn := time.Since(began)
	final.Store(m.Snapshot().Seq)
	var lat []time.Duration
	for range streams {
		s := <-results
		require.NoError(t, s.err)
		require.Equal(t, final.Load(), s.last)
		for i, at := range s.at {
			require.NotZero(t, at, "task %d's end never arrived", i)
			lat = append(lat, time.Duration(at-ended[i].Load()))
		}
	}
	close(stop)
	for range pollers {
		require.NoError(t, <-polled)
	}
	slices.Sort(lat)
	q := func(p float64) time.Duration { return lat[int(p*float64(len(lat)-1))].Round(time.Millisecond) }
	t.Logf("%d tasks ended (%d a second) in %v, followed by %d streams (%d snapshot polls meanwhile): from a task's end to a stream p50 %v, p99 %v, max %v",
		tasks, endsPerSecond, endedIn.Round(time.Millisecond), streams, polls.Load(), q(0.5), q(0.99), q(1))

	for _, b := range bodies {
		b.Close()
	}
	bodies = nil
	require.NoError(t, notes.await(ctx, "left", streams))
	srv.Client().CloseIdleConnections()
	goleak.VerifyNone(t, base)
}

// readLoad reads a stream: its snapshot, then changes, each the one after
// the last, recording when each task's end arrived, until final's seq.
func readLoad(body io.Reader, at []int64, final *atomic.Uint64) (last uint64, _ error) {
	rd := bufio.NewReaderSize(body, 64<<10)
	first := true
	for {
		line, err := rd.ReadSlice('\n')
		for errors.Is(err, bufio.ErrBufferFull) { // a long data line: only changes are looked at
			_, err = rd.ReadSlice('\n')
			line = nil
		}
		if err != nil {
			return last, err
		}
		switch {
		case bytes.HasPrefix(line, []byte("id: ")):
			_, seq, _ := bytes.Cut(bytes.TrimSpace(line[4:]), []byte(":"))
			n, err := strconv.ParseUint(string(seq), 10, 64)
			if err != nil {
				return last, err
			}
			if !first && n != last+1 {
				return last, fmt.Errorf("change %d after %d", n, last)
			}
			first, last = false, n
		case bytes.HasPrefix(line, []byte("event: lagged")):
			return last, errors.New("lagged")
		case bytes.HasPrefix(line, []byte(`data: {"epoch"`)) && bytes.Contains(line, []byte(`"status":"completed"`)):
			_, id, _ := bytes.Cut(line, []byte(`"task":{"id":"task-`))
			id, _, _ = bytes.Cut(id, []byte(`"`))
			n, err := strconv.Atoi(string(id))
			if err != nil || n < 1 || n > len(at) {
				return last, fmt.Errorf("no task in %.200s", line)
			}
			if at[n-1] == 0 {
				at[n-1] = time.Now().UnixNano()
			}
		}
		if f := final.Load(); f != 0 && last >= f && len(bytes.TrimSpace(line)) == 0 && line != nil { // the end of its event
			return last, nil
		}
	}
}

// poll reads a snapshot every pollEvery until stop.
func poll(ctx context.Context, srv *httptest.Server, stop <-chan struct{}, polls *atomic.Int64) error {
	tick := time.NewTicker(pollEvery)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return nil
		case <-tick.C:
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/snapshot", nil)
		resp, err := srv.Client().Do(req)
		if err != nil {
			return err
		}
		_, err = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK {
			return fmt.Errorf("poll: %d %v", resp.StatusCode, err)
		}
		polls.Add(1)
	}
}
