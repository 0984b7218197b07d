// Command bgtask looks inside bgtask: a journal directory, read-only, or a
// live bgtaskhttp service.
//
//	bgtask tasks DIR [-parent SESSION] [-status STATUS]   list the tasks
//	bgtask task DIR ID                                   one task: timeline, records, outcome, envelope
//	bgtask closures DIR                                  the branch closures recorded
//	bgtask follow URL                                    print a live service's tasks as they change
//
// A journal is read without its lock and without changing a byte, so it
// may belong to a running harness, or to one a crash left (a torn tail is
// reported, and left alone).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"text/tabwriter"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/mirror"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "bgtask:", err)
		if errors.Is(err, errUsage) {
			os.Exit(2)
		}
		os.Exit(1)
	}
}

var errUsage = errors.New(`usage:
  bgtask tasks DIR [-parent SESSION] [-status STATUS]
  bgtask task DIR ID
  bgtask closures DIR
  bgtask follow URL`)

func run(ctx context.Context, args []string, w io.Writer) error {
	if len(args) < 2 {
		return errUsage
	}
	cmd, target, rest := args[0], args[1], args[2:]
	switch cmd {
	case "tasks":
		fs := flag.NewFlagSet("tasks", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		parent := fs.String("parent", "", "only tasks launched from this session")
		status := fs.String("status", "", "only tasks in this status")
		if err := fs.Parse(rest); err != nil {
			return fmt.Errorf("%w\n%v", errUsage, err)
		}
		v, err := read(target, w)
		if err != nil {
			return err
		}
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "TASK\tSTATUS\tPARENT\tATTEMPTS\tMODEL\tDESCRIPTION")
		for _, t := range v.Tasks {
			if (*parent != "" && t.ParentSessionID != *parent) || (*status != "" && string(t.Status) != *status) {
				continue
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", t.ID, t.Status, t.ParentSessionID, len(t.Attempts), t.Model, t.Description)
		}
		return tw.Flush()
	case "task":
		if len(rest) != 1 {
			return errUsage
		}
		v, err := read(target, w)
		if err != nil {
			return err
		}
		for _, t := range v.Tasks {
			if t.ID == rest[0] {
				showTask(w, t, v.Records)
				return nil
			}
		}
		return fmt.Errorf("%w: %q is in no record of %s", bgtask.ErrUnknownTask, rest[0], target)
	case "closures":
		v, err := read(target, w)
		if err != nil {
			return err
		}
		for _, c := range v.ClosureRecords {
			root := c.SessionID
			if root == "" {
				root = "task " + c.TaskID
			}
			fmt.Fprintf(w, "%s closed at %s: %d stopped, %d failed, %d passes\n", root, c.At.Format("2006-01-02 15:04:05"), len(c.Stopped), len(c.Failed), c.Passes)
			for _, s := range c.Stopped {
				fmt.Fprintf(w, "  stopped %s %s (session %s) %s\n", s.TaskID, s.AttemptID, s.SessionID, s.Status)
			}
			for _, f := range c.Failed {
				fmt.Fprintf(w, "  FAILED  %s %s (session %s): %s\n", f.TaskID, f.AttemptID, f.SessionID, f.Err)
			}
		}
		return nil
	case "follow":
		return follow(ctx, target, w)
	}
	return errUsage
}

// read reads a journal, saying if its tail was torn.
func read(dir string, w io.Writer) (bgtask.JournalView, error) {
	v, err := bgtask.ReadFileJournal(dir)
	if err == nil && v.Torn != "" {
		fmt.Fprintf(w, "note: the last record is torn (a crash mid-write, or a write in progress): %s; left as it is\n", v.Torn)
	}
	return v, err
}

// showTask prints t: its state, timeline, records and outcome.
func showTask(w io.Writer, t bgtask.Task, recs []bgtask.RecordView) {
	fmt.Fprintf(w, "%s  %s  parent %s", t.ID, t.Status, t.ParentSessionID)
	if t.Description != "" {
		fmt.Fprintf(w, "  %q", t.Description)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, bgtask.Timeline(t))
	fmt.Fprintln(w, "\nRecords:")
	for _, r := range recs {
		if r.TaskID == t.ID {
			fmt.Fprintf(w, "  %6d  %s  %-18s %s\n", r.Seq, r.At.Format("15:04:05.000"), r.Kind, r.Change)
		}
	}
	if o := t.Outcome; o != nil {
		fmt.Fprintf(w, "\nOutcome: %s", o.State)
		if o.Reason != "" {
			fmt.Fprintf(w, " (%s)", o.Reason)
		}
		fmt.Fprintf(w, "\n\n%s\n", o.Envelope)
	}
}

// follow prints a live service's tasks as they change, until ctx ends.
func follow(ctx context.Context, url string, w io.Writer) error {
	c := &bgtaskhttp.Client{Base: url}
	var mir mirror.Mirror
	ready := make(chan struct{})
	done := make(chan error, 1)
	fctx, followEnded := context.WithCancel(ctx) // ends the waits below when Follow returns
	defer followEnded()
	go func() {
		done <- c.Follow(ctx, &mir, ready)
		followEnded()
	}()
	select {
	case <-ready:
	case err := <-done:
		return err
	}
	shown := map[string]string{} // task id → what was printed last
	for {
		now := mir.Tasks() // what is printed is what the next wait compares against
		for _, t := range now {
			line := fmt.Sprintf("%s %s attempts=%d %s %s", t.ID, t.Status, len(t.Attempts), t.Model, t.Progress)
			if shown[t.ID] == line {
				continue
			}
			shown[t.ID] = line
			fmt.Fprintln(w, strings.TrimSpace(line))
			if t.Status.Terminal() {
				fmt.Fprintln(w, indent(bgtask.Timeline(t)))
			}
		}
		if err := mir.Wait(fctx, func(tasks []bgtask.Task) bool { return changed(now, tasks) }); err != nil {
			ferr := <-done
			if ctx.Err() != nil {
				return nil // interrupted: done
			}
			return ferr
		}
	}
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
