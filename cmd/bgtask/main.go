// Command bgtask looks inside bgtask: a journal directory, read-only, or a
// live bgtaskhttp service.
//
//	bgtask tasks DIR [-status S,...] [-parent SESSION] [-json]   list the tasks
//	bgtask task DIR|URL ID [-json]        one task: timeline, usage and budget, records (restarts included), outcome, envelope
//	bgtask records DIR|URL [ID] [-json]   every record in order, or one task's with the restarts and its parent's records
//	bgtask closures DIR [-json]       the branch closures recorded
//	bgtask follow URL [-json]         print a live service's tasks as they change (JSON: a task per line)
//	bgtask repair DIR [-n] [-json]    cut a corrupt journal at its damage, keeping a copy, after saying what it drops
//
// Flags may come before or after the arguments; an ID may be any prefix of
// a task's id that names one task. Errors go to stderr with exit status 1,
// usage errors with 2.
//
// A journal is read without its lock and without changing a byte, so it
// may belong to a running harness, or to one a crash left (a torn tail is
// reported, and left alone). A corrupt journal (a damaged record that
// complete records follow, which no crash leaves) is an error, exit status
// 1, naming where and what follows; repair is the one command that
// writes: it takes the journal's lock, says what it drops, keeps a copy,
// and cuts.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	neturl "net/url"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/internal/statusarg"
	"github.com/bgtask/bgtask/mirror"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(report(os.Stderr, err))
}

// report prints err, if any, with one "bgtask:" prefix, and returns the
// exit status: 0, 1 for an error, 2 for a usage error.
func report(w io.Writer, err error) int {
	if err == nil {
		return 0
	}
	msg := err.Error()
	for strings.HasPrefix(msg, "bgtask: ") { // the library's errors carry it too
		msg = strings.TrimPrefix(msg, "bgtask: ")
	}
	fmt.Fprintln(w, "bgtask:", msg)
	var u *usageError
	if errors.As(err, &u) {
		fmt.Fprintf(w, "run '%s -h' for usage\n", u.cmd)
		return 2
	}
	return 1
}

// usageError is a command line that cannot be run as written.
type usageError struct {
	cmd string // "bgtask" or "bgtask tasks": where -h helps
	err error
}

func (e *usageError) Error() string { return e.err.Error() }
func (e *usageError) Unwrap() error { return e.err }

func usagef(cmd, format string, args ...any) error {
	return &usageError{cmd: cmd, err: fmt.Errorf(format, args...)}
}

const usage = `bgtask looks inside bgtask: a journal directory, read without its lock and
without changing a byte (a running harness's, or one a crash left), or a
live bgtaskhttp service; and repairs a corrupt journal.

Usage:
  bgtask tasks DIR [-status S,...] [-parent SESSION] [-json]   list the tasks
  bgtask task DIR|URL ID [-json]    one task: timeline, usage and budget, records
                                    (a live service's: its history), outcome, envelope
  bgtask records DIR|URL [ID] [-json]  every record in order (restarts, parents' and
                                    closures' records included), or one task's
  bgtask closures DIR [-json]       the branch closures recorded
  bgtask follow URL [-json]         a live service's tasks as they change
  bgtask repair DIR [-n] [-json]    cut a corrupt journal at its damage, keeping a
                                    copy, after saying what it drops (-n: only say)

Flags may come before or after the arguments. An ID may be a prefix of a
task's id that names one task. Exit status: 0 done, 1 error, 2 usage error.
Run 'bgtask COMMAND -h' for a command's flags and an example.

Examples:
  bgtask tasks ./journal -status running
  bgtask records ./journal 7f3c       (a prefix of a task's id)
  bgtask follow http://127.0.0.1:8080
`

// command is a subcommand: its synopsis, what it does, an example, and
// how it runs once its flags are parsed.
type command struct {
	args    string // the positional arguments, for the synopsis
	about   string
	example string
	min     int // positional arguments: at least min, at most max
	max     int
	flags   func(fs *flag.FlagSet) // its flags beyond -json
	run     func(ctx context.Context, c *call) error
}

// call is one run of a command: its arguments, flags and outputs.
type call struct {
	name   string
	args   []string
	json   bool
	flags  *flag.FlagSet
	stdout io.Writer
	stderr io.Writer
}

