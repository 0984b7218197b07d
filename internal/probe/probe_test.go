package probe_test

import (
	"context"
	"testing"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/probe"
	"github.com/bgtask/bgtask/internal/testkit"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type idleHost struct{}

func (idleHost) StartSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	return "s-" + req.AttemptID, nil
}
func (idleHost) AbortSession(ctx context.Context, sid string) error { return nil }

func TestTheRootPackageInstallsTheProbes(t *testing.T) {
	require.NotNil(t, probe.Running, "importing bgtask installs the probes")
	require.NotNil(t, probe.Parked)
	m := testkit.MustOpen(idleHost{})
	n, _ := probe.Running(m)
	assert.Zero(t, n)
	p, _ := probe.Parked(m)
	assert.Zero(t, p)
	require.NoError(t, m.Shutdown(context.Background()))
}
