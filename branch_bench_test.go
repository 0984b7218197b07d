package bgtask

import (
	"context"
	"fmt"
	goruntime "runtime"
	"testing"
	"time"
)

// liveTree launches n running tasks in a tree with the given branching
// under the session "root": each task's session is the parent of the next
// level's tasks.
func liveTree(b *testing.B, n, branching int) *Manager {
	b.Helper()
	host := &benchHost{}
	m := mustOpen(host, WithIDs(SequentialIDs()))
	host.m = m
	spec := func(parent string) Spec {
		return Spec{ParentSessionID: parent, Models: []Model{{Provider: "a", ID: "1"}}}
	}
	parents := []string{"root"}
	made := 0
	for made < n {
		var ids []string
		for _, p := range parents {
			for range branching {
				if made == n {
					break
				}
				task, err := m.Launch(context.Background(), spec(p))
				if err != nil {
					b.Fatal(err)
				}
				ids = append(ids, task.ID)
				made++
			}
		}
		if err := m.life.group.Wait(context.Background()); err != nil {
			b.Fatal(err)
		}
		parents = parents[:0]
		for _, id := range ids {
			task, _ := m.Task(id)
			parents = append(parents, task.SessionID)
		}
	}
	return m
}

// BenchmarkCloseBranch closes a tree of live tasks (branching 4) whose host
// confirms each abort at once. Beside it, in the same iteration, it cancels a
// context.WithCancel tree of the same size (Go's own propagation) and
// reports the ratio of the two per node: "x-context". Timing both back to
// back keeps the ratio steady on a noisy machine; BenchmarkContextTreeCancel
// gives the context figure alone.
func BenchmarkCloseBranch(b *testing.B) {
	for _, n := range []int{1_000, 10_000, 100_000} {
		b.Run(fmt.Sprintf("tasks=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			var closing, cancelling time.Duration
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				m := liveTree(b, n, 4)
				goruntime.GC() // the setup's garbage is not the closure's
				b.StartTimer()
				start := time.Now()
				rep, err := m.Stop(context.Background(), Target{Session: "root"})
				closing += time.Since(start)
				b.StopTimer()
				if err != nil || len(rep.Stopped) != n {
					b.Fatalf("stopped %d of %d: %v", len(rep.Stopped), n, err)
				}
				if err := m.Shutdown(context.Background()); err != nil {
					b.Fatal(err)
				}
				cancelling += cancelContextTree(b, n, false)
				b.StartTimer()
			}
			b.ReportMetric(float64(closing.Nanoseconds())/float64(b.N)/float64(n), "ns/task")
			b.ReportMetric(float64(closing)/float64(cancelling), "x-context")
		})
	}
}

func BenchmarkContextTreeCancel(b *testing.B) {
	for _, n := range []int{1_000, 10_000, 100_000} {
		b.Run(fmt.Sprintf("tasks=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			var total time.Duration
			b.StopTimer()
			for i := 0; i < b.N; i++ {
				total += cancelContextTree(b, n, true)
			}
			b.ReportMetric(float64(total.Nanoseconds())/float64(b.N)/float64(n), "ns/task")
		})
	}
}

// cancelContextTree builds a context.WithCancel tree of n nodes under one
// root (branching 4) and returns how long cancelling the root took; with
// timed, b's timer runs for the cancel only (b's timer is stopped on entry;
// many iterations run, so no collection is forced before each).
func cancelContextTree(b *testing.B, n int, timed bool) time.Duration {
	root, cancel := context.WithCancel(context.Background())
	parents := []context.Context{root}
	var nodes []context.Context
	for len(nodes) < n {
		var next []context.Context
		for _, p := range parents {
			for range 4 {
				if len(nodes)+len(next) == n {
					break
				}
				ctx, c := context.WithCancel(p)
				_ = c // cancelled through root
				next = append(next, ctx)
			}
		}
		nodes = append(nodes, next...)
		parents = next
	}
	if timed {
		b.StartTimer()
	} else {
		goruntime.GC() // beside a closure: the closure's garbage is not the tree's
	}
	start := time.Now()
	cancel()
	took := time.Since(start)
	if timed {
		b.StopTimer()
	}
	for _, c := range nodes {
		if c.Err() == nil {
			b.Fatal("not cancelled")
		}
	}
	return took
}
