package riverbench

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// dbURL is the database pgtest made for this binary, on the server
// TestMain started: the floor's. River and pgledger each have a database
// of their own on the same server (riverDB, ledgerDB), named after it,
// so that runs on one server (BGTASK_PG_URL) keep to their own.
var dbURL string

// riverDB and ledgerDB are River's and pgledger's databases: the floor's
// name with _river and _pgledger (pgtest keeps the floor's well under
// PostgreSQL's 63 bytes).
func riverDB() string  { return floorDB() + "_river" }
func ledgerDB() string { return floorDB() + "_pgledger" }

func floorDB() string {
	cfg, err := pgx.ParseConfig(dbURL)
	if err != nil || cfg.Database == "" {
		return "riverbench"
	}
	return cfg.Database
}

// server is the one server of the run, as the measurements see it: an
// uncounted connection (the probe) that reads the WAL position and runs
// the clean-ups, and the postmaster whose processes' CPU time is read
// from /proc.
type server struct {
	probe      *pgx.Conn
	postmaster int // its pid; 0 when the server is not on this machine
}

// created guards the databases' creation: once per test binary.
var created struct {
	once sync.Once
	err  error
}

// openServer connects the probe, finds the postmaster, and creates River's
// and pgledger's databases (once per binary).
func openServer(ctx context.Context) (*server, error) {
	probe, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return nil, err
	}
	s := &server{probe: probe}
	created.once.Do(func() {
		for _, db := range []string{riverDB(), ledgerDB()} {
			if len(db) > 63 { // PostgreSQL would cut it, and two could meet
				created.err = fmt.Errorf("database name %q is over PostgreSQL's 63 bytes: name a shorter database in BGTASK_PG_URL", db)
				return
			}
			name := pgx.Identifier{db}.Sanitize()
			if _, err := probe.Exec(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
				created.err = err
				return
			}
			if _, err := probe.Exec(ctx, "CREATE DATABASE "+name); err != nil {
				created.err = err
				return
			}
		}
	})
	if created.err != nil {
		_ = probe.Close(ctx)
		return nil, fmt.Errorf("creating the databases: %w", created.err)
	}
	var backend int
	if err := probe.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&backend); err != nil {
		_ = probe.Close(ctx)
		return nil, err
	}
	// The probe's backend is a child of the postmaster, if it runs here.
	if st, ok := readStat(backend); ok && isPostgres(backend) && isPostgres(st.ppid) {
		s.postmaster = st.ppid
	}
	return s, nil
}

func (s *server) close() { _ = s.probe.Close(context.Background()) }

// pool opens a pool on database db (the floor's if ""), of conns
// connections at most, whose statements c counts.
func (s *server) pool(ctx context.Context, db string, conns int32, c *counter) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		return nil, err
	}
	if db != "" {
		cfg.ConnConfig.Database = db
	}
	cfg.MaxConns = conns
	cfg.ConnConfig.Tracer = c
	return pgxpool.NewWithConfig(ctx, cfg)
}

// quiesce readies the server for the next system: VACUUM in every
// database (the dead rows the last system left are gone, and autovacuum
// has nothing of its to do during the next one), then a CHECKPOINT (the
// last system's dirty pages are written out, and every system starts
// right after a checkpoint).
func (s *server) quiesce(ctx context.Context) error {
	cfg := s.probe.Config().Copy()
	for _, db := range []string{cfg.Database, riverDB(), ledgerDB()} {
		one := cfg.Copy()
		one.Database = db
		conn, err := pgx.ConnectConfig(ctx, one)
		if err != nil {
			return err
		}
		_, err = conn.Exec(ctx, `VACUUM`)
		_ = conn.Close(ctx)
		if err != nil {
			return fmt.Errorf("VACUUM in %s: %w", db, err)
		}
	}
	_, err := s.probe.Exec(ctx, `CHECKPOINT`)
	return err
}

// mark is a moment of a run: what the server and this process had spent
// by then.
type mark struct {
	at    time.Time
	lsn   string        // the server's WAL position (pg_current_wal_lsn)
	db    time.Duration // the server's CPU time (-1: not on this machine)
	self  time.Duration // this process's CPU time
	stmts int64         // the statements the system's pools sent (counter)
}

