// Package bigtree builds a Manager of many tasks in trees, for the
// tests and benchmarks of the live view at scale.
package bigtree

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/internal/testkit"
	"github.com/stretchr/testify/require"
)

// Build launches roots trees of 100 tasks each (a root, 9 children, 10
// grandchildren each) on a new Manager, the grandchildren of every third
// root ended, and shut down when the test ends.
func Build(tb testing.TB, roots int) (*bgtask.Manager, *bgtasktest.Host) {
	tb.Helper()
	host := bgtasktest.NewHost()
	m := testkit.MustOpen(host, bgtask.WithIDs(bgtask.SequentialIDs()), bgtask.WithRetention(bgtask.Retention{MaxEnded: -1}))
	host.Attach(m)
	tb.Cleanup(func() { _ = m.Shutdown(context.Background()) })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	models := []bgtask.Model{{Provider: "openai", ID: "gpt-5"}, {ID: "backup"}}
	launch := func(parent, desc string) bgtask.Task {
		task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: parent, Description: desc, Prompt: "Research " + desc + " and report back in under 200 words.", Models: models})
		require.NoError(tb, err)
		return task
	}
	running := func(id string) bgtask.Task {
		got, err := bgtasktest.WaitStatus(ctx, m, id, bgtask.StatusRunning)
		require.NoError(tb, err)
		return got
	}
	var wg sync.WaitGroup
	work := make(chan int)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range work {
				root := running(launch(fmt.Sprint("chat-", r%10), fmt.Sprint("root ", r)).ID)
				for k := range 9 {
					kid := running(launch(root.SessionID, fmt.Sprintf("kid %d.%d", r, k)).ID)
					var gks []bgtask.Task
					for g := range 10 {
						gks = append(gks, launch(kid.SessionID, fmt.Sprintf("grandkid %d.%d.%d", r, k, g)))
					}
					for _, gk := range gks {
						gk = running(gk.ID)
						if r%3 == 0 {
							require.NoError(tb, host.Idle(gk.SessionID, "found it"))
						}
					}
				}
			}
		}()
	}
	for r := range roots {
		work <- r
	}
	close(work)
	wg.Wait()
	return m, host
}
