package bgtaskhttp

import (
	"cmp"
	"fmt"
	"html/template"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/errclass"
)

// The charts of the live view, drawn on the server as SVG from the tasks
// a snapshot holds: launches and ends per minute, failures by class,
// latency percentiles and cost per model over time. They need no script
// and no library: an SVG of a few hundred elements, whose colours come
// from the page's stylesheet (classes, not inline styles, which the
// page's content security policy forbids).

// chartWindow and chartBuckets are what a chart shows: the last hour, a
// minute a bucket.
const (
	chartWindow  = time.Hour
	chartBuckets = 60
	chartModels  = 6 // models drawn one by one in cost per model; the rest as "other"
)

// errorClass is the class of what ended t in error ("" for a task that
// did not end in error): for a provider's failure, the kind its error
// says (rate_limited, forbidden, overloaded, …); else the reason of its
// outcome (context_overflow, output_limit, deadline, …), or unknown.
func errorClass(t *bgtask.Task) string {
	if t.Status != bgtask.StatusError {
		return ""
	}
	reason := bgtask.ReasonUnknown
	if t.Outcome != nil && t.Outcome.Reason != "" {
		reason = t.Outcome.Reason
	}
	if reason == bgtask.ReasonProviderError || reason == bgtask.ReasonUnknown {
		msg := t.Error
		if len(t.Attempts) > 0 {
			msg = cmp.Or(t.Attempts[len(t.Attempts)-1].Error, msg)
		}
		if c := errclass.FromMessage(msg); c != errclass.Unknown {
			return c.String()
		}
	}
	return string(reason)
}

// charts is what the chart page draws, over the window that ends at end.
type charts struct {
	end      time.Time
	launched []float64            // launches a bucket
	ended    map[string][]float64 // ends a bucket, by how (completed, error, cancelled, interrupt)
	classes  map[string]int       // failures by class in the window
	latency  [3][]float64         // p50, p90, p99 of the run time of the tasks that ended in a bucket (seconds; NaN: none ended)
	cost     map[string][]float64 // cost a bucket, by model (in units of the currency)
}

// chartsOf are the charts of tasks over the chartWindow that ends at end.
// An attempt's cost counts in the bucket it ended in (a live one's, at
// end), under its model.
func chartsOf(tasks []bgtask.Task, end time.Time) *charts {
	c := &charts{end: end, launched: make([]float64, chartBuckets), ended: map[string][]float64{},
		classes: map[string]int{}, cost: map[string][]float64{}}
	start := end.Add(-chartWindow)
	bucket := func(at time.Time) int {
		if at.Before(start) || at.After(end) {
			return -1
		}
		return min(int(at.Sub(start)*chartBuckets/chartWindow), chartBuckets-1)
	}
	took := make([][]float64, chartBuckets)
	for i := range tasks {
		t := &tasks[i]
		if b := bucket(t.LaunchedAt); b >= 0 {
			c.launched[b]++
		}
		if t.Status.Terminal() && !t.CompletedAt.IsZero() {
			if b := bucket(t.CompletedAt); b >= 0 {
				series(c.ended, string(t.Status))[b]++
				if !t.LaunchedAt.IsZero() {
					took[b] = append(took[b], t.CompletedAt.Sub(t.LaunchedAt).Seconds())
				}
				if cl := errorClass(t); cl != "" {
					c.classes[cl]++
				}
			}
		}
		if t.Usage == nil {
			continue
		}
		for j, a := range t.Attempts {
			if j >= len(t.Usage.ByAttempt) || t.Usage.ByAttempt[j].Cost == 0 {
				continue
			}
			at := cmp.Or(a.CompletedAt, end)
			if b := bucket(at); b >= 0 {
				series(c.cost, a.Model.String())[b] += float64(t.Usage.ByAttempt[j].Cost) / float64(bgtask.CostUnit)
			}
		}
	}
	for q, p := range [3]float64{0.5, 0.9, 0.99} {
		c.latency[q] = make([]float64, chartBuckets)
		for b, xs := range took {
			c.latency[q][b] = percentile(xs, p)
		}
	}
	c.cost = topSeries(c.cost, chartModels)
	return c
}

// series is m's series name, made on first use.
func series(m map[string][]float64, name string) []float64 {
	s, ok := m[name]
	if !ok {
		s = make([]float64, chartBuckets)
		m[name] = s
	}
	return s
}

// topSeries keeps the n series of m with the largest sums, and adds the
// others up as "other".
func topSeries(m map[string][]float64, n int) map[string][]float64 {
	if len(m) <= n {
		return m
	}
	names := sortedNames(m)
	out := map[string][]float64{}
	for i, name := range names {
		if i < n {
			out[name] = m[name]
			continue
		}
		o := series(out, "other")
		for b, v := range m[name] {
			o[b] += v
		}
	}
	return out
}