var commands = map[string]*command{
	"tasks": {
		args:    "DIR",
		about:   "Lists the tasks of the journal in DIR, in launch order: id, status, parent session,\nattempts, current model, description.",
		example: "bgtask tasks ./journal -status running,pending -parent chat-1",
		min:     1, max: 1,
		flags: func(fs *flag.FlagSet) {
			fs.String("status", "", "only tasks in these statuses, comma-separated: "+statusarg.Names)
			fs.String("parent", "", "only tasks launched from this parent session")
		},
		run: tasksCmd,
	},
	"task": {
		args:    "DIR|URL ID",
		about:   "Shows one task: its state, its timeline (with its usage), the budget it spends\nfrom (spent, left, a limit reached), its records in order with the restarts\n(epochs) and its parent's records between them, its outcome and envelope.\nID may be a prefix of the task's id that names one task. With the http:// or\nhttps:// URL of a live bgtaskhttp service instead of a journal, the service's\ntask and its history (GET /tasks/{id}/history: with its lines of progress),\nby its whole id.",
		example: "bgtask task ./journal task-7",
		min:     2, max: 2,
		run: taskCmd,
	},
	"records": {
		args:    "DIR|URL [ID]",
		about:   "Prints every record of the journal in order: sequence, time, kind, task,\nattempt and what it changed — the restarts (epoch), the parent-level records\n(all_complete) and the closures included. With ID, the task's records and the\nepochs and records of its parent session from its first record to its last\n(to the end, for a live task): a restart between a run's start and its end shows.\nWith a live service's URL, a task's history (ID is then needed, whole).",
		example: "bgtask records ./journal task-7",
		min:     1, max: 2,
		run: recordsCmd,
	},
	"closures": {
		args:    "DIR",
		about:   "Lists the branch closures the journal recorded: each with what it stopped and\nwhat it could not.",
		example: "bgtask closures ./journal",
		min:     1, max: 1,
		run: closuresCmd,
	},
	"repair": {
		args: "DIR",
		about: "Repairs a corrupt journal: one with a damaged record that complete records\n" +
			"follow, which no crash leaves (a crash's torn tail is cut by any open, and\n" +
			"needs no repair). It first prints where the damage is and every record and\n" +
			"task the cut drops, then keeps a copy of what it cuts (the damaged segment's\n" +
			"bytes from the cut on, and every later segment) in DIR/cut-<time>, and cuts\n" +
			"the journal where the damaged commit begins. With -n it only prints. It takes\n" +
			"the journal's lock: stop the process that writes it first. With -json it prints\n" +
			"one document at the end: corrupt, repaired, the damage (segment, offset, cut,\n" +
			"dropped, tasks, copy) and the error, if any. Exit status 0 when the journal\n" +
			"opens afterwards (or needed nothing), 1 if it was not repaired.",
		example: "bgtask repair ./journal -n",
		min:     1, max: 1,
		flags: func(fs *flag.FlagSet) {
			fs.Bool("n", false, "only print what a repair would drop; change nothing")
		},
		run: repairCmd,
	},
	"follow": {
		args:    "URL",
		about:   "Follows a live bgtaskhttp service: prints its tasks, then a line for each task\nthat changes (with its usage, and its budget once spent; the timeline and the\nbudget once it ends), until interrupted. URL is the service's http:// or\nhttps:// address. An address that cannot be reached or is no bgtask service is\nan error at once; one that does not answer within 5s, an error then. Once\nfollowing, a dropped connection is said on stderr and retried with backoff, and\nso is the reconnection: resumed after the last change seen, or a new snapshot.\nWith -json, one JSON task per line.",
		example: "bgtask follow http://127.0.0.1:8080",
		min:     1, max: 1,
		run: followCmd,
	},
}

