package riverbench

import (
	"context"
	"flag"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"text/tabwriter"
	"time"
)

var (
	flagCount    = flag.Int("riverbench.n", 5000, "BenchmarkCompare: lifecycles each system runs measured (the floor: commits)")
	flagInflight = flag.Int("riverbench.inflight", 256, "BenchmarkCompare: lifecycles in flight (all nodes' together)")
	flagConns    = flag.Int("riverbench.conns", 8, "BenchmarkCompare: connections at most of River's pool and of each pgledger node's")
	flagWorkers  = flag.Int("riverbench.defaultworkers", 100, "MaxWorkers of River with its defaults (River has no default for it; its docs' example says 100)")
	flagOnly     = flag.String("riverbench.only", "", "BenchmarkCompare: a regular expression: only the systems it matches run (and the floor, always)")
)

// tunedRiver is River tuned: 100 workers, a fetch every 10 ms at most, and
// the poll (a fallback: the client's inserts wake its producer by NOTIFY,
// and a worker freed wakes it too) at River's default, 1 s.
var tunedRiver = riverTuning{workers: 100, cooldown: 10 * time.Millisecond, poll: time.Second}

// systems are the systems compared, in the order they run: the floor
// first, since every other figure is also given as a multiple of its.
func systems(defaultWorkers int) []system {
	return []system{
		{name: "floor", run: runFloor},
		{name: "river-defaults", run: runRiver(riverTuning{workers: defaultWorkers})},
		{name: "river-tuned", run: runRiver(tunedRiver)},
		{name: "pgledger-1", run: runLedger(1)},
		{name: "pgledger-3", run: runLedger(3)},
	}
}

// compare runs every system in turn on the server, each alone: the one
// before it taken down, and the server quiesced before it is set up and
// warmed up — so that its own warm-up, not its measurement, pays for the
// full-page images of the pages it writes first after the checkpoint.
func compare(ctx context.Context, s *server, p plan, all []system) ([]figures, error) {
	var out []figures
	for _, sys := range all {
		if err := s.quiesce(ctx); err != nil {
			return nil, err
		}
		f, err := sys.run(ctx, s, p)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", sys.name, err)
		}
		f.name = sys.name
		out = append(out, f)
	}
	return out, nil
}

// BenchmarkCompare runs the floor, River with its defaults and tuned, and
// pgledger from one node and from three, on the one server of the run,
// -riverbench.n lifecycles each (b.N is not used: the systems' counts
// must be the same for their figures to compare), with
// -riverbench.inflight of them in flight, and reports every system's
// figures, as multiples of the floor's too, and pgledger's rate as a
// multiple of tuned River's; the table of them is logged. (It reports no
// allocations: b.N is not its unit of work.)
func BenchmarkCompare(b *testing.B) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	s, err := openServer(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer s.close()
	only, err := regexp.Compile(*flagOnly)
	if err != nil {
		b.Fatal(err)
	}
	var run []system
	for _, sys := range systems(*flagWorkers) {
		if sys.name == "floor" || only.MatchString(sys.name) {
			run = append(run, sys)
		}
	}
	p := plan{count: *flagCount, warm: min(*flagCount, 2**flagInflight), inflight: *flagInflight, conns: int32(*flagConns)}
	fs, err := compare(ctx, s, p, run)
	if err != nil {
		b.Fatal(err)
	}
	for _, f := range fs {
		if f.ended != f.count || f.dups != 0 {
			b.Errorf("%s: %d of %d lifecycles ended, %d notifications delivered twice", f.name, f.ended, f.count, f.dups)
		}
	}
	for _, r := range ratios(fs) {
		b.ReportMetric(r.value, r.unit)
	}
	b.Logf("%d lifecycles each (the floor: commits), %d in flight (the floor: %d connections), pools of %d connections at most\n%s",
		p.count, p.inflight, floorConns, p.conns, table(fs))
}

// metric is one figure reported.
type metric struct {
	unit  string
	value float64
}

// ratios are every system's figures, and each as a multiple of the
// floor's; and pgledger's delivery tail, and its rate as a multiple of
// tuned River's.
func ratios(fs []figures) []metric {
	floor, tuned := fs[0], find(fs, "river-tuned")
	var out []metric
	add := func(f figures, unit string, v float64) { out = append(out, metric{f.name + "-" + unit, v}) }
	for _, f := range fs {
		per := "lc"
		if f.name == floor.name {
			per = "commit"
		}
		add(f, per+"/s", f.rate())
		if f.db >= 0 {
			add(f, "db-µs/"+per, f.dbPer())
		}
		add(f, "wal-B/"+per, f.walPer())
		add(f, "stmts/"+per, f.stmtsPer())
		add(f, "go-µs/"+per, f.selfPer())
		if f.name == floor.name {
			continue
		}
		add(f, "x-floor", f.rate()/floor.rate())
		if f.db >= 0 && floor.db > 0 {
			add(f, "db-x-floor", f.dbPer()/floor.dbPer())
		}
		add(f, "wal-x-floor", f.walPer()/floor.walPer())
		if strings.HasPrefix(f.name, "pgledger") {
			add(f, "tail-ms", float64(f.tail.Milliseconds()))
			if tuned.count > 0 {
				add(f, "x-river-tuned", f.rate()/tuned.rate())
			}
		}
	}
	return out
}

func find(fs []figures, name string) figures {
	for _, f := range fs {
		if f.name == name {
			return f
		}
	}
	return figures{}
}

// table renders fs, one system a line: lifecycles per second, server CPU,
// WAL and statements per lifecycle (each with its multiple of the
// floor's), this process's CPU per lifecycle, the rate as a multiple of
// tuned River's, and (pgledger) how long the deliveries went on after the
// last task ended.
func table(fs []figures) string {
	floor, tuned := fs[0], find(fs, "river-tuned")
	var sb strings.Builder
	w := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "system\tlc/s\tx-floor\tdb-µs/lc\tx-floor\tWAL-B/lc\tx-floor\tstmts/lc\tgo-µs/lc\tx-river-tuned\ttail-ms\t")
	for _, f := range fs {
		db, dbx := "-", "-"
		if f.db >= 0 {
			db, dbx = fmt.Sprintf("%.0f", f.dbPer()), fmt.Sprintf("%.2f", f.dbPer()/floor.dbPer())
		}
		vsRiver := "-"
		if tuned.count > 0 {
			vsRiver = fmt.Sprintf("%.2f", f.rate()/tuned.rate())
		}
		tail := "-"
		if strings.HasPrefix(f.name, "pgledger") {
			tail = strconv.FormatInt(f.tail.Milliseconds(), 10)
		}
		fmt.Fprintf(w, "%s\t%.0f\t%.2f\t%s\t%s\t%.0f\t%.2f\t%.1f\t%.0f\t%s\t%s\t\n", f.name, f.rate(), f.rate()/floor.rate(),
			db, dbx, f.walPer(), f.walPer()/floor.walPer(), f.stmtsPer(), f.selfPer(), vsRiver, tail)
	}
	_ = w.Flush()
	return sb.String()
}
