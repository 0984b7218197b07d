package bgtaskhttp

import (
	"encoding/xml"
	"errors"
	"io"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
)

// ended is a task launched at launched that ended as status at done, on
// model, its one attempt having cost cost units (tenths).
func ended(id string, status bgtask.Status, launched, done time.Time, model string, tenths int64, errText string, reason bgtask.Reason) bgtask.Task {
	p, m, _ := strings.Cut(model, "/")
	a := bgtask.Attempt{Number: 1, Model: bgtask.Model{Provider: p, ID: m}, Status: status, StartedAt: launched, CompletedAt: done, Error: errText}
	t := bgtask.Task{ID: id, LaunchedAt: launched, CompletedAt: done, Status: status, Error: errText, Attempts: []bgtask.Attempt{a}}
	if tenths > 0 {
		u := bgtask.Usage{Cost: bgtask.Cost(tenths) * bgtask.CostUnit / 10}
		t.Usage = &bgtask.TaskUsage{Total: u, ByAttempt: []bgtask.Usage{u}}
	}
	if status.Terminal() {
		t.Outcome = &bgtask.Outcome{State: status, Reason: reason}
	}
	return t
}

// Each task counts in the minute it was launched, ended and spent in; a
// task outside the hour counts in none; a failure counts under the kind
// of error that ended it; the run times of a minute's ends make its
// percentiles; a live attempt's cost counts now.
func TestChartsCountEachTaskInItsMinute(t *testing.T) {
	end := time.Date(2026, 12, 7, 12, 0, 0, 0, time.UTC)
	ago := func(d time.Duration) time.Time { return end.Add(-d) }
	live := ended("live", bgtask.StatusRunning, ago(90*time.Second), time.Time{}, "b/2", 5, "", "")
	live.Attempts[0].CompletedAt = time.Time{}
	tasks := []bgtask.Task{
		ended("ok", bgtask.StatusCompleted, ago(90*time.Second), ago(30*time.Second), "a/1", 15, "", ""), // launched in minute 58, ended in 59
		ended("slow", bgtask.StatusCompleted, ago(5*time.Minute), ago(40*time.Second), "a/1", 0, "", ""), // ended in 59 after 260 s
		ended("limited", bgtask.StatusError, ago(11*time.Minute), ago(10*time.Minute), "a/1", 0, "429 Too Many Requests", bgtask.ReasonProviderError),
		ended("overflow", bgtask.StatusError, ago(11*time.Minute), ago(10*time.Minute), "a/1", 0, "too long", bgtask.ReasonContextOverflow),
		ended("stopped", bgtask.StatusCancelled, ago(3*time.Minute), ago(2*time.Minute+30*time.Second), "a/1", 0, "", ""),
		ended("old", bgtask.StatusCompleted, ago(3*time.Hour), ago(2*time.Hour), "a/1", 99, "", ""), // outside the hour
		live,
	}
	c := chartsOf(tasks, end)

	assert.Equal(t, 2.0, c.launched[58], "ok and live")
	assert.Equal(t, 1.0, c.launched[55], "slow, five minutes ago")
	sum := 0.0
	for _, v := range c.launched {
		sum += v
	}
	assert.Equal(t, 6.0, sum, "every task launched within the hour, once; old is not")
	assert.Equal(t, 2.0, c.ended["completed"][59])
	assert.Equal(t, 2.0, c.ended["error"][50], "ten minutes ago: the minute that begins then")
	assert.Equal(t, 1.0, c.ended["cancelled"][57])
	assert.Equal(t, map[string]int{"rate_limited": 1, "context_overflow": 1}, c.classes)
	assert.Equal(t, 60.0, c.latency[0][59], "p50 of 60 s and 260 s, nearest rank")
	assert.Equal(t, 260.0, c.latency[2][59])
	assert.True(t, math.IsNaN(c.latency[0][30]), "no end in that minute: a gap, not a zero")
	assert.Equal(t, 1.5, c.cost["a/1"][59])
	assert.Equal(t, 0.5, c.cost["b/2"][59], "a live attempt's cost counts now")
}