// run runs the command line args.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		return usagef("bgtask", "no command given: tasks, task, records, closures, follow or repair")
	}
	name, args := args[0], args[1:]
	switch name {
	case "-h", "-help", "--help", "help":
		if len(args) > 0 && commands[args[0]] != nil {
			fmt.Fprint(stdout, commandUsage(args[0], commands[args[0]]))
			return nil
		}
		fmt.Fprint(stdout, usage)
		return nil
	}
	cmd := commands[name]
	if cmd == nil {
		return usagef("bgtask", "unknown command %q: tasks, task, records, closures, follow or repair", name)
	}
	c := &call{name: name, stdout: stdout, stderr: stderr, flags: flag.NewFlagSet(name, flag.ContinueOnError)}
	c.flags.SetOutput(io.Discard)
	c.flags.BoolVar(&c.json, "json", false, "print JSON instead of text")
	if cmd.flags != nil {
		cmd.flags(c.flags)
	}
	var err error
	c.args, err = parse(c.flags, args)
	switch {
	case errors.Is(err, flag.ErrHelp):
		fmt.Fprint(stdout, commandUsage(name, cmd))
		return nil
	case err != nil:
		return usagef("bgtask "+name, "%s: %v", name, err)
	case len(c.args) < cmd.min:
		return usagef("bgtask "+name, "%s: missing %s (usage: bgtask %s %s)", name, strings.Fields(cmd.args)[len(c.args)], name, cmd.args)
	case len(c.args) > cmd.max:
		return usagef("bgtask "+name, "%s: unexpected argument %q (usage: bgtask %s %s)", name, c.args[cmd.max], name, cmd.args)
	}
	if i := slices.IndexFunc(c.args, func(a string) bool { return strings.TrimSpace(a) == "" }); i >= 0 {
		return usagef("bgtask "+name, "%s: %s is blank (usage: bgtask %s %s)", name, strings.Fields(cmd.args)[min(i, len(strings.Fields(cmd.args))-1)], name, cmd.args)
	}
	return cmd.run(ctx, c)
}

// parse parses args with fs, flags and positional arguments interleaved
// ("DIR -status running" as "-status running DIR"); after "--" all is
// positional.
func parse(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		if used := len(args) - len(rest); used > 0 && args[used-1] == "--" {
			return append(pos, rest...), nil
		}
		pos, args = append(pos, rest[0]), rest[1:]
	}
}

// commandUsage is name's -h.
func commandUsage(name string, cmd *command) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Usage: bgtask %s %s [flags]\n\n%s\n\nFlags (before or after the arguments):\n", name, cmd.args, cmd.about)
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.Bool("json", false, "print JSON instead of text")
	if cmd.flags != nil {
		cmd.flags(fs)
	}
	fs.SetOutput(&b)
	fs.PrintDefaults()
	fmt.Fprintf(&b, "\nExample:\n  %s\n", cmd.example)
	return b.String()
}

// parseStatuses reads -status's comma-separated list, each status as
// GET /tasks?status= reads it (statusarg).
func parseStatuses(s string) ([]bgtask.Status, error) {
	if s == "" {
		return nil, nil
	}
	var out []bgtask.Status
	for _, f := range strings.Split(s, ",") {
		st, err := statusarg.Parse(strings.TrimSpace(f))
		if err != nil {
			return nil, usagef("bgtask tasks", "tasks: -status: %v", err)
		}
		out = append(out, st)
	}
	return out, nil
}

// read reads the journal in c's first argument, saying on stderr if its
// tail was torn.
func (c *call) read() (bgtask.JournalView, error) {
	v, err := bgtask.ReadFileJournal(c.args[0])
	if err == nil && v.Torn != "" {
		fmt.Fprintf(c.stderr, "bgtask: note: the last record is torn (a crash mid-write, or a write in progress): %s; left as it is\n", v.Torn)
	}
	return v, err
}

