package riverbench

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5/pgxpool"
)

// floorConns is how many connections the floor commits from at once.
const floorConns = 32

// runFloor is the floor: p.count INSERTs of one small row (256 bytes),
// each in a transaction of its own (autocommit: the INSERT is the one
// statement, its COMMIT implicit), from floorConns connections at once,
// all connected before the measurement. Its figures are per commit.
func runFloor(ctx context.Context, s *server, p plan) (figures, error) {
	c := &counter{}
	pool, err := s.pool(ctx, "", floorConns, c)
	if err != nil {
		return figures{}, err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS riverbench_floor (id bigserial, data bytea)`); err != nil {
		return figures{}, err
	}
	row := make([]byte, 256)
	insert := func(conn *pgxpool.Conn) error {
		_, err := conn.Exec(ctx, `INSERT INTO riverbench_floor (data) VALUES ($1)`, row)
		return err
	}
	conns := make([]*pgxpool.Conn, floorConns)
	for i := range conns {
		conn, err := pool.Acquire(ctx)
		if err != nil {
			return figures{}, err
		}
		defer conn.Release()
		if err := insert(conn); err != nil { // its statement prepared
			return figures{}, err
		}
		conns[i] = conn
	}
	var next, ended atomic.Int64
	f, err := s.measure(ctx, p.count, c, func() error {
		var wg sync.WaitGroup
		errs := make([]error, len(conns))
		for i, conn := range conns {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for next.Add(1) <= int64(p.count) {
					if errs[i] = insert(conn); errs[i] != nil {
						return
					}
					ended.Add(1)
				}
			}()
		}
		wg.Wait()
		for _, err := range errs {
			if err != nil {
				return fmt.Errorf("floor: %w", err)
			}
		}
		return nil
	})
	f.ended = int(ended.Load())
	return f, err
}
