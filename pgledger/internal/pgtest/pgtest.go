// Package pgtest starts a throwaway PostgreSQL server for a test binary:
// initdb into a temporary directory (as the unprivileged "postgres" user
// when the tests run as root, since PostgreSQL refuses root), listening on
// a Unix socket in that directory only, and one database for the package.
//
// BGTASK_PG_URL, if set, names a server to use instead (a postgres:// URL
// or a key=value string, as pgx reads them). Every test binary still gets
// a fresh database of its own there — several run at once, and each
// drops what an earlier run of it left — created by Start (Main):
//
//   - if the URL names no database (and PGDATABASE names none), it is
//     named after the package: Start("fleet") makes "fleet";
//   - if it names one, say "ci_42", the package's is named after it:
//     "ci_42_fleet". The database the URL names is connected to, to
//     create that one, and never changed or dropped. A name that would be
//     longer than PostgreSQL's 63 bytes is refused: name a shorter one.
//
// The rest of the URL (user, password, TLS, options) is kept in the
// package's URL. A program that needs no fresh database (the fleet
// example: a fresh ledger each run) calls Open, which uses the database
// the URL names as it is.
package pgtest

import (
	"context"
	"errors"
	"fmt"
	neturl "net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"
)

// Server is a running server and the database made for the package.
type Server struct {
	URL  string              // the package's database
	dir  string              // the data directory, "" for a server not started here
	ctl  string              // pg_ctl
	cred *syscall.Credential // the postgres user commands run as (tests as root), or nil
	opts string              // the server's options (-o)
}

// postgresUser is the unprivileged user the server runs as when the tests
// run as root.
func postgresUser() (*syscall.Credential, error) {
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("pgtest: running as root needs the unprivileged user postgres (the Debian package makes it): %w", err)
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, err
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, err
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

// EnvURL is the variable that names a server to use instead of one of
// the package's own.
const EnvURL = "BGTASK_PG_URL"

// Start starts a server and creates database db in it, or, when EnvURL
// is set, creates a database for db in that server: db, or the name of
// the database the URL names followed by "_" and db (see the package
// doc). An earlier run's database of that name is dropped first.
func Start(db string) (*Server, error) {
	if url := os.Getenv(EnvURL); url != "" {
		name, err := dbFor(url, db)
		if err != nil {
			return nil, err
		}
		u, err := createDB(url, name)
		if err != nil {
			return nil, err
		}
		return &Server{URL: u}, nil
	}
	return StartOwn(db)
}

// Open is Start for a program that needs no fresh database: when EnvURL
// names a database, that database is used as it is — nothing is created
// or dropped; otherwise it is Start(db).
func Open(db string) (*Server, error) {
	if url := os.Getenv(EnvURL); url != "" {
		named, err := namedDB(url)
		if err != nil {
			return nil, err
		}
		if named != "" {
			return &Server{URL: url}, nil
		}
	}
	return Start(db)
}

// namedDB is the database url connects to, if it names one (or
// PGDATABASE does, for a URL that names none, as libpq reads them); ""
// if neither does.
func namedDB(url string) (string, error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return "", fmt.Errorf("pgtest: %s is not a connection string pgx reads: %w", EnvURL, err)
	}
	return cfg.Database, nil
}

// maxName is the longest name PostgreSQL keeps whole (NAMEDATALEN - 1):
// a longer one is cut, and two cut names could meet.
const maxName = 63

// dbFor is the name of the database a test binary that asks for db gets
// on the server url names: db, or the database url names followed by "_"
// and db.
func dbFor(url, db string) (string, error) {
	named, err := namedDB(url)
	if err != nil || named == "" {
		return db, err
	}
	name := named + "_" + db
	if len(name) > maxName {
		return "", fmt.Errorf("pgtest: %s names database %q: the tests' database %q would be longer than PostgreSQL's %d bytes; name a shorter database", EnvURL, named, name, maxName)
	}
	return name, nil
}

// StartOwn starts a server of its own (whatever BGTASK_PG_URL says), for a
// test that restarts or stops it (Restart, Halt, Resume), and creates
// database db.
func StartOwn(db string) (*Server, error) {
	bin, err := binDir()
	if err != nil {
		return nil, err
	}
	s := &Server{ctl: filepath.Join(bin, "pg_ctl")}
	s.dir, err = os.MkdirTemp("", "bgtask-pg-")
	if err != nil {
		return nil, err
	}
	if os.Geteuid() == 0 {
		cred, err := postgresUser()
		if err != nil {
			return nil, err
		}
		s.cred = cred
		if err := os.Chown(s.dir, int(cred.Uid), int(cred.Gid)); err != nil {
			return nil, err
		}
	}
	data := filepath.Join(s.dir, "data")
	if out, err := s.run(filepath.Join(bin, "initdb"), "-D", data, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"); err != nil {
		s.Stop()
		return nil, fmt.Errorf("pgtest: initdb: %v\n%s", err, out)
	}
	s.opts = fmt.Sprintf("-c listen_addresses='' -c unix_socket_directories=%s -c fsync=on -c max_connections=200", s.dir)
	if out, err := s.run(s.ctl, "-D", data, "-o", s.opts, "-l", filepath.Join(s.dir, "log"), "-w", "-t", "60", "start"); err != nil {
		log, _ := os.ReadFile(filepath.Join(s.dir, "log"))
		s.Stop()
		return nil, fmt.Errorf("pgtest: pg_ctl start: %v\n%s\n%s", err, out, log)
	}
	base := fmt.Sprintf("postgres:///postgres?host=%s&port=5432&user=postgres&sslmode=disable", s.dir)
	s.URL, err = createDB(base, db)
	if err != nil {
		s.Stop()
		return nil, err
	}
	return s, nil
}