// printJSON prints v as one indented JSON document.
func (c *call) printJSON(v any) error {
	enc := json.NewEncoder(c.stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func tasksCmd(_ context.Context, c *call) error {
	want, err := parseStatuses(c.flags.Lookup("status").Value.String())
	if err != nil {
		return err
	}
	parent := c.flags.Lookup("parent").Value.String()
	v, err := c.read()
	if err != nil {
		return err
	}
	tasks := []bgtask.Task{}
	for _, t := range v.Tasks {
		if (parent == "" || t.ParentSessionID == parent) && (want == nil || slices.Contains(want, t.Status)) {
			tasks = append(tasks, t)
		}
	}
	if c.json {
		err = c.printJSON(tasks)
	} else {
		tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "TASK\tSTATUS\tPARENT\tATTEMPTS\tMODEL\tDESCRIPTION")
		for _, t := range tasks {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", t.ID, t.Status, t.ParentSessionID, len(t.Attempts), t.Model, t.Description)
		}
		err = tw.Flush()
	}
	if err != nil {
		return err
	}
	if len(tasks) < len(v.Tasks) { // on stderr, whatever the format: a typo in -parent is no silent []
		fmt.Fprintf(c.stderr, "%d of %d tasks shown\n", len(tasks), len(v.Tasks))
	}
	return nil
}

// find finds the task id names in v: the task with that id, or else the
// one task whose id begins with it.
func find(v bgtask.JournalView, id, dir string) (bgtask.Task, error) {
	var matches []bgtask.Task
	for _, t := range v.Tasks {
		if t.ID == id {
			return t, nil
		}
		if strings.HasPrefix(t.ID, id) {
			matches = append(matches, t)
		}
	}
	switch {
	case len(matches) == 1:
		return matches[0], nil
	case len(matches) == 0:
		return bgtask.Task{}, fmt.Errorf("%w: no task of %s has an id that is or begins with %q (%d tasks: 'bgtask tasks %s' lists them)", bgtask.ErrUnknownTask, dir, id, len(v.Tasks), dir)
	}
	const shown = 5
	var ids []string
	for _, t := range matches[:min(shown, len(matches))] {
		ids = append(ids, t.ID)
	}
	more := ""
	if len(matches) > shown {
		more = fmt.Sprintf(" and %d more", len(matches)-shown)
	}
	return bgtask.Task{}, fmt.Errorf("task id prefix %q is ambiguous: %d tasks match: %s%s", id, len(matches), strings.Join(ids, ", "), more)
}

// remote reports whether c's first argument is a live service's URL
// rather than a journal's directory.
func (c *call) remote() bool {
	return strings.HasPrefix(c.args[0], "http://") || strings.HasPrefix(c.args[0], "https://")
}

// history is task id (a prefix, in a journal) and its history: from the
// journal in c's first argument, or from the live service at its URL
// (Client.Task and Client.History, by the whole id).
func (c *call) history(ctx context.Context, id string) (bgtask.Task, []bgtask.RecordView, error) {
	if c.remote() {
		client := &bgtaskhttp.Client{Base: c.args[0]}
		t, err := client.Task(ctx, id)
		if err != nil {
			return bgtask.Task{}, nil, err
		}
		recs, err := client.History(ctx, id)
		return t, recs, err
	}
	v, err := c.read()
	if err != nil {
		return bgtask.Task{}, nil, err
	}
	t, err := find(v, id, c.args[0])
	if err != nil {
		return bgtask.Task{}, nil, err
	}
	return t, v.RecordsOf(t), nil
}

func taskCmd(ctx context.Context, c *call) error {
	t, recs, err := c.history(ctx, c.args[1])
	if err != nil {
		return err
	}
	if c.json {
		return c.printJSON(struct {
			Task    bgtask.Task         `json:"task"`
			Records []bgtask.RecordView `json:"records"`
		}{t, recs})
	}
	w := c.stdout
	fmt.Fprintf(w, "%s  %s  parent %s", t.ID, t.Status, t.ParentSessionID)
	if t.Description != "" {
		fmt.Fprintf(w, "  %q", t.Description)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, bgtask.Timeline(t))
	if s := spending(t); s != "" {
		fmt.Fprintln(w, s)
	}
	fmt.Fprintln(w, "\nRecords:")
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, r := range recs {
		fmt.Fprintf(tw, "  %d\t%s\t%s\t%s\n", r.Seq, at(r.At, "15:04:05.000"), r.Kind, change(r))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if o := t.Outcome; o != nil {
		fmt.Fprintf(w, "\nOutcome: %s", o.State)
		if o.Reason != "" {
			fmt.Fprintf(w, " (%s)", o.Reason)
		}
		fmt.Fprintf(w, "\n\n%s\n", o.Envelope)
	}
	return nil
}

// spending is what the Timeline leaves out of t's spending: each
// attempt's usage when several reported any (the Timeline's "Usage:" line
// is the total), and the budget t spends from, if any — what its branch
// spent of each limit, what it has left, and whether a limit was reached.
// "" if there is neither.
func spending(t bgtask.Task) string {
	var lines []string
	if u := t.Usage; u != nil && len(u.ByAttempt) > 1 {
		for i, a := range u.ByAttempt {
			if !a.IsZero() {
				lines = append(lines, fmt.Sprintf("  attempt %d: %s", i+1, a))
			}
		}
	}
	if b := t.Budget; b != nil {
		whose := "its own"
		if b.TaskID != t.ID {
			whose = "task " + b.TaskID + "'s"
		}
		spent, left := b.Figures()
		line := "Budget (" + whose + "): spent " + spent
		if left != "" {
			line += "; left " + left
		}
		lines = append(lines, line)
		if b.Reserved > 0 {
			lines = append(lines, fmt.Sprintf("  %d launched, not yet started (a spawn each reserved)", b.Reserved))
		}
		switch {
		case b.Exceeded != "":
			lines = append(lines, "  EXCEEDED: its "+b.Exceeded+" limit was reached: the branch was stopped and launches in it are refused")
		case b.SoftReached:
			lines = append(lines, "  soft threshold reached (the parent was told)")
		}
	}
	return strings.Join(lines, "\n")
}

// change is r's change as a line says it: a record not about the task
// says whose it is.
func change(r bgtask.RecordView) string {
	switch {
	case r.TaskID == "" && r.ParentSessionID != "":
		return "[parent " + r.ParentSessionID + "] " + r.Change
	}
	return r.Change
}

func recordsCmd(ctx context.Context, c *call) error {
	var recs []bgtask.RecordView
	switch {
	case len(c.args) == 2:
		var err error
		if _, recs, err = c.history(ctx, c.args[1]); err != nil {
			return err
		}
	case c.remote():
		return usagef("bgtask records", "records: a live service's records are read a task at a time: bgtask records %s ID", c.args[0])
	default:
		v, err := c.read()
		if err != nil {
			return err
		}
		recs = v.Records
	}
	if c.json {
		if recs == nil {
			recs = []bgtask.RecordView{}
		}
		return c.printJSON(recs)
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SEQ\tTIME\tKIND\tTASK\tATTEMPT\tCHANGE")
	for _, r := range recs {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\n", r.Seq, at(r.At, "2006-01-02 15:04:05.000"), r.Kind, orDash(r.TaskID), orDash(r.AttemptID), change(r))
	}
	return tw.Flush()
}

// at formats t in layout; a record a compaction wrote has no time.
func at(t time.Time, layout string) string {
	if t.IsZero() {
		return "-"
	}
	return t.Local().Format(layout)
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func closuresCmd(_ context.Context, c *call) error {
	v, err := c.read()
	if err != nil {
		return err
	}
	if c.json {
		cl := v.Closures
		if cl == nil {
			cl = []bgtask.ClosureReport{}
		}
		return c.printJSON(cl)
	}
	w := c.stdout
	if len(v.Closures) == 0 {
		fmt.Fprintln(c.stderr, "no closure recorded")
	}
	for _, cl := range v.Closures {
		root := cl.SessionID
		if root == "" {
			root = "task " + cl.TaskID
		}
		fmt.Fprintf(w, "%s closed at %s: %d stopped, %d failed, %d passes\n", root, cl.At.Format("2006-01-02 15:04:05"), len(cl.Stopped), len(cl.Failed), cl.Passes)
		for _, s := range cl.Stopped {
			fmt.Fprintf(w, "  stopped %s %s (session %s) %s\n", s.TaskID, s.AttemptID, s.SessionID, s.Status)
		}
		for _, f := range cl.Failed {
			fmt.Fprintf(w, "  FAILED  %s %s (session %s): %s\n", f.TaskID, f.AttemptID, f.SessionID, f.Err)
		}
	}
	return nil
}

// Following a service: how long a connection may take to open, and the
// service to answer once it is open (an address that accepts connections
// but never answers is reported as promptly as one that refuses them);
// and how long the stream may say nothing before it is taken for dead
// (the service sends a keepalive every 15s by default). A variable, for
// the tests.
var dialTimeout = 5 * time.Second

const streamTimeout = 45 * time.Second

// serviceURL says what is wrong with u as the address of a service to
// follow, as a usage error: it must be an http:// or https:// URL.
func serviceURL(u string) error {
	if p, err := neturl.Parse(u); err == nil && (p.Scheme == "http" || p.Scheme == "https") && p.Host != "" {
		return nil
	}
	if !strings.Contains(u, "://") && !strings.ContainsAny(u, " \t") {
		return usagef("bgtask follow", "follow: %q is not a URL: write http://%s", u, u)
	}
	return usagef("bgtask follow", "follow: %q is not an http:// or https:// URL (like http://127.0.0.1:8080)", u)
}

// followCmd prints a live service's tasks as they change, until ctx ends.
func followCmd(ctx context.Context, c *call) error {
	url := c.args[0]
	if err := serviceURL(url); err != nil {
		return err
	}
	ready := make(chan struct{})
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.DialContext = (&net.Dialer{Timeout: dialTimeout, KeepAlive: 30 * time.Second}).DialContext
	tr.ResponseHeaderTimeout = dialTimeout // else a silent address would fail only at streamTimeout
	defer tr.CloseIdleConnections()
	client := &bgtaskhttp.Client{Base: url, HTTP: &http.Client{Transport: tr}, IdleTimeout: streamTimeout,
		Reconnect: func(err error, wait time.Duration) error {
			select {
			case <-ready:
			default: // never followed: a dead, refusing or wrong address
				return err
			}
			fmt.Fprintf(c.stderr, "bgtask: connection lost: %v; reconnecting in %s\n", err, wait.Round(time.Millisecond))
			return nil
		},
		Reconnected: func(after string, snapshot bool) {
			if snapshot {
				fmt.Fprintln(c.stderr, "bgtask: reconnected; took a new snapshot")
				return
			}
			fmt.Fprintf(c.stderr, "bgtask: reconnected; resumed after %s\n", after)
		}}
	var mir mirror.Mirror
	var ferr error // Follow's, once joined is closed
	joined := make(chan struct{})
	fctx, stopFollow := context.WithCancel(ctx)
	go func() {
		defer close(joined)
		ferr = client.Follow(fctx, &mir, ready)
		stopFollow() // ends the wait below
	}()
	defer func() {
		stopFollow()
		<-joined
	}()
	select {
	case <-ready:
	case <-joined:
		return fmt.Errorf("cannot follow %s: %w", url, ferr)
	}
	shown := map[string]string{} // task id → what was printed last
	for {
		now := mir.Tasks() // what is printed is what the next wait compares against
		for _, t := range now {
			line := strings.TrimSpace(fmt.Sprintf("%s %s attempts=%d %s%s %s", t.ID, t.Status, len(t.Attempts), t.Model, spent(t), t.Progress))
			key := line
			if c.json { // every change of the task, not only of its line
				key = fmt.Sprintf("%d %s %s", t.Revision, t.Activity, t.Progress)
			}
			if shown[t.ID] == key {
				continue
			}
			shown[t.ID] = key
			if c.json {
				b, err := json.Marshal(t)
				if err != nil {
					return err
				}
				fmt.Fprintf(c.stdout, "%s\n", b)
				continue
			}
			fmt.Fprintln(c.stdout, line)
			if t.Status.Terminal() {
				fmt.Fprintln(c.stdout, indent(bgtask.Timeline(t)))
				if s := spending(t); s != "" {
					fmt.Fprintln(c.stdout, indent(s))
				}
			}
		}
		if err := mir.Wait(fctx, func(tasks []bgtask.Task) bool { return changed(now, tasks) }); err != nil {
			<-joined
			if ctx.Err() != nil {
				return nil // interrupted: done
			}
			return fmt.Errorf("following %s: %w", url, ferr)
		}
	}
}

// spent is t's usage and budget as a followed task's line says them
// (" tokens=600 requests=2 cost=1.10 budget=exceeded:tokens"), or "".
func spent(t bgtask.Task) string {
	var s string
	if u := t.Usage; u != nil {
		s = fmt.Sprintf(" tokens=%d requests=%d cost=%s", u.Total.Tokens(), u.Total.Requests, u.Total.Cost)
	}
	if b := t.Budget; b != nil && b.Exceeded != "" {
		s += " budget=exceeded:" + b.Exceeded
	}
	return s
}

func changed(a, b []bgtask.Task) bool {
	if len(a) != len(b) {
		return true
	}
	for i := range a {
		if a[i].ID != b[i].ID || a[i].Revision != b[i].Revision || a[i].Progress != b[i].Progress || a[i].Activity != b[i].Activity {
			return true
		}
	}
	return false
}

func indent(s string) string { return "  " + strings.ReplaceAll(s, "\n", "\n  ") }

// repairCmd says what a repair of the journal in c's first argument drops,
// and (but with -n) makes it. With -json it prints one document at the
// end: {"corrupt": false}, or {"corrupt": true, "repaired": ..., "damage":
// the *CorruptError, "error": why not}.
func repairCmd(_ context.Context, c *call) error {
	dir := c.args[0]
	dry := c.flags.Lookup("n").Value.String() == "true"
	_, err := bgtask.ReadFileJournal(dir)
	var ce *bgtask.CorruptError
	if !errors.As(err, &ce) {
		if err != nil {
			return err
		}
		copies, _ := filepath.Glob(filepath.Join(dir, "cut-*"))
		if c.json {
			return c.printJSON(map[string]any{"corrupt": false, "copies": copies})
		}
		fmt.Fprintf(c.stdout, "%s is not corrupt: nothing to repair\n", dir)
		if len(copies) > 0 {
			fmt.Fprintf(c.stdout, "what earlier repairs cut is kept in %s\n", strings.Join(copies, ", "))
		}
		return nil
	}
	done := func(repaired bool, why error) error {
		if !c.json {
			return why
		}
		doc := map[string]any{"corrupt": true, "repaired": repaired, "damage": ce}
		if why != nil {
			doc["error"] = why.Error()
		}
		if err := c.printJSON(doc); err != nil {
			return err
		}
		return why
	}
	if dry {
		if !c.json {
			if err := c.printRepair(ce, false); err != nil {
				return err
			}
		}
		return done(false, errors.New("repair -n: nothing changed; the journal is still corrupt"))
	}
	// The repair itself reads the journal again, under its lock: what it
	// drops is what it reports here, said before it writes.
	said := false
	j, err := bgtask.OpenFileJournal(dir, bgtask.WithRepair(func(cut *bgtask.CorruptError) error {
		ce, said = cut, true // what the repair does: its copy's name is its own
		if c.json {
			return nil
		}
		return c.printRepair(cut, true)
	}))
	if err != nil {
		if !said && !c.json { // refused before it looked (a live process holds it): what it would do
			_ = c.printRepair(ce, false)
		}
		return done(false, fmt.Errorf("not repaired: %w", err))
	}
	if err := j.Close(); err != nil {
		return done(true, err)
	}
	if !c.json {
		fmt.Fprintf(c.stdout, "repaired: the journal opens; what was cut is in %s\n", ce.Copy)
	}
	return done(true, nil)
}

// printRepair prints what a repair of ce drops.
func (c *call) printRepair(ce *bgtask.CorruptError, cutting bool) error {
	fmt.Fprintf(c.stdout, "%s is corrupt: %s at offset %d: %s\n", filepath.Dir(ce.Segment), filepath.Base(ce.Segment), ce.Offset, ce.Why)
	verb := "would cut"
	if cutting {
		verb = "cuts"
	}
	fmt.Fprintf(c.stdout, "a repair %s %s at offset %d", verb, filepath.Base(ce.Segment), ce.Cut)
	if len(ce.Later) > 0 {
		names := make([]string, len(ce.Later))
		for i, l := range ce.Later {
			names[i] = filepath.Base(l)
		}
		fmt.Fprintf(c.stdout, " and sets aside %s", strings.Join(names, ", "))
	}
	fmt.Fprintf(c.stdout, ", keeping a copy in %s\n", ce.Copy)
	fmt.Fprintf(c.stdout, "it drops %d complete records of %d tasks", len(ce.Dropped), len(ce.Tasks))
	if len(ce.Tasks) > 0 {
		fmt.Fprintf(c.stdout, " (%s)", strings.Join(ce.Tasks, ", "))
	}
	fmt.Fprintln(c.stdout, ":")
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SEQ\tKIND\tTASK\tCHANGE")
	for _, r := range ce.Dropped {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\n", r.Seq, r.Kind, orDash(r.TaskID), r.Change)
	}
	return tw.Flush()
}
