package bgtaskhttp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/mirror"
)

// streamOf is a service whose n-th /events connection (from 1) is served
// by conn(n, w, r); each connection begins with a snapshot of ids.
func streamOf(t *testing.T, conn func(n int, w http.ResponseWriter, r *http.Request)) *httptest.Server {
	t.Helper()
	var conns atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		conn(int(conns.Add(1)), w, r)
	}))
	t.Cleanup(func() {
		srv.CloseClientConnections()
		srv.Close()
	})
	return srv
}

// snapshot writes a snapshot event of tasks with these ids, at seq.
func snapshot(t *testing.T, w http.ResponseWriter, seq uint64, ids ...string) {
	s := bgtask.Snapshot{Epoch: 1, Seq: seq}
	for _, id := range ids {
		s.Tasks = append(s.Tasks, bgtask.Task{ID: id, Status: bgtask.StatusRunning, Revision: 1})
	}
	b, err := json.Marshal(s)
	assert.NoError(t, err) // on the handler's goroutine: no FailNow
	fmt.Fprintf(w, "id: 1-%d\nevent: snapshot\ndata: %s\n\n", seq, b)
	w.(http.Flusher).Flush()
}

// reconnects is a Client.Reconnect that hands each call to a channel (as
// many as it holds) and lets Follow go on, or ends it once stop is closed.
type reconnects struct {
	errs chan error
	stop chan struct{}
}

func (r *reconnects) hook(err error, wait time.Duration) error {
	select {
	case r.errs <- fmt.Errorf("%w (next try in %s)", err, wait):
	default: // more than the test looks at
	}
	select {
	case <-r.stop:
		return err
	default:
		return nil
	}
}

// sent returns what ch holds now, failing if it holds nothing: what the
// test waited for was sent before.
func sent[T any](t *testing.T, ch chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	default:
		t.Fatal("nothing was sent")
		panic("unreachable")
	}
}

func TestClientFollowSaysWhyItReconnectsAStreamTheServiceEnded(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	lastIDs := make(chan string, 2)
	srv := streamOf(t, func(n int, w http.ResponseWriter, r *http.Request) {
		lastIDs <- r.Header.Get("Last-Event-ID")
		if n == 1 {
			snapshot(t, w, 1, "a")
			return // the service ends the stream
		}
		snapshot(t, w, 2, "a", "b")
		<-r.Context().Done()
	})
	rc := &reconnects{errs: make(chan error, 4), stop: make(chan struct{})}
	c := &bgtaskhttp.Client{Base: srv.URL, Reconnect: rc.hook}
	var mir mirror.Mirror
	fctx, stop := context.WithCancel(ctx)
	followed := make(chan error, 1)
	go func() { followed <- c.Follow(fctx, &mir, nil) }()

	require.NoError(t, mir.Wait(ctx, func(tasks []bgtask.Task) bool { return len(tasks) == 2 }))
	err := sent(t, rc.errs)
	assert.ErrorContains(t, err, "the service ended the stream")
	assert.ErrorContains(t, err, "next try in 100ms")
	assert.Equal(t, "", sent(t, lastIDs))
	assert.Equal(t, "1-1", sent(t, lastIDs), "it resumed from the last event it saw")
	stop()
	assert.ErrorIs(t, <-followed, context.Canceled)
	assert.Empty(t, rc.errs, "no reconnect after the second stream")
}

func TestClientFollowEndsWithTheErrorReconnectReturns(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close()) // nothing listens there now: connections are refused
	rc := &reconnects{errs: make(chan error, 1), stop: make(chan struct{})}
	close(rc.stop)
	c := &bgtaskhttp.Client{Base: "http://" + addr, Reconnect: rc.hook}
	var mir mirror.Mirror
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = c.Follow(ctx, &mir, nil)
	assert.ErrorContains(t, err, "connection refused")
	assert.ErrorContains(t, sent(t, rc.errs), "connection refused")
}

func TestClientFollowReconnectsAStreamThatWentSilent(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	srv := streamOf(t, func(n int, w http.ResponseWriter, r *http.Request) {
		snapshot(t, w, uint64(n), "a")
		<-r.Context().Done() // then nothing, not even a keepalive
	})
	rc := &reconnects{errs: make(chan error, 1), stop: make(chan struct{})}
	close(rc.stop)
	c := &bgtaskhttp.Client{Base: srv.URL, Reconnect: rc.hook, IdleTimeout: 50 * time.Millisecond}
	var mir mirror.Mirror
	ready := make(chan struct{})
	err := c.Follow(ctx, &mir, ready)
	assert.ErrorContains(t, err, "sent nothing for longer than Client.IdleTimeout")
	sent(t, ready) // the snapshot came before the silence
	assert.ErrorContains(t, sent(t, rc.errs), "sent nothing")
}

func TestClientFollowSaysWhenTheAddressIsNoEventStream(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		_, _ = w.Write([]byte("<html>some other server</html>"))
	}))
	defer srv.Close()
	rc := &reconnects{errs: make(chan error, 1), stop: make(chan struct{})}
	close(rc.stop)
	err := (&bgtaskhttp.Client{Base: srv.URL, Reconnect: rc.hook}).Follow(context.Background(), &mirror.Mirror{}, nil)
	assert.ErrorContains(t, err, `did not answer as a bgtask server (GET /events: 200 OK, Content-Type text/html): not an event stream: "some other server"`)
	assert.ErrorIs(t, sent(t, rc.errs), err, "Reconnect was told why")
}

func TestClientFollowWaitsLongerWhileEachStreamEndsAtOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	srv := streamOf(t, func(n int, w http.ResponseWriter, r *http.Request) {
		switch n % 3 { // one line, then the stream ends: it received something, but it does not work
		case 1:
			snapshot(t, w, uint64(n), "a")
		case 2:
			_, _ = w.Write([]byte(": resumed\n\n"))
		default:
			_, _ = w.Write([]byte(": keepalive\n\n"))
		}
	})
	var waits []time.Duration
	errEnough := errors.New("enough")
	c := &bgtaskhttp.Client{Base: srv.URL, Reconnect: func(err error, wait time.Duration) error {
		assert.ErrorContains(t, err, "the service ended the stream")
		if waits = append(waits, wait); len(waits) == 4 {
			return errEnough
		}
		return nil
	}}
	require.ErrorIs(t, c.Follow(ctx, &mirror.Mirror{}, nil), errEnough)
	assert.Equal(t, []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond, 800 * time.Millisecond}, waits,
		"each try waits longer: a line received is no proof the stream works")
}

func TestClientFollowWaitsShortAgainAfterAStreamThatLasted(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	srv := streamOf(t, func(n int, w http.ResponseWriter, r *http.Request) {
		snapshot(t, w, uint64(n), "a")
		if n == 3 {
			// it lasts longer than the 400ms Follow is at by now
			select {
			case <-time.After(600 * time.Millisecond):
			case <-r.Context().Done():
			}
		}
	})
	var waits []time.Duration
	errEnough := errors.New("enough")
	c := &bgtaskhttp.Client{Base: srv.URL, Reconnect: func(err error, wait time.Duration) error {
		if waits = append(waits, wait); len(waits) == 4 {
			return errEnough
		}
		return nil
	}}
	require.ErrorIs(t, c.Follow(ctx, &mirror.Mirror{}, nil), errEnough)
	assert.Equal(t, []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 100 * time.Millisecond, 200 * time.Millisecond}, waits,
		"a stream that lasted longer than the wait starts the waits again from 100ms")
}