// data is the server's data directory.
func (s *Server) data() string { return filepath.Join(s.dir, "data") }

// Restart restarts the server as an operator would (pg_ctl restart -m
// fast): every connection is ended ("terminating connection due to
// administrator command"), and the server is back on the same socket.
func (s *Server) Restart() error {
	if s.dir == "" {
		return errors.New("pgtest: a server not started here cannot be restarted")
	}
	if out, err := s.run(s.ctl, "-D", s.data(), "-o", s.opts, "-l", filepath.Join(s.dir, "log"), "-m", "fast", "-w", "-t", "60", "restart"); err != nil {
		return fmt.Errorf("pgtest: pg_ctl restart: %v\n%s", err, out)
	}
	return nil
}

// Halt stops the server (pg_ctl stop -m fast) until Resume.
func (s *Server) Halt() error {
	if s.dir == "" {
		return errors.New("pgtest: a server not started here cannot be stopped")
	}
	if out, err := s.run(s.ctl, "-D", s.data(), "-m", "fast", "-w", "-t", "60", "stop"); err != nil {
		return fmt.Errorf("pgtest: pg_ctl stop: %v\n%s", err, out)
	}
	return nil
}

// Resume starts a server Halt stopped, with the options it had.
func (s *Server) Resume() error {
	if out, err := s.run(s.ctl, "-D", s.data(), "-o", s.opts, "-l", filepath.Join(s.dir, "log"), "-w", "-t", "60", "start"); err != nil {
		return fmt.Errorf("pgtest: pg_ctl start: %v\n%s", err, out)
	}
	return nil
}

// Freeze stops every process of the server with SIGSTOP — the
// postmaster first, so that it forks no more, then each of its children —
// as a machine that stalls would: connections stay open and nothing
// answers, until Thaw. It returns the processes it stopped, for Thaw.
func (s *Server) Freeze() ([]int, error) {
	if s.dir == "" {
		return nil, errors.New("pgtest: a server not started here cannot be frozen")
	}
	pidFile, err := os.ReadFile(filepath.Join(s.data(), "postmaster.pid"))
	if err != nil {
		return nil, fmt.Errorf("pgtest: the server's pid: %w", err)
	}
	first, _, _ := strings.Cut(string(pidFile), "\n")
	pm, err := strconv.Atoi(strings.TrimSpace(first))
	if err != nil {
		return nil, fmt.Errorf("pgtest: the server's pid: %w", err)
	}
	if err := syscall.Kill(pm, syscall.SIGSTOP); err != nil {
		return nil, fmt.Errorf("pgtest: SIGSTOP of the postmaster: %w", err)
	}
	stopped := []int{pm}
	kids, err := children(pm)
	for _, k := range kids {
		if syscall.Kill(k, syscall.SIGSTOP) == nil {
			stopped = append(stopped, k)
		}
	}
	if err != nil {
		_ = s.Thaw(stopped)
		return nil, err
	}
	return stopped, nil
}

// Thaw lets the processes Freeze stopped go on (SIGCONT), its children
// first.
func (s *Server) Thaw(stopped []int) error {
	var errs []error
	for i := len(stopped) - 1; i >= 0; i-- {
		if err := syscall.Kill(stopped[i], syscall.SIGCONT); err != nil && !errors.Is(err, syscall.ESRCH) {
			errs = append(errs, fmt.Errorf("pgtest: SIGCONT of %d: %w", stopped[i], err))
		}
	}
	return errors.Join(errs...)
}

// children lists the processes whose parent is pid (from /proc).
func children(pid int) ([]int, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("pgtest: listing processes: %w", err)
	}
	var out []int
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue // gone meanwhile
		}
		// pid (comm) state ppid ...: comm may hold spaces and parentheses.
		i := strings.LastIndexByte(string(stat), ')')
		if i < 0 {
			continue
		}
		fields := strings.Fields(string(stat[i+1:]))
		if len(fields) > 1 && fields[1] == strconv.Itoa(pid) {
			out = append(out, p)
		}
	}
	return out, nil
}