// sortedNames are m's names, the largest sum first (then by name).
func sortedNames(m map[string][]float64) []string {
	names := make([]string, 0, len(m))
	sums := map[string]float64{}
	for name, s := range m {
		names = append(names, name)
		for _, v := range s {
			sums[name] += v
		}
	}
	slices.SortFunc(names, func(a, b string) int {
		if c := cmp.Compare(sums[b], sums[a]); c != 0 {
			return c
		}
		return strings.Compare(a, b)
	})
	return names
}

// percentile is the p-th percentile of xs (nearest rank), NaN if xs is
// empty. xs is sorted in place.
func percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	slices.Sort(xs)
	i := int(math.Ceil(p*float64(len(xs)))) - 1
	return xs[max(i, 0)]
}

// The drawing: a chart is a plot of chartBuckets columns with a y axis
// from 0 to a round maximum, its x axis labelled in minutes before end,
// and a legend.
const (
	svgW, svgH           = 640, 220
	plotL, plotR         = 48, 8
	plotT, plotB         = 24, 36
	plotW                = svgW - plotL - plotR
	plotH                = svgH - plotT - plotB
	colW         float64 = float64(plotW) / chartBuckets
)

// svg is a chart being drawn.
type svg struct{ b strings.Builder }

func (s *svg) f(format string, args ...any) { fmt.Fprintf(&s.b, format, args...) }

// begin opens a chart titled title, with y from 0 to top.
func (s *svg) begin(title string, top float64, unit string) {
	s.f(`<svg class="chart" viewBox="0 0 %d %d" role="img" aria-label="%s" xmlns="http://www.w3.org/2000/svg">`, svgW, svgH, esc(title))
	s.f(`<title>%s</title><text class="chart-title" x="%d" y="14">%s</text>`, esc(title), plotL, esc(title))
	for i := 0; i <= 4; i++ {
		y := plotT + plotH - plotH*i/4
		s.f(`<line class="grid" x1="%d" x2="%d" y1="%d" y2="%d"/>`, plotL, plotL+plotW, y, y)
		s.f(`<text class="tick" x="%d" y="%d" text-anchor="end">%s</text>`, plotL-4, y+4, esc(sig3(top*float64(i)/4)+unit))
	}
	for m := 0; m <= chartBuckets; m += 15 {
		x := plotL + int(float64(m)*colW)
		label, anchor := "now", "end"
		if m < chartBuckets {
			label, anchor = "-"+strconv.Itoa(chartBuckets-m)+"m", "middle"
		}
		s.f(`<text class="tick" x="%d" y="%d" text-anchor="%s">%s</text>`, x, plotT+plotH+14, anchor, label)
	}
}

// legend draws names with their colour classes, under the plot.
func (s *svg) legend(names []string) {
	x := plotL
	for i, name := range names {
		s.f(`<rect class="c%d" x="%d" y="%d" width="10" height="10"/><text class="tick" x="%d" y="%d">%s</text>`,
			colourOf(name, i), x, svgH-12, x+14, svgH-3, esc(name))
		x += 24 + 7*len([]rune(name))
	}
}

// colourOf is the colour class of series name, the i-th drawn: a
// status's own (green for completed, red for an error, amber for
// cancelled, grey for interrupt; blue for launches), else the i-th of
// the palette.
func colourOf(name string, i int) int {
	switch name {
	case "launched":
		return 0
	case "ended " + string(bgtask.StatusCompleted):
		return 2
	case "ended " + string(bgtask.StatusError):
		return 1
	case "ended " + string(bgtask.StatusCancelled):
		return 3
	case "ended " + string(bgtask.StatusInterrupt):
		return 7
	}
	return i % 8
}

func (s *svg) end() template.HTML {
	s.f(`</svg>`)
	return template.HTML(s.b.String()) // every text in it went through esc
}

// stacked draws the series of m (in names' order) as stacked columns.
func stacked(title, unit string, names []string, m map[string][]float64) template.HTML {
	var s svg
	top := 0.0
	for b := range chartBuckets {
		sum := 0.0
		for _, name := range names {
			sum += m[name][b]
		}
		top = max(top, sum)
	}
	top = roundUp(top)
	s.begin(title, top, unit)
	for b := range chartBuckets {
		y := float64(plotT + plotH)
		for i, name := range names {
			v := m[name][b]
			if v <= 0 {
				continue
			}
			h := v / top * plotH
			y -= h
			s.f(`<rect class="c%d" x="%.1f" y="%.1f" width="%.1f" height="%.1f"><title>%s: %s%s</title></rect>`,
				colourOf(name, i), float64(plotL)+float64(b)*colW, y, max(colW-1, 1), h, esc(name), esc(sig3(v)), esc(unit))
		}
	}
	s.legend(names)
	return s.end()
}

