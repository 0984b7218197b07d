package pgtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
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
	want := "pgtest" // or, on the server BGTASK_PG_URL names, named after its database
	if env := os.Getenv(EnvURL); env != "" {
		if want, err = dbFor(env, "pgtest"); err != nil {
			t.Fatal(err)
		}
	}
	if db != want {
		t.Fatalf("database %q, want %q", db, want)
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

// currentDB is the database url connects to.
func currentDB(t *testing.T, url string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connecting to %s: %v", url, err)
	}
	defer conn.Close(context.Background())
	var db string
	if err := conn.QueryRow(ctx, "select current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	return db
}

// run runs sql on url.
func run(t *testing.T, url, sql string) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connecting to %s: %v", url, err)
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, sql)
	return err
}

// The database BGTASK_PG_URL names is honoured and never dropped: each
// test binary's fresh database is named after it, and made afresh on
// each Start; Open uses it as it is. A URL that names none gets the
// package's name; one too long to name after is refused.
func TestTheDatabaseTheURLNamesIsHonoured(t *testing.T) {
	srv, err := StartOwn("userdb")
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	if err := run(t, srv.URL, "CREATE TABLE keep (x int)"); err != nil {
		t.Fatal(err)
	}

	t.Setenv(EnvURL, srv.URL)
	first, err := Start("pkg")
	if err != nil {
		t.Fatal(err)
	}
	if db := currentDB(t, first.URL); db != "userdb_pkg" {
		t.Fatalf("the package's database is %q, want userdb_pkg: named after the URL's", db)
	}
	if err := run(t, first.URL, "CREATE TABLE leftover (x int)"); err != nil {
		t.Fatal(err)
	}
	again, err := Start("pkg") // the next run of the same test binary
	if err != nil {
		t.Fatal(err)
	}
	if err := run(t, again.URL, "SELECT * FROM leftover"); err == nil {
		t.Fatal("the package's database was not made afresh")
	}
	if err := run(t, srv.URL, "SELECT * FROM keep"); err != nil {
		t.Fatalf("the database the URL names was changed: %v", err)
	}
	opened, err := Open("pkg")
	if err != nil {
		t.Fatal(err)
	}
	if opened.URL != srv.URL || currentDB(t, opened.URL) != "userdb" {
		t.Fatalf("Open: %s, want the URL's own database as it is", opened.URL)
	}

	cfg, err := pgx.ParseConfig(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	kv := fmt.Sprintf("host=%s port=%d user=%s dbname=userdb sslmode=disable", cfg.Host, cfg.Port, cfg.User)
	t.Setenv(EnvURL, kv)
	keyed, err := Start("kv")
	if err != nil {
		t.Fatal(err)
	}
	if db := currentDB(t, keyed.URL); db != "userdb_kv" {
		t.Fatalf("a key=value URL: database %q, want userdb_kv", db)
	}

	t.Setenv("PGDATABASE", "")
	t.Setenv(EnvURL, fmt.Sprintf("host=%s port=%d user=%s sslmode=disable", cfg.Host, cfg.Port, cfg.User))
	unnamed, err := Start("bare")
	if err != nil {
		t.Fatal(err)
	}
	if db := currentDB(t, unnamed.URL); db != "bare" {
		t.Fatalf("a URL that names no database: %q, want the package's name, bare", db)
	}

	long := strings.Repeat("d", 60)
	if err := run(t, srv.URL, "CREATE DATABASE "+long); err != nil {
		t.Fatal(err)
	}
	t.Setenv(EnvURL, kv+" dbname="+long)
	if _, err := Start("pkg"); err == nil || !strings.Contains(err.Error(), "63 bytes") {
		t.Fatalf("a name too long to derive from: %v, want it refused", err)
	}
	if _, err := createDB(srv.URL, "userdb"); err == nil {
		t.Fatal("createDB dropped the database it connects to")
	}
	if err := run(t, srv.URL, "SELECT * FROM keep"); err != nil {
		t.Fatalf("the database the URL names was changed: %v", err)
	}
}
