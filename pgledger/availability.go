package pgledger

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/puddle/v2"
)

// ErrUnavailable is the error of a call made while the database does not
// answer — a connection refused or dropped, a server restarting or shut
// down, a standby that refuses writes, a statement that ran out of its
// time. It is retryable: nothing of the call is known to have landed
// unless the error says so, and the same call made once the database
// answers again goes through. Test it with errors.Is.
var ErrUnavailable = errors.New("pgledger: the database is unavailable")

// transient reports whether err is the database being away (or busy)
// rather than a refusal: a statement that failed so may be tried again,
// and one whose outcome is unknown is resolved by trying it again (every
// write of the journal is idempotent).
func transient(err error) bool {
	if err == nil {
		return false
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		switch {
		case strings.HasPrefix(pe.Code, "08"): // connection exception
		case strings.HasPrefix(pe.Code, "53"): // insufficient resources (too many connections)
		case pe.Code == "57P01", pe.Code == "57P02", pe.Code == "57P03": // shut down, crashed, starting up
		case pe.Code == "57014": // a statement cancelled (its time ran out)
		case pe.Code == "25006": // a standby (read-only) answered: a failover in progress
		case pe.Code == "40001", pe.Code == "40P01", pe.Code == "55P03": // serialization, deadlock, lock not available
		default:
			return false
		}
		return true
	}
	// The caller's own end, and a pool its owner closed, are not the
	// database's absence.
	for _, known := range [...]error{ErrLeaseLost, ErrStale, ErrSessionTaken, ErrClosed, context.Canceled, puddle.ErrClosedPool} {
		if errors.Is(err, known) {
			return false
		}
	}
	// A network error, a closed or timed-out connection, a connection that
	// could not be made: the database did not answer.
	return true
}

// readOnly reports whether err is a standby's refusal of a write (SQLSTATE
// 25006): after a failover, the pool's connections may still be to the
// old server turned standby, and answer so until they are replaced.
func readOnly(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "25006"
}

// dbErr is the error of a call whose statement op failed with err: one
// that wraps ErrUnavailable if the database was away (the call may be
// made again), else the database's refusal.
func dbErr(op string, err error) error {
	if transient(err) {
		return fmt.Errorf("%w: %s: %w", ErrUnavailable, op, err)
	}
	return fmt.Errorf("pgledger: %s: %w", op, err)
}

// retryWait is the pause before the next try of a statement that failed
// with a transient error: it doubles from 20ms to a second.
func retryWait(prev time.Duration) time.Duration {
	if prev <= 0 {
		return 20 * time.Millisecond
	}
	return min(2*prev, time.Second)
}

// untilAnswered runs op until the database answers it (its error, or nil,
// is not transient), ctx ends, or done says to stop asking; it returns
// op's last error. The tries pause as retryWait says.
func untilAnswered(ctx context.Context, done func() bool, op func() error) error {
	for wait := time.Duration(0); ; {
		err := op()
		if err == nil || !transient(err) || ctx.Err() != nil || done() {
			return err
		}
		wait = retryWait(wait)
		sleepCtx(ctx, wait)
	}
}

// sleepCtx waits d, or until ctx ends (false).
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
