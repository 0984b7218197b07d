package pgledger_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/bgtask/bgtask/pgledger"
	"github.com/jackc/pgx/v5/pgxpool"
)

// benchWorkerEnv makes the test binary a benchmark worker: "member
// ledger count" (see BenchmarkLifecyclesProcesses).
const benchWorkerEnv = "BGTASK_BENCH_WORKER"

// benchWorker joins a node, says "ready", waits for a line on stdin, runs
// its lifecycles from 32 callers through Node.Launch, and prints how long
// they took in nanoseconds.
func benchWorker() error {
	f := strings.Fields(os.Getenv(benchWorkerEnv))
	count, err := strconv.Atoi(f[2])
	if err != nil {
		return err
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("BGTASK_BENCH_DB"))
	if err != nil {
		return err
	}
	defer pool.Close()
	host := pgledger.NewAnswering()
	node, err := pgledger.Join(ctx, pool, pgledger.NodeOptions{Ledger: f[1], Member: f[0], Host: host})
	if err != nil {
		return err
	}
	defer node.Close(ctx)
	host.Bind(node.Manager())
	fmt.Println("ready")
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		return err
	}
	start := time.Now()
	if err := pgledger.Lifecycles32(ctx, node, count); err != nil {
		return err
	}
	fmt.Println(time.Since(start).Nanoseconds())
	return nil
}

// BenchmarkLifecyclesProcesses: single-attempt lifecycles per second
// through Node.Launch from 1 and from 3 OS processes (this test binary,
// re-executed), 32 concurrent callers each, on one database: b.N
// lifecycles in all, started together.
func BenchmarkLifecyclesProcesses(b *testing.B) {
	for _, procs := range []int{1, 3} {
		b.Run(strconv.Itoa(procs), func(b *testing.B) {
			ledger := fmt.Sprintf("procbench-%d-%d", procs, time.Now().UnixNano())
			type worker struct {
				cmd *exec.Cmd
				in  *os.File
				out *bufio.Scanner
			}
			var ws []worker
			for i := range procs {
				cmd := exec.Command(os.Args[0])
				cmd.Env = append(os.Environ(), benchWorkerEnv+"="+fmt.Sprintf("w%d %s %d", i, ledger, b.N/procs), "BGTASK_BENCH_DB="+*pgledger.DBURL)
				cmd.Stderr = os.Stderr
				stdin, err := cmd.StdinPipe()
				if err != nil {
					b.Fatal(err)
				}
				stdout, err := cmd.StdoutPipe()
				if err != nil {
					b.Fatal(err)
				}
				if err := cmd.Start(); err != nil {
					b.Fatal(err)
				}
				sc := bufio.NewScanner(stdout)
				if !sc.Scan() || sc.Text() != "ready" {
					b.Fatalf("worker %d: %q", i, sc.Text())
				}
				ws = append(ws, worker{cmd: cmd, in: stdin.(*os.File), out: sc})
			}
			b.ResetTimer()
			for _, w := range ws {
				_, _ = w.in.WriteString("go\n")
			}
			var slowest time.Duration
			for i, w := range ws {
				if !w.out.Scan() {
					b.Fatalf("worker %d said nothing", i)
				}
				ns, err := strconv.ParseInt(w.out.Text(), 10, 64)
				if err != nil {
					b.Fatalf("worker %d: %q", i, w.out.Text())
				}
				slowest = max(slowest, time.Duration(ns))
				_ = w.in.Close()
				if err := w.cmd.Wait(); err != nil {
					b.Fatalf("worker %d: %v", i, err)
				}
			}
			b.ReportMetric(float64(b.N/procs*procs)/slowest.Seconds(), "tasks/s")
		})
	}
}