// mark reads the moment now: the WAL position and the CPU times first and
// the clock last at the start of a run (from is true), the clock first at
// its end, so that the probe's own work stays out of the measured time.
func (s *server) mark(ctx context.Context, c *counter, from bool) (mark, error) {
	var m mark
	if !from {
		m.at = time.Now()
		m.stmts = c.load()
	}
	if err := s.probe.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&m.lsn); err != nil {
		return mark{}, err
	}
	m.db = s.cpu()
	m.self = selfCPU()
	if from {
		m.stmts = c.load()
		m.at = time.Now()
	}
	return m, nil
}

// walBetween is how many bytes of WAL the server wrote from a to b.
func (s *server) walBetween(ctx context.Context, a, b mark) (int64, error) {
	var n int64
	err := s.probe.QueryRow(ctx, `SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::bigint`, b.lsn, a.lsn).Scan(&n)
	return n, err
}

// figures is what count operations (lifecycles, or commits for the floor)
// of one system cost, between two marks.
func (s *server) figures(ctx context.Context, count int, from, to mark) (figures, error) {
	wal, err := s.walBetween(ctx, from, to)
	if err != nil {
		return figures{}, err
	}
	f := figures{count: count, took: to.at.Sub(from.at), wal: wal, self: to.self - from.self, stmts: to.stmts - from.stmts, db: -1}
	if from.db >= 0 && to.db >= 0 {
		f.db = to.db - from.db
	}
	return f, nil
}

// userHZ is the unit of /proc's CPU times: 100 on every Linux there is
// (sysconf(_SC_CLK_TCK), which Go cannot ask without cgo).
const userHZ = 100

// procStat is what the benchmark reads of /proc/<pid>/stat: the parent, and
// the CPU time (in ticks) of the process and of its reaped children.
type procStat struct {
	ppid           int
	utime, stime   int64
	cutime, cstime int64
}

// readStat reads /proc/<pid>/stat (false if the process is gone or this
// is not Linux).
func readStat(pid int) (procStat, bool) {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procStat{}, false
	}
	// "pid (comm) state ppid ...": comm may hold spaces and parentheses,
	// so the fields are counted from the last ')'.
	i := strings.LastIndexByte(string(data), ')')
	if i < 0 {
		return procStat{}, false
	}
	f := strings.Fields(string(data[i+1:])) // f[0] is field 3 (state)
	if len(f) < 15 {
		return procStat{}, false
	}
	num := func(field int) int64 { v, _ := strconv.ParseInt(f[field-3], 10, 64); return v }
	return procStat{ppid: int(num(4)), utime: num(14), stime: num(15), cutime: num(16), cstime: num(17)}, true
}

// isPostgres says whether process pid is a PostgreSQL server process.
func isPostgres(pid int) bool {
	comm, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm")
	return err == nil && strings.HasPrefix(string(comm), "postgres")
}

// cpu is the server's CPU time: the postmaster's own and its reaped
// children's, and every living child's (backends, the checkpointer, the
// WAL writer, autovacuum): -1 if the server is not on this machine.
func (s *server) cpu() time.Duration {
	if s.postmaster == 0 {
		return -1
	}
	pm, ok := readStat(s.postmaster)
	if !ok {
		return -1
	}
	ticks := pm.utime + pm.stime + pm.cutime + pm.cstime
	dirs, err := os.ReadDir("/proc")
	if err != nil {
		return -1
	}
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		if st, ok := readStat(pid); ok && st.ppid == s.postmaster {
			ticks += st.utime + st.stime
		}
	}
	return time.Duration(ticks) * time.Second / userHZ
}

// selfCPU is this process's CPU time: the clients' side of every system
// (River's client, bgtask's Managers and pgledger's nodes, pgx).
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// counter counts the statements a system's pools send: every query and
// exec (BEGIN and COMMIT included), every query of a batch, every COPY.
// It is the pools' pgx tracer.
type counter struct{ n atomic.Int64 }

var (
	_ pgx.QueryTracer    = (*counter)(nil)
	_ pgx.BatchTracer    = (*counter)(nil)
	_ pgx.CopyFromTracer = (*counter)(nil)
)

func (c *counter) load() int64 { return c.n.Load() }

func (c *counter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c *counter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *counter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (c *counter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) { c.n.Add(1) }

func (c *counter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (c *counter) TraceCopyFromStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceCopyFromStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c *counter) TraceCopyFromEnd(context.Context, *pgx.Conn, pgx.TraceCopyFromEndData) {}
