package pgtest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

var url string

func TestMain(m *testing.M) { Main(m, "pgtest", &url) }

// The server answers, on the package's own database.
func TestServerAnswers(t *testing.T) {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var db string
	if err := conn.QueryRow(ctx, "select current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	if db != "pgtest" {
		t.Fatalf("database %q, want pgtest", db)
	}
}

// Freeze stalls the server: a query on an open connection gets no answer
// until Thaw, and then it does. ReadOnly refuses writes with 25006 until
// it is turned off.
func TestFreezeAndReadOnly(t *testing.T) {
	srv, err := StartOwn("faults")
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "CREATE TABLE t (x int)"); err != nil {
		t.Fatal(err)
	}

	stopped, err := srv.Freeze()
	if err != nil {
		t.Fatal(err)
	}
	if len(stopped) < 2 {
		t.Fatalf("froze %v: the postmaster and its children, at least this connection's backend", stopped)
	}
	answered := make(chan error, 1)
	go func() {
		_, err := conn.Exec(ctx, "INSERT INTO t VALUES (1)")
		answered <- err
	}()
	other, cancelOther := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err = pgx.Connect(other, srv.URL)
	cancelOther()
	if err == nil {
		t.Fatal("a frozen server took a connection")
	}
	select {
	case err := <-answered:
		t.Fatalf("a frozen server answered: %v", err)
	default:
	}
	if err := srv.Thaw(stopped); err != nil {
		t.Fatal(err)
	}
	if err := <-answered; err != nil {
		t.Fatalf("after Thaw: %v", err)
	}

	if err := srv.ReadOnly(ctx, true); err != nil {
		t.Fatal(err)
	}
	// Each backend reads the new setting before its next statement, once
	// the reload reached it: a fresh connection is certain to have it.
	ro, err := pgx.Connect(ctx, srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close(context.Background())
	_, err = ro.Exec(ctx, "INSERT INTO t VALUES (2)")
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "25006" {
		t.Fatalf("a write on a read-only server: %v, want SQLSTATE 25006", err)
	}
	if err := srv.ReadOnly(ctx, false); err != nil {
		t.Fatal(err)
	}
	rw, err := pgx.Connect(ctx, srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer rw.Close(context.Background())
	if _, err := rw.Exec(ctx, "INSERT INTO t VALUES (3)"); err != nil {
		t.Fatalf("writable again: %v", err)
	}
}
