package pgledger_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/pgledger"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A fleet member: every process of the service joins the same ledger under
// its own member name. An event for a task launched here may reach any
// process (Node.Observe routes it), and Node.Stop of it with Tree, or of a
// session above it, from any process stops it; if this one dies, another
// takes its member over once its lease expires (with a bgtask.StatusHost it
// re-adopts the runs whose sessions are alive; a FuncHost's runs died with
// the process and end interrupt). (Not run: it needs a PostgreSQL server;
// the module's tests start one.)
func ExampleJoin() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := pgledger.Migrate(ctx, pool); err != nil { // once per deployment is enough; idempotent
		log.Fatal(err)
	}
	host := bgtask.NewFuncHost(func(ctx context.Context, run bgtask.Run) (string, error) {
		return "reviewed: " + run.Prompt, nil
	})
	node, err := pgledger.Join(ctx, pool, pgledger.NodeOptions{Member: "worker-1", Host: host})
	if err != nil {
		log.Fatal(err)
	}
	defer node.Close(ctx)

	task, err := node.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Prompt: "the diff", Models: []bgtask.Model{{ID: "m"}}})
	if err != nil {
		log.Fatal(err)
	}
	done, err := node.Manager().Wait(ctx, task.ID)
	fmt.Println(done.Status, done.Result, err)
}
