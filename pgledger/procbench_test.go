package pgledger_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
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
	var wg sync.WaitGroup
	var next atomic.Int64
	var failed atomic.Value
	start := time.Now()
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := next.Add(1); i <= int64(count); i = next.Add(1) {
				task, err := node.Launch(ctx, bgtask.Spec{ParentSessionID: "p-" + strconv.FormatInt(i, 10), Models: []bgtask.Model{{Provider: "a", ID: "1"}}})
				if err == nil {
					_, err = node.Manager().Wait(ctx, task.ID)
				}
				if err != nil {
					failed.Store(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
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
