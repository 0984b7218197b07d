package otelmetrics_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"go.uber.org/goleak"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/testkit"
	"github.com/bgtask/bgtask/otelmetrics"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestAManagersMeasurementsBecomeInstruments(t *testing.T) {
	reader, mt := newMetrics(t)

	m := testkit.MustOpen(bgtask.NewFuncHost(func(ctx context.Context, run bgtask.Run) (string, error) {
		if run.Attempt == 1 {
			return "", errors.New("HTTP 503 overloaded")
		}
		return "ok", nil
	}), bgtask.WithMetrics(mt))
	task, err := m.Launch(context.Background(), bgtask.Spec{ParentSessionID: "chat", Models: []bgtask.Model{{ID: "primary"}, {ID: "backup"}}})
	require.NoError(t, err)
	done, err := m.Wait(context.Background(), task.ID)
	require.NoError(t, err)
	require.NoError(t, m.Shutdown(context.Background()))
	require.Equal(t, bgtask.StatusCompleted, done.Status)

	sums, hists, gauges := collect(t, reader)
	assert.Equal(t, map[string]int64{"": 1}, sums["bgtask.tasks.launched"])
	assert.Equal(t, map[string]int64{"model=primary": 1, "model=backup": 1}, sums["bgtask.attempts.started"])
	assert.Equal(t, map[string]int64{"reason=provider_error": 1}, sums["bgtask.retries"])
	assert.Equal(t, map[string]int64{"state=completed": 1}, sums["bgtask.tasks.ended"], "a clean answer has no reason: none is exported")
	assert.Equal(t, map[string]uint64{"model=primary,status=error": 1, "model=backup,status=completed": 1}, hists["bgtask.attempt.duration"])
	assert.Equal(t, map[string]uint64{"state=completed": 1}, hists["bgtask.task.duration"])
	assert.Equal(t, int64(0), gauges["bgtask.tasks.live"])
}

// collect reads what reader holds: counters and gauges by instrument and
// attribute set, histograms' counts likewise.
func collect(t *testing.T, reader *sdkmetric.ManualReader) (sums map[string]map[string]int64, hists map[string]map[string]uint64, gauges map[string]int64) {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	sums = map[string]map[string]int64{}   // instrument → attribute set → value
	hists = map[string]map[string]uint64{} // instrument → attribute set → count
	gauges = map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, mm := range sm.Metrics {
			switch d := mm.Data.(type) {
			case metricdata.Sum[int64]:
				sums[mm.Name] = map[string]int64{}
				for _, p := range d.DataPoints {
					sums[mm.Name][p.Attributes.Encoded(attribute.DefaultEncoder())] = p.Value
				}
			case metricdata.Histogram[float64]:
				hists[mm.Name] = map[string]uint64{}
				for _, p := range d.DataPoints {
					hists[mm.Name][p.Attributes.Encoded(attribute.DefaultEncoder())] = p.Count
				}
			case metricdata.Gauge[int64]:
				for _, p := range d.DataPoints {
					gauges[mm.Name] = p.Value
				}
			}
		}
	}
	return sums, hists, gauges
}