// lines draws the series of m (in names' order) as lines; a NaN is a gap.
func lines(title, unit string, names []string, m map[string][]float64) template.HTML {
	var s svg
	top := 0.0
	for _, name := range names {
		for _, v := range m[name] {
			if !math.IsNaN(v) {
				top = max(top, v)
			}
		}
	}
	top = roundUp(top)
	s.begin(title, top, unit)
	for i, name := range names {
		var pts []string
		flush := func() {
			if len(pts) > 1 {
				s.f(`<polyline class="line c%d" points="%s"/>`, colourOf(name, i), strings.Join(pts, " "))
			} else if len(pts) == 1 {
				xy := strings.Split(pts[0], ",")
				s.f(`<circle class="c%d" cx="%s" cy="%s" r="2"/>`, colourOf(name, i), xy[0], xy[1])
			}
			pts = pts[:0]
		}
		for b, v := range m[name] {
			if math.IsNaN(v) {
				flush()
				continue
			}
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", float64(plotL)+(float64(b)+0.5)*colW, float64(plotT+plotH)-v/top*plotH))
		}
		flush()
	}
	s.legend(names)
	return s.end()
}

// bars draws counts as horizontal bars, the largest first.
func bars(title string, counts map[string]int) template.HTML {
	names := make([]string, 0, len(counts))
	for name := range counts {
		names = append(names, name)
	}
	slices.SortFunc(names, func(a, b string) int {
		if c := cmp.Compare(counts[b], counts[a]); c != 0 {
			return c
		}
		return strings.Compare(a, b)
	})
	rows := max(len(names), 1)
	h := plotT + 18*rows + 8
	var s svg
	s.f(`<svg class="chart" viewBox="0 0 %d %d" role="img" aria-label="%s" xmlns="http://www.w3.org/2000/svg">`, svgW, h, esc(title))
	s.f(`<title>%s</title><text class="chart-title" x="%d" y="14">%s</text>`, esc(title), plotL, esc(title))
	if len(names) == 0 {
		s.f(`<text class="tick" x="%d" y="%d">none in the last hour</text>`, plotL, plotT+12)
		return s.end()
	}
	top := float64(counts[names[0]])
	const labelW = 160
	for i, name := range names {
		y := plotT + 18*i
		w := float64(counts[name]) / top * float64(svgW-labelW-60)
		s.f(`<text class="tick" x="%d" y="%d" text-anchor="end">%s</text>`, labelW-6, y+12, esc(name))
		s.f(`<rect class="c1" x="%d" y="%d" width="%.1f" height="14"/>`, labelW, y, max(w, 1))
		s.f(`<text class="tick" x="%.1f" y="%d">%d</text>`, float64(labelW)+max(w, 1)+4, y+12, counts[name])
	}
	return s.end()
}

// roundUp is a round number at or above v (1, 2 or 5 times a power of
// ten), and 1 for nothing.
func roundUp(v float64) float64 {
	if v <= 0 || math.IsNaN(v) {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}

// sig3 is v with at most three significant digits.
func sig3(v float64) string {
	return strconv.FormatFloat(v, 'g', 3, 64)
}

// esc is s as SVG text.
func esc(s string) string { return template.HTMLEscapeString(s) }

// draw is the four charts of c, as the chart page shows them.
func (c *charts) draw() []template.HTML {
	ends := []string{}
	for _, s := range []bgtask.Status{bgtask.StatusCompleted, bgtask.StatusError, bgtask.StatusCancelled, bgtask.StatusInterrupt} {
		if _, ok := c.ended[string(s)]; ok {
			ends = append(ends, string(s))
		}
	}
	flow := map[string][]float64{"launched": c.launched}
	for _, s := range ends {
		flow["ended "+s] = c.ended[string(s)]
	}
	flowNames := []string{"launched"}
	for _, s := range ends {
		flowNames = append(flowNames, "ended "+s)
	}
	// launches and ends side by side would need grouped columns; drawn as
	// lines they read at once
	lat := map[string][]float64{"p50": c.latency[0], "p90": c.latency[1], "p99": c.latency[2]}
	return []template.HTML{
		lines("Launches and ends per minute", "", flowNames, flow),
		bars("Failures by class (last hour)", c.classes),
		lines("Run time of the tasks that ended (percentiles)", "s", []string{"p50", "p90", "p99"}, lat),
		stacked("Cost per model per minute", "", sortedNames(c.cost), c.cost),
	}
}
