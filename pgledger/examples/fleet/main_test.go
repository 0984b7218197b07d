package main

import (
	"bytes"
	"fmt"
	"strings"
	"testing"

	"github.com/bgtask/bgtask/pgledger/internal/fleetdemo"
	"github.com/bgtask/bgtask/pgledger/internal/pgtest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var url string

// TestMain runs a worker when the demo re-runs this binary as one;
// otherwise the tests, on a throwaway server.
func TestMain(m *testing.M) {
	if fleetdemo.IsWorker() {
		fleetdemo.WorkerMain()
	}
	pgtest.Main(m, "fleet", &url)
}

// With BGTASK_PG_URL naming a database, the demo plays in it: it makes
// and drops none.
func TestTheDemoPlaysInTheDatabaseTheURLNames(t *testing.T) {
	t.Setenv(pgtest.EnvURL, url)
	srv, err := server()
	require.NoError(t, err)
	defer srv.Stop()
	assert.Equal(t, url, srv.URL)
}

func TestTheFleetDemoKeepsEveryPromise(t *testing.T) {
	var out bytes.Buffer
	require.NoError(t, demo(url, &out), out.String())
	assert.Contains(t, out.String(), "a branch of w0 → w1 → w2 closed from w2: 3 runs stopped")
	assert.Regexp(t, `17 tasks: 9 completed with their answers \(3 of them finished by another process after the kill\), 3 cancelled by the closure, 2 by their tree's spent budget, [01] interrupted \(a barrier whose start the kill cut\), [23] still running \(the barriers, never answered: `, out.String())
	var interrupted, live int
	line := out.String()[strings.Index(out.String(), "spent budget, "):]
	_, err := fmt.Sscanf(line, "spent budget, %d interrupted (a barrier whose start the kill cut), %d still running", &interrupted, &live)
	require.NoError(t, err)
	assert.Equal(t, 17, 9+3+2+interrupted+live, "the parts add up to the whole")
	assert.Contains(t, out.String(), "every final summary and all_complete delivered once")
}