// Who stopped what, what a closure did and what a restart recovered are
// counters with those facts as attributes.
func TestStopsClosuresAndRecoveriesBecomeInstruments(t *testing.T) {
	reader, mt := newMetrics(t)
	ctx := context.Background()
	running := make(chan string, 4)
	fn := func(ctx context.Context, run bgtask.Run) (string, error) {
		running <- run.SessionID
		<-ctx.Done()
		return "", ctx.Err()
	}
	dir := t.TempDir()
	j, err := bgtask.OpenFileJournal(dir)
	require.NoError(t, err)
	m := testkit.MustOpen(bgtask.NewFuncHost(fn), bgtask.WithMetrics(mt), bgtask.WithJournal(j))
	model := []bgtask.Model{{ID: "m"}}
	cancelled, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Models: model})
	require.NoError(t, err)
	<-running
	crashed := filepath.Join(t.TempDir(), "crashed") // the journal as a crash now would leave it
	require.NoError(t, os.CopyFS(crashed, os.DirFS(dir)))
	require.NoError(t, testkit.StopErr(m.Stop(ctx, bgtask.Target{Task: cancelled.ID})))
	closed, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "tree", Models: model})
	require.NoError(t, err)
	<-running
	_, err = m.Stop(ctx, bgtask.Target{Session: "tree"})
	require.NoError(t, err)
	_, err = m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Models: model})
	require.NoError(t, err)
	<-running
	require.NoError(t, m.Shutdown(ctx)) // interrupts the last
	_, err = m.Wait(ctx, closed.ID)
	require.NoError(t, err)

	j, err = bgtask.OpenFileJournal(dir)
	require.NoError(t, err)
	m, err = bgtask.Open(ctx, bgtask.NewFuncHost(fn), bgtask.WithMetrics(mt), bgtask.WithJournal(j))
	require.NoError(t, err)
	require.NoError(t, m.Shutdown(ctx))
	j, err = bgtask.OpenFileJournal(crashed)
	require.NoError(t, err)
	m, err = bgtask.Open(ctx, bgtask.NewFuncHost(fn), bgtask.WithMetrics(mt), bgtask.WithJournal(j))
	require.NoError(t, err)
	require.NoError(t, m.Shutdown(ctx))

	sums, hists, _ := collect(t, reader)
	assert.Equal(t, map[string]int64{"stop.kind=cancel": 1, "stop.kind=closure": 1, "stop.kind=shutdown": 1}, sums["bgtask.stops.asked"])
	assert.Equal(t, map[string]int64{"state=cancelled": 2, "state=interrupt": 2}, sums["bgtask.tasks.ended"], "a stopped task has no reason")
	assert.Equal(t, map[string]int64{"by=stop_session,stop.kind=closure": 1}, sums["bgtask.closures.begun"])
	assert.Equal(t, map[string]int64{"by=stop_session,outcome=stopped,stop.kind=closure": 1}, sums["bgtask.closures.ended"])
	assert.Equal(t, map[string]int64{"by=stop_session,result=stopped": 1}, sums["bgtask.closure.runs"])
	assert.Equal(t, map[string]uint64{"by=stop_session,outcome=stopped": 1}, hists["bgtask.closure.duration"])
	assert.Equal(t, map[string]int64{"": 2}, sums["bgtask.recoveries"], "the reopenings, not the first opening")
	assert.Equal(t, map[string]uint64{"": 2}, hists["bgtask.recovery.duration"])
	assert.Equal(t, map[string]int64{"outcome=interrupted": 1}, sums["bgtask.recovery.runs"], "the function running at the crash died with it")
}

// Usage becomes token, request and cost counters by model (and provider,
// when the model has one), each zero figure adding nothing; a budget's
// soft threshold and hard limit become crossings, the hard one naming the
// limit it reached.
func TestUsageAndBudgetCrossingsBecomeInstruments(t *testing.T) {
	reader, mt := newMetrics(t)
	ctx := context.Background()
	fn := func(ctx context.Context, run bgtask.Run) (string, error) {
		if run.Model.Provider == "" { // the task without a budget
			if err := run.Usage(bgtask.Usage{InputTokens: 10, OutputTokens: 5, Requests: 1}); err != nil {
				return "", err
			}
			return "ok", nil
		}
		// 1.25 of a 2.00 budget: past its soft threshold (50%).
		if err := run.Usage(bgtask.Usage{InputTokens: 1000, CachedTokens: 200, OutputTokens: 300, Requests: 2, Cost: 1_250_000}); err != nil {
			return "", err
		}
		// 2.25: the hard limit, cost; the budget stops the run.
		if err := run.Usage(bgtask.Usage{InputTokens: 100, OutputTokens: 50, Requests: 1, Cost: bgtask.CostUnit}); err != nil {
			return "", err
		}
		<-ctx.Done()
		return "", ctx.Err()
	}
	m := testkit.MustOpen(bgtask.NewFuncHost(fn), bgtask.WithMetrics(mt))
	spent, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Models: []bgtask.Model{{Provider: "openai", ID: "gpt-5"}},
		Budget: &bgtask.Budget{Cost: 2 * bgtask.CostUnit, SoftPercent: 50}})
	require.NoError(t, err)
	free, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Models: []bgtask.Model{{ID: "router"}}})
	require.NoError(t, err)
	end, err := m.Wait(ctx, spent.ID)
	require.NoError(t, err)
	require.NotNil(t, end.Stop)
	require.Equal(t, bgtask.StopBudget, end.Stop.Kind, "the hard limit stopped it")
	_, err = m.Wait(ctx, free.ID)
	require.NoError(t, err)
	require.NoError(t, m.Shutdown(ctx))

	sums, _, _ := collect(t, reader)
	const gpt, router = "model=openai/gpt-5,provider=openai", "model=router"
	assert.Equal(t, map[string]int64{
		"direction=input," + gpt: 1100, "direction=output," + gpt: 350, "direction=cached," + gpt: 200,
		"direction=input," + router: 10, "direction=output," + router: 5,
	}, sums["bgtask.usage.tokens"], "no cached point for the router: it reported none")
	assert.Equal(t, map[string]int64{gpt: 3, router: 1}, sums["bgtask.usage.requests"])
	assert.Equal(t, map[string]int64{gpt: 2_250_000}, sums["bgtask.usage.cost"], "millionths; the router reported no cost")
	assert.Equal(t, map[string]int64{"level=soft": 1, "level=hard,limit=cost": 1}, sums["bgtask.budget.crossings"])
	assert.Equal(t, map[string]int64{"stop.kind=budget": 1}, sums["bgtask.stops.asked"])
	assert.Equal(t, map[string]int64{"by=budget,stop.kind=budget": 1}, sums["bgtask.closures.begun"], "the budget closed its branch")

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	units := map[string]string{}
	for _, sm := range rm.ScopeMetrics {
		for _, mm := range sm.Metrics {
			units[mm.Name] = mm.Unit
			if mm.Name == "bgtask.usage.cost" {
				assert.Contains(t, mm.Description, "millionths")
			}
		}
	}
	assert.Equal(t, "{token}", units["bgtask.usage.tokens"])
	assert.Equal(t, "{request}", units["bgtask.usage.requests"])
	assert.Equal(t, "{millionth}", units["bgtask.usage.cost"])
}

