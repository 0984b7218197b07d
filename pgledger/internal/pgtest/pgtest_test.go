package pgtest

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
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
