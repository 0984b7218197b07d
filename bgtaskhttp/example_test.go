package bgtaskhttp_test

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
)

// Serve a Manager over HTTP and call it with the Client: errors come back
// as bgtask's sentinels. Without Options.Authorize anyone who reaches the
// address may read and act; by default only loopback host names are
// served (Options.Hosts).
func Example() {
	m, err := bgtask.Open(context.Background(), bgtask.NewFuncHost(func(ctx context.Context, run bgtask.Run) (string, error) {
		return "found 3 issues", nil
	}), bgtask.WithIDs(bgtask.SequentialIDs()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(context.Background())
	srv := httptest.NewServer(bgtaskhttp.Handler(m, bgtaskhttp.Options{}))
	defer srv.Close()

	task, _ := m.Launch(context.Background(), bgtask.Spec{ParentSessionID: "chat", Prompt: "review", Models: []bgtask.Model{{ID: "m"}}})
	_, _ = m.Wait(context.Background(), task.ID)

	c := &bgtaskhttp.Client{Base: srv.URL}
	got, err := c.Task(context.Background(), task.ID)
	fmt.Println(got.Status, "|", got.Result, "|", err)
	page, _ := c.Tasks(context.Background(), bgtask.Query{Parent: "chat"})
	fmt.Println(len(page.Tasks), page.Next == "")
	_, err = c.Task(context.Background(), "task-404")
	fmt.Println(errors.Is(err, bgtask.ErrUnknownTask))
	// Output:
	// completed | found 3 issues | <nil>
	// 1 true
	// true
}
