package otelmetrics_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"go.uber.org/goleak"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/otelmetrics"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestAManagersMeasurementsBecomeInstruments(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = provider.Shutdown(context.Background()) })
	mt, err := otelmetrics.New(provider.Meter("bgtask"))
	require.NoError(t, err)

	m := bgtask.New(bgtask.NewFuncHost(func(ctx context.Context, run bgtask.Run) (string, error) {
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

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	sums := map[string]map[string]int64{}   // instrument → attribute set → value
	hists := map[string]map[string]uint64{} // instrument → attribute set → count
	gauges := map[string]int64{}
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
	assert.Equal(t, map[string]int64{"": 1}, sums["bgtask.tasks.launched"])
	assert.Equal(t, map[string]int64{"model=primary": 1, "model=backup": 1}, sums["bgtask.attempts.started"])
	assert.Equal(t, map[string]int64{"reason=provider_error": 1}, sums["bgtask.retries"])
	assert.Equal(t, map[string]int64{"reason=,state=completed": 1}, sums["bgtask.tasks.ended"])
	assert.Equal(t, map[string]uint64{"model=primary,status=error": 1, "model=backup,status=completed": 1}, hists["bgtask.attempt.duration"])
	assert.Equal(t, map[string]uint64{"state=completed": 1}, hists["bgtask.task.duration"])
	assert.Equal(t, int64(0), gauges["bgtask.tasks.live"])
}

func TestANilMeterIsAnError(t *testing.T) {
	_, err := otelmetrics.New(nil)
	assert.Error(t, err)
}
