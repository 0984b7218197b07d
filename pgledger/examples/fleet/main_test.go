package main

import (
	"bytes"
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

func TestTheFleetDemoKeepsEveryPromise(t *testing.T) {
	var out bytes.Buffer
	require.NoError(t, demo(url, &out), out.String())
	assert.Contains(t, out.String(), "a branch of w0 → w1 → w2 closed from w2: 3 runs stopped")
	assert.Contains(t, out.String(), "13 tasks: 9 completed with their answers (3 of them finished by another process after the kill), 3 cancelled by the closure")
	assert.Contains(t, out.String(), "every final summary and all_complete delivered once")
}
