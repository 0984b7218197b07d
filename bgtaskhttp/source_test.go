package bgtaskhttp_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"regexp"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// aFleet is a Source of several processes: a Manager's tasks, with
// processes, whose actions fail as a fleet's do when the owner is gone.
type aFleet struct {
	*bgtask.Manager
	procs []bgtaskhttp.Process
	err   error // of Processes
}

func (f aFleet) Processes(context.Context) ([]bgtaskhttp.Process, error) { return f.procs, f.err }

func (f aFleet) Stop(context.Context, bgtask.Target) (bgtask.ClosureReport, error) {
	return bgtask.ClosureReport{}, ownerGone{}
}

// ownerGone is an error that names its own code and status, as a
// fleet's does.
type ownerGone struct{}

func (ownerGone) Error() string { return "the process that owns the task is gone" }
func (ownerGone) Code() string  { return "owner_gone" }
func (ownerGone) Status() int   { return http.StatusServiceUnavailable }

// A Source's own coded error is its code and status on the wire; a
// Fleet's processes are served, and listed on the page, gone ones first.
func TestAFleetsProcessesAndItsOwnErrors(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	task := s.running(t, "chat")
	expires := time.Now().Add(time.Minute).UTC().Truncate(time.Second)
	f := aFleet{Manager: s.m, procs: []bgtaskhttp.Process{
		{Member: "w0", Holder: "host-a:1", Expires: expires, Live: true, Running: 1},
		{Member: "w1", Holder: "host-b:2", Expires: expires.Add(-time.Hour), Running: 3},
		{Member: "w2", Holder: "host-c:3", Expires: expires.Add(-time.Hour), Idle: true},
	}}
	srv := httptest.NewServer(bgtaskhttp.Handler(f, bgtaskhttp.Options{}))
	defer srv.Close()
	c := &bgtaskhttp.Client{Base: srv.URL}

	_, err := c.Stop(s.ctx, bgtask.Target{Task: task.ID})
	var he *bgtaskhttp.Error
	require.ErrorAs(t, err, &he)
	assert.Equal(t, http.StatusServiceUnavailable, he.Status)
	assert.Equal(t, "owner_gone", he.Code)
	assert.Contains(t, he.Message, "is gone")

	v, err := c.Processes(s.ctx)
	require.NoError(t, err)
	assert.True(t, v.Fleet)
	assert.Equal(t, f.procs, v.Processes)

	_, body, _ := fetchFrom(t, s.ctx, srv, "/")
	rows := regexp.MustCompile(`<tr class="process[^"]*" data-member="[^"]*">.*?</tr>`).FindAllString(body, -1)
	require.Len(t, rows, 3)
	assert.Contains(t, rows[0], `gone" data-member="w1"`, "the gone process first")
	assert.Contains(t, rows[0], "its tasks wait for a takeover")
	assert.Contains(t, rows[1], `live" data-member="w0"`)
	assert.Contains(t, rows[2], `idle" data-member="w2"`)

	// One Manager is no fleet.
	v, err = s.c.Processes(s.ctx)
	require.NoError(t, err)
	assert.False(t, v.Fleet)
	assert.Empty(t, v.Processes)
	_, body, _ = s.get(t, "/")
	assert.NotContains(t, body, `id="processes"`)

	// Processes that cannot be read: the page says why; the route answers
	// the error.
	f.err = errors.New("the database is away")
	srv2 := httptest.NewServer(bgtaskhttp.Handler(f, bgtaskhttp.Options{}))
	defer srv2.Close()
	_, body, _ = fetchFrom(t, s.ctx, srv2, "/")
	assert.Contains(t, body, "the database is away")
	_, err = (&bgtaskhttp.Client{Base: srv2.URL}).Processes(s.ctx)
	require.ErrorAs(t, err, &he)
	assert.Equal(t, http.StatusInternalServerError, he.Status)
}

// A nil Source is refused at once, typed or not.
func TestANilSourceIsRefused(t *testing.T) {
	assert.PanicsWithValue(t, "bgtaskhttp: Handler of a nil Source", func() { bgtaskhttp.Handler(nil, bgtaskhttp.Options{}) })
	var m *bgtask.Manager
	assert.PanicsWithValue(t, "bgtaskhttp: Handler of a nil Source", func() { bgtaskhttp.Handler(m, bgtaskhttp.Options{}) })
	assert.PanicsWithValue(t, "bgtaskhttp: View of a nil Source", func() { bgtaskhttp.View(m, bgtaskhttp.Options{}) })
}

// An extend made over HTTP records who asked: the actor Authorize named.
func TestAnExtendRecordsWhoAsked(t *testing.T) {
	s := newSvcOf(t, bgtaskhttp.Options{Authorize: func(*http.Request) (string, error) { return "ops@example\n", nil }}, true)
	task := s.running(t, "chat")
	n, err := s.c.Extend(s.ctx, task.ID, "one more thing")
	require.NoError(t, err)
	got, err := s.m.Task(task.ID)
	require.NoError(t, err)
	require.Len(t, got.Invocations, n)
	assert.Equal(t, "ops@example", got.Invocations[n-1].Actor)
}