func TestErrorClass(t *testing.T) {
	for _, c := range []struct {
		task bgtask.Task
		want string
	}{
		{ended("a", bgtask.StatusError, time.Time{}, time.Time{}, "a/1", 0, "403 Forbidden", bgtask.ReasonProviderError), "forbidden"},
		{ended("b", bgtask.StatusError, time.Time{}, time.Time{}, "a/1", 0, "the model is overloaded", bgtask.ReasonProviderError), "overloaded"},
		{ended("c", bgtask.StatusError, time.Time{}, time.Time{}, "a/1", 0, "", bgtask.ReasonOutputLimit), "output_limit"},
		{ended("d", bgtask.StatusError, time.Time{}, time.Time{}, "a/1", 0, "something odd", ""), "unknown"},
		{ended("e", bgtask.StatusCompleted, time.Time{}, time.Time{}, "a/1", 0, "", ""), ""},
		{ended("f", bgtask.StatusCancelled, time.Time{}, time.Time{}, "a/1", 0, "", ""), ""},
	} {
		assert.Equal(t, c.want, errorClass(&c.task), "task %s", c.task.ID)
	}
}

func TestPercentileAndRoundUp(t *testing.T) {
	xs := []float64{10, 9, 8, 7, 6, 5, 4, 3, 2, 1}
	assert.Equal(t, 5.0, percentile(xs, 0.5))
	assert.Equal(t, 9.0, percentile(xs, 0.9))
	assert.Equal(t, 10.0, percentile(xs, 0.99))
	assert.True(t, math.IsNaN(percentile(nil, 0.5)))
	for v, want := range map[float64]float64{0: 1, 3: 5, 7: 10, 12: 20, 0.3: 0.5, 100: 100, 101: 200} {
		assert.Equal(t, want, roundUp(v), "roundUp(%v)", v)
	}
}

// More models than a chart draws one by one: the smallest add up as
// "other", and nothing is lost.
func TestCostOfManyModelsKeepsItsTotal(t *testing.T) {
	end := time.Date(2026, 12, 7, 12, 0, 0, 0, time.UTC)
	var tasks []bgtask.Task
	total := 0.0
	for i := range 9 {
		tenths := int64(i + 1)
		tasks = append(tasks, ended(string(rune('a'+i)), bgtask.StatusCompleted, end.Add(-time.Minute), end.Add(-time.Second),
			string(rune('a'+i))+"/m", tenths, "", ""))
		total += float64(tenths) / 10
	}
	c := chartsOf(tasks, end)
	require.Len(t, c.cost, chartModels+1)
	assert.Contains(t, c.cost, "other")
	assert.Contains(t, c.cost, "i/m", "the largest is drawn on its own")
	assert.NotContains(t, c.cost, "a/m", "the smallest is in other")
	got := 0.0
	for _, s := range c.cost {
		got += s[59]
	}
	assert.InDelta(t, total, got, 1e-9)
}

// Each chart is one well-formed SVG element, whatever the names in it:
// a model named with markup is text.
func TestChartsAreWellFormedSVG(t *testing.T) {
	end := time.Date(2026, 12, 7, 12, 0, 0, 0, time.UTC)
	tasks := []bgtask.Task{
		ended("x", bgtask.StatusError, end.Add(-2*time.Minute), end.Add(-time.Minute), `p/<script>alert(1)</script>`, 7, "429 Too Many Requests", bgtask.ReasonProviderError),
		ended("y", bgtask.StatusCompleted, end.Add(-2*time.Minute), end.Add(-time.Minute), "a/1", 3, "", ""),
	}
	drawn := chartsOf(tasks, end).draw()
	require.Len(t, drawn, 4)
	for _, svg := range append(drawn, chartsOf(nil, end).draw()...) {
		s := string(svg)
		assert.NotContains(t, s, "<script>", "markup in a name is escaped")
		assert.True(t, strings.HasPrefix(s, "<svg ") && strings.HasSuffix(s, "</svg>"))
		d := xml.NewDecoder(strings.NewReader(s))
		for {
			_, err := d.Token()
			if errors.Is(err, io.EOF) {
				break
			}
			require.NoError(t, err, "%s", s)
		}
	}
	assert.Contains(t, string(drawn[1]), "rate_limited")
	assert.Contains(t, string(drawn[3]), "&lt;script&gt;", "the model's name, as text")
}