// A hard crossing whose state names no limit leaves the attribute out
// rather than export "".
func TestACrossingWithoutALimitHasNoLimitAttribute(t *testing.T) {
	reader, mt := newMetrics(t)
	mt.BudgetCrossed(bgtask.BudgetState{TaskID: "t"}, true)
	mt.BudgetCrossed(bgtask.BudgetState{TaskID: "t", Exceeded: bgtask.LimitTokens}, false)
	mt.UsageReported("t", bgtask.Model{ID: "m"}, bgtask.Usage{})
	sums, _, _ := collect(t, reader)
	assert.Equal(t, map[string]int64{"level=hard": 1, "level=soft": 1}, sums["bgtask.budget.crossings"], "a soft crossing names no limit")
	assert.Empty(t, sums["bgtask.usage.tokens"], "an empty report adds nothing")
}

func TestANilMeterIsAnError(t *testing.T) {
	_, err := otelmetrics.New(nil)
	assert.Error(t, err)
}

// A closure cut short — its caller's context ended, Shutdown — is an
// outcome of its own, never "stopped".
func TestAClosureCutShortIsAnOutcomeOfItsOwn(t *testing.T) {
	reader, mt := newMetrics(t)
	ctx := context.Background()
	running, release := make(chan struct{}, 1), make(chan struct{})
	fn := func(ctx context.Context, run bgtask.Run) (string, error) {
		running <- struct{}{}
		<-release // it stops only when let go: its abort waits
		return "", ctx.Err()
	}
	m := testkit.MustOpen(bgtask.NewFuncHost(fn), bgtask.WithMetrics(mt))
	task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "tree", Models: []bgtask.Model{{ID: "m"}}})
	require.NoError(t, err)
	<-running
	gone, cancel := context.WithCancel(ctx)
	cancel()
	_, err = m.Stop(gone, bgtask.Target{Session: "tree"})
	require.ErrorIs(t, err, context.Canceled, "its caller gave up before the abort landed")
	close(release)
	_, err = m.Wait(ctx, task.ID)
	require.NoError(t, err)
	require.NoError(t, m.Shutdown(ctx))
	mt.ClosureEnded(bgtask.ClosureSummary{SessionID: "s", By: "session_deleted", Stop: bgtask.StopCause{Kind: bgtask.StopClosure, Root: "s"},
		Ended: "shutdown"}, time.Second)

	sums, hists, _ := collect(t, reader)
	assert.Equal(t, map[string]int64{"by=stop_session,outcome=cancelled,stop.kind=closure": 1,
		"by=session_deleted,outcome=shutdown,stop.kind=closure": 1}, sums["bgtask.closures.ended"])
	assert.Equal(t, map[string]uint64{"by=stop_session,outcome=cancelled": 1, "by=session_deleted,outcome=shutdown": 1}, hists["bgtask.closure.duration"])
	assert.Equal(t, map[string]int64{"by=stop_session,result=stopping": 1}, sums["bgtask.closure.runs"], "asked to stop, not stopped when it returned")
}

// newMetrics is an otelmetrics.Metrics on a meter whose measurements the
// returned reader collects.
func newMetrics(t *testing.T) (*sdkmetric.ManualReader, *otelmetrics.Metrics) {
	t.Helper()
	reader := sdkmetric.NewManualReader()
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = provider.Shutdown(context.Background()) })
	mt, err := otelmetrics.New(provider.Meter("bgtask"))
	require.NoError(t, err)
	return reader, mt
}
