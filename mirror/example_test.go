package mirror_test

import (
	"context"
	"fmt"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/mirror"
)

// A client keeps a Mirror from a snapshot and the change stream, in
// whatever order they arrive.
func Example() {
	m, err := bgtask.Open(context.Background(), bgtask.NewFuncHost(func(context.Context, bgtask.Run) (string, error) { return "done", nil }),
		bgtask.WithIDs(bgtask.SequentialIDs()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(context.Background())
	sub, _ := m.Subscribe(context.Background(), 256) // subscribe first, then take the snapshot
	defer sub.Close()

	var mir mirror.Mirror
	mir.ApplySnapshot(m.Snapshot())
	task, _ := m.Launch(context.Background(), bgtask.Spec{ParentSessionID: "chat", Models: []bgtask.Model{{ID: "m"}}})
	for c := range sub.C {
		mir.ApplyChange(c)
		if got, err := mir.Task(task.ID); err == nil && got.Status.Terminal() {
			break
		}
	}
	got, _ := mir.Task(task.ID)
	fmt.Println(got.ID, got.Status, got.Result)
	// Output: task-1 completed done
}
