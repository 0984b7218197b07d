package bgtaskhttp_test

import (
	"net/http"
	"net/url"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
)

// A request the user typed (Sec-Fetch-Site: none: a bookmark, the address
// bar, not a script) may act, as the Handler's doc and sameOrigin's say:
// "its Sec-Fetch-Site, if sent, is same-origin (or none: typed, not
// scripted)".
func TestATypedRequestMayAct(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	a := s.running(t, "chat")
	ans := s.send(t, http.MethodPost, "/tasks/"+a.ID+"/cancel", "", map[string]string{"Sec-Fetch-Site": "none"}, "")
	code, errCode := ans.status, ans.code
	require.Equal(t, http.StatusOK, code, "refused: %s", errCode)
	now, err := s.m.Task(a.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCancelled, now.Status)
}

// An origin is its scheme, host and port: a page served on another port
// of the same host is another origin, and cannot act (Handler's doc: "an
// action from a browser page of another origin ... is refused").
func TestAPageOnAnotherPortCannotAct(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	a := s.running(t, "chat")
	u, err := url.Parse(s.srv.URL)
	require.NoError(t, err)
	other := "1"
	if u.Port() == other {
		other = "2"
	}
	for _, origin := range []string{
		"http://" + u.Hostname() + ":" + other, // the same host, another port
		"http://" + u.Hostname(),               // the same host, the default port
		"http://localhost:" + u.Port(),         // another host name, the same port
	} {
		ans := s.send(t, http.MethodPost, "/tasks/"+a.ID+"/cancel", "", map[string]string{"Origin": origin}, "")
		code, errCode := ans.status, ans.code
		assert.Equal(t, http.StatusForbidden, code, origin)
		assert.Equal(t, "cross_origin", errCode, origin)
	}
	now, err := s.m.Task(a.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusRunning, now.Status, "not cancelled")
	code := s.send(t, http.MethodPost, "/tasks/"+a.ID+"/cancel", "", map[string]string{"Origin": s.srv.URL}, "").status
	assert.Equal(t, http.StatusOK, code, "the page's own origin")
}

// Read-only turns off every action, the health reset too (Options.ReadOnly:
// "turns the actions ... off"), and the page offers none of them (its
// actions are offered "unless o.ReadOnly"); without it, the page offers
// a live task's.
func TestReadOnlyRefusesTheHealthResetAndThePageOffersNoAction(t *testing.T) {
	for _, ro := range []bool{false, true} {
		s := newSvc(t, bgtaskhttp.Options{ReadOnly: ro})
		s.running(t, "chat")
		code, page, _ := s.get(t, "/")
		require.Equal(t, http.StatusOK, code)
		if !ro {
			assert.Contains(t, string(page), `data-action="cancel"`, "the page offers a live task's cancel")
			continue
		}
		assert.NotContains(t, string(page), `data-action=`, "a read-only page offers no action")
		ans := s.send(t, http.MethodPost, "/health/reset", "", map[string]string{"Content-Type": "application/json"}, "")
		code, errCode := ans.status, ans.code
		assert.Equal(t, http.StatusForbidden, code)
		assert.Equal(t, "read_only", errCode)
	}
}
