package bgtaskhttp_test

import (
	"context"
	"encoding/xml"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/internal/testkit"
)

// throttled is a provider's 429 that asks to be tried again in a minute.
type throttled struct{}

func (throttled) Error() string             { return "429 Too Many Requests" }
func (throttled) RetryAfter() time.Duration { return time.Minute }

// healthRows reads the page's model health: each row's key, state and
// whether it offers a reset.
func healthRows(t *testing.T, page string) map[string][2]string {
	t.Helper()
	d := xml.NewDecoder(strings.NewReader(page))
	d.Strict, d.AutoClose, d.Entity = false, xml.HTMLAutoClose, xml.HTMLEntity
	rows := map[string][2]string{}
	key := ""
	for {
		tok, err := d.Token()
		if errors.Is(err, io.EOF) {
			return rows
		}
		require.NoError(t, err)
		e, ok := tok.(xml.StartElement)
		if !ok {
			continue
		}
		attr := func(name string) string {
			for _, a := range e.Attr {
				if a.Name.Local == name {
					return a.Value
				}
			}
			return ""
		}
		switch {
		case e.Name.Local == "tr" && attr("data-key") != "":
			key = attr("data-key")
			rows[key] = [2]string{strings.TrimPrefix(attr("class"), "health "), ""}
		case e.Name.Local == "button" && attr("data-action") == "reset" && key != "":
			r := rows[key]
			r[1] = attr("data-id")
			rows[key] = r
		}
	}
}

// healthSvc serves a Manager whose model "a/one" answers 429 (health
// kept, unless off) after one task ran on it.
func healthSvc(t *testing.T, kept bool, o bgtaskhttp.Options) (*bgtask.Manager, *httptest.Server, *bgtaskhttp.Client) {
	t.Helper()
	host := bgtask.NewFuncHost(func(_ context.Context, run bgtask.Run) (string, error) {
		if run.Model.ID == "one" {
			return "", throttled{}
		}
		return "ok", nil
	})
	var opts []bgtask.Option
	if kept {
		opts = append(opts, bgtask.WithHealth(bgtask.HealthPolicy{}))
	}
	m := testkit.MustOpen(host, opts...)
	t.Cleanup(func() { _ = m.Shutdown(context.Background()) })
	srv := httptest.NewServer(bgtaskhttp.Handler(m, o))
	t.Cleanup(srv.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Models: []bgtask.Model{{Provider: "a", ID: "one"}, {Provider: "b", ID: "two"}}})
	require.NoError(t, err)
	done, err := m.Wait(ctx, task.ID)
	require.NoError(t, err)
	require.Equal(t, bgtask.StatusCompleted, done.Status)
	return m, srv, &bgtaskhttp.Client{Base: srv.URL, HTTP: srv.Client()}
}

// The model health is served (GET /health), shown on the page with a
// reset for what cools, and reset by hand (POST /health/reset), with
// the root's errors on the wire.
func TestHealthIsServedShownAndReset(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m, srv, c := healthSvc(t, true, bgtaskhttp.Options{})

	v, err := c.Health(ctx)
	require.NoError(t, err)
	require.True(t, v.Kept)
	require.Len(t, v.Health, 1)
	assert.Equal(t, "a/one", v.Health[0].Key())
	assert.Equal(t, bgtask.HealthCooling, v.Health[0].State)
	assert.Equal(t, "rate_limited", v.Health[0].Why)

	code, body := fetch(t, srv, "/")
	require.Equal(t, http.StatusOK, code)
	assert.Equal(t, map[string][2]string{"a/one": {"cooling", "a/one"}}, healthRows(t, body))
	assert.Contains(t, body, "left)", "how long the cooldown still lasts")
	_, filtered := fetch(t, srv, "/?q=nothing")
	assert.Empty(t, healthRows(t, filtered), "the health is on the first page of all tasks only")

	require.NoError(t, c.ResetHealth(ctx, "a/one"))
	h := m.Health()
	require.Len(t, h, 1)
	assert.Equal(t, bgtask.HealthHealthy, h[0].State)
	_, body = fetch(t, srv, "/")
	assert.Equal(t, map[string][2]string{"a/one": {"healthy", ""}}, healthRows(t, body), "nothing to reset")

	err = c.ResetHealth(ctx, "a/one")
	require.ErrorIs(t, err, bgtask.ErrNotCooling)
	var e *bgtaskhttp.Error
	require.ErrorAs(t, err, &e)
	assert.Equal(t, http.StatusConflict, e.Status)
	require.ErrorIs(t, c.ResetHealth(ctx, " "), bgtask.ErrInvalidArgument)
}

// Without health kept, GET /health says so, a reset is refused as such,
// and the page shows no health.
func TestHealthNotKept(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, srv, c := healthSvc(t, false, bgtaskhttp.Options{})
	v, err := c.Health(ctx)
	require.NoError(t, err)
	assert.False(t, v.Kept)
	assert.Empty(t, v.Health)
	_, body := fetch(t, srv, "/")
	assert.NotContains(t, body, `id="health"`)
	require.ErrorIs(t, c.ResetHealth(ctx, "a/one"), errors.ErrUnsupported)
}

// Read-only: the page shows the health without a reset, and a reset is
// refused.
func TestHealthReadOnly(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m, srv, c := healthSvc(t, true, bgtaskhttp.Options{ReadOnly: true})
	_, body := fetch(t, srv, "/")
	assert.Equal(t, map[string][2]string{"a/one": {"cooling", ""}}, healthRows(t, body))
	var e *bgtaskhttp.Error
	require.ErrorAs(t, c.ResetHealth(ctx, "a/one"), &e)
	assert.Equal(t, "read_only", e.Code)
	assert.Equal(t, bgtask.HealthCooling, m.Health()[0].State, "not reset")
}