// ReadOnly turns the server read-only (on) or writable again, as a
// failover's demoted primary is: every transaction begun after it is
// read-only (default_transaction_read_only), and a write fails with
// SQLSTATE 25006. It returns once a new connection has the setting; a
// connection already open takes it at its next statement.
func (s *Server) ReadOnly(ctx context.Context, on bool) error {
	conn, err := pgx.Connect(ctx, s.URL)
	if err != nil {
		return fmt.Errorf("pgtest: connecting: %w", err)
	}
	defer conn.Close(context.Background())
	// A session that is read-only by default can still change the server's
	// settings (ALTER SYSTEM writes a file, not a table).
	if _, err := conn.Exec(ctx, fmt.Sprintf("ALTER SYSTEM SET default_transaction_read_only = %t", on)); err != nil {
		return fmt.Errorf("pgtest: ALTER SYSTEM: %w", err)
	}
	if _, err := conn.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
		return fmt.Errorf("pgtest: reloading the configuration: %w", err)
	}
	// The reload is a signal the postmaster acts on in its time: until a
	// new connection has the setting, it is not in effect for new work.
	want := map[bool]string{true: "on", false: "off"}[on]
	for wait := time.Millisecond; ; wait = min(2*wait, 100*time.Millisecond) {
		fresh, err := pgx.Connect(ctx, s.URL)
		if err != nil {
			return fmt.Errorf("pgtest: connecting: %w", err)
		}
		var got string
		err = fresh.QueryRow(ctx, "SHOW default_transaction_read_only").Scan(&got)
		fresh.Close(context.Background())
		if err != nil {
			return fmt.Errorf("pgtest: reading the setting: %w", err)
		}
		if got == want {
			return nil
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("pgtest: the server never took default_transaction_read_only = %s: %w", want, ctx.Err())
		case <-t.C:
		}
	}
}

// Stop stops a server Start started and removes its directory.
func (s *Server) Stop() {
	if s == nil || s.dir == "" {
		return
	}
	_, _ = s.run(s.ctl, "-D", filepath.Join(s.dir, "data"), "-m", "immediate", "-w", "stop")
	_ = os.RemoveAll(s.dir)
}

// run runs a server command, as postgres when the tests run as root.
func (s *Server) run(name string, args ...string) ([]byte, error) {
	cmd := exec.Command(name, args...)
	if s.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred}
		cmd.Dir = s.dir
		cmd.Env = append(os.Environ(), "HOME="+s.dir)
	}
	return cmd.CombinedOutput()
}

// binDir finds the server's programs: pg_ctl on PATH, or Debian's
// /usr/lib/postgresql/<version>/bin.
func binDir() (string, error) {
	if p, err := exec.LookPath("pg_ctl"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		return filepath.Dir(p), nil
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin/pg_ctl")
	if len(dirs) > 0 {
		return filepath.Dir(dirs[len(dirs)-1]), nil
	}
	return "", errors.New("pgtest: no PostgreSQL server here (pg_ctl not found): install Debian's postgresql package, or set BGTASK_PG_URL")
}

// createDB creates database db on the server at url (dropping one left
// by an earlier run) and returns its URL: url with db for its database.
// It refuses to drop the database url connects to.
func createDB(url, db string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return "", fmt.Errorf("pgtest: connecting to %s: %w", url, err)
	}
	defer conn.Close(ctx)
	var current string
	if err := conn.QueryRow(ctx, "SELECT current_database()").Scan(&current); err != nil {
		return "", err
	}
	if current == db {
		return "", fmt.Errorf("pgtest: will not drop database %q: it is the one %s connects to", db, EnvURL)
	}
	name := pgx.Identifier{db}.Sanitize()
	if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
		return "", err
	}
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		return "", err
	}
	return withDB(url, db)
}

// withDB is url with db for its database: a postgres:// URL's path, or a
// key=value string's dbname (a later key wins).
func withDB(url, db string) (string, error) {
	if strings.HasPrefix(url, "postgres://") || strings.HasPrefix(url, "postgresql://") {
		u, err := neturl.Parse(url)
		if err != nil {
			return "", fmt.Errorf("pgtest: %w", err)
		}
		u.Path, u.RawPath = "/"+db, ""
		if q := u.Query(); q.Has("dbname") || q.Has("database") {
			q.Del("dbname")
			q.Del("database")
			u.RawQuery = q.Encode()
		}
		return u.String(), nil
	}
	return url + " dbname=" + quoteValue(db), nil
}

func quoteValue(v string) string {
	return "'" + strings.ReplaceAll(strings.ReplaceAll(v, `\`, `\\`), `'`, `\'`) + "'"
}

// Main runs a test binary's tests against a server started for it, with
// database db (its URL in *url), and fails when the server cannot start:
// these tests never skip. Leaked goroutines fail it too (goleak).
func Main(m *testing.M, db string, url *string, opts ...goleak.Option) {
	goleak.VerifyTestMain(runner{m: m, db: db, url: url}, opts...)
}

type runner struct {
	m   *testing.M
	db  string
	url *string
}

func (r runner) Run() int {
	s, err := Start(r.db)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer s.Stop()
	*r.url = s.URL
	return r.m.Run()
}
