package pgledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/wirecode"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// Actions on another process's task. A stop of one task (or run) and an
// Extend are the owner's to make: its Manager holds the run. A node that
// does not own the task asks the owner through its inbox — the way events
// are routed — and the owner answers through the asker's inbox, each
// woken by NOTIFY. The owner acts on its own goroutine, bounded by
// askFor, so an ask never holds up the events routed behind it.
//
// An ask is deleted from the inbox as the owner takes it: if the owner
// dies before it answers, the asker's wait ends at askFor (or its
// context) with an error that says the action may have taken effect.
// An answer to an asker that died is deleted by whoever drains its
// member's inbox next.

// askFor bounds an owner's action and an asker's wait for its answer.
const askFor = 30 * time.Second

// ErrOwnerGone matches the error of an action on a task whose process is
// gone: its member's lease lapsed and no process took it over yet (one
// that has live tasks is taken over within a Poll by a live node, which
// then acts on it). Nothing was asked of anyone. Over HTTP
// (bgtaskhttp) it is 503 owner_gone.
var ErrOwnerGone = ownerGone{}

type ownerGone struct{}

func (ownerGone) Error() string { return "pgledger: the process that owns the task is gone" }
func (ownerGone) Code() string  { return "owner_gone" }
func (ownerGone) Status() int   { return http.StatusServiceUnavailable }

// ownerGoneError is ErrOwnerGone for one task: its member, and since when.
type ownerGoneError struct {
	task, member string
	since        time.Time
}

func (e ownerGoneError) Error() string {
	return fmt.Sprintf("pgledger: task %s: the process that owns it (member %s) is gone: its lease lapsed at %s and no process has taken it over yet",
		e.task, e.member, e.since.UTC().Format(time.RFC3339))
}
func (e ownerGoneError) Is(target error) bool { return target == ErrOwnerGone }
func (e ownerGoneError) Code() string         { return ErrOwnerGone.Code() }
func (e ownerGoneError) Status() int          { return ErrOwnerGone.Status() }

// wireAsk is an action asked of a task's owner.
type wireAsk struct {
	ID   string `json:"id"`   // the asker's, to match the answer
	From string `json:"from"` // the member the answer goes to
	// Until is when the asker stops waiting: an owner that takes the ask
	// later (it was away, or took the member over) does not act on it.
	Until time.Time `json:"until"`
	// Stop is a stop of one task or run (never NoWait: the owner records
	// it and answers, and the asker waits, if its caller does).
	Stop *wireTarget `json:"stop,omitempty"`
	// Extend is an Extend of Task with Prompt.
	Extend *wireExtend `json:"extend,omitempty"`
}

type wireTarget struct {
	Task  string            `json:"task,omitempty"`
	Run   bgtask.RunRef     `json:"run,omitzero"`
	Cause *bgtask.StopCause `json:"cause,omitempty"`
	Actor string            `json:"actor,omitempty"`
}

type wireExtend struct {
	Task   string `json:"task"`
	Prompt string `json:"prompt"`
	Actor  string `json:"actor,omitempty"` // who asked (bgtask.WithActor)
}

// wireAnswer is the owner's answer to an ask.
type wireAnswer struct {
	ID         string               `json:"id"`
	Report     bgtask.ClosureReport `json:"report,omitzero"`
	Invocation int                  `json:"invocation,omitempty"`
	Err        string               `json:"err,omitempty"`
	Code       string               `json:"code,omitempty"` // the sentinel Err matches (wirecode)
}

// Extend is bgtask.Manager.Extend of task id, whichever process owns
// it: this node's Managers', or its owner's, asked through its inbox.
// Besides the Manager's errors it returns one matching ErrOwnerGone, and
// bgtask.ErrUnknownTask for a task no member of the ledger has.
func (n *Node) Extend(ctx context.Context, id, prompt string) (int, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	for _, m := range n.Managers() {
		if _, err := m.Task(id); err == nil {
			return m.Extend(ctx, id, prompt)
		}
	}
	if id == "" || prompt == "" {
		return n.Manager().Extend(ctx, id, prompt) // its own refusal of a blank argument
	}
	a, err := n.ask(ctx, id, wireAsk{Extend: &wireExtend{Task: id, Prompt: prompt, Actor: bgtask.ActorOf(ctx)}})
	return a.Invocation, err
}

// TakesPrompts says whether this process's Host takes prompts
// (bgtask.Prompter): what Extend needs. A fleet's processes run one kind
// of host, so a fleet's view offers extend on another process's running
// task where this one's host takes prompts (the owner says, if not).
func (n *Node) TakesPrompts() bool {
	_, ok := n.o.Host.(bgtask.Prompter)
	return ok
}

// stopElsewhere is Node.Stop of one task or run that no Manager of this
// node holds: the owner records the stop, and this waits, unless
// t.NoWait, until the run it stopped has ended.
func (n *Node) stopElsewhere(ctx context.Context, id string, t bgtask.Target) (bgtask.ClosureReport, error) {
	a, err := n.ask(ctx, id, wireAsk{Stop: &wireTarget{Task: t.Task, Run: t.Run, Cause: t.Cause, Actor: t.Actor}})
	if err != nil || t.NoWait || len(a.Report.Stopped) == 0 {
		return a.Report, err
	}
	status, err := n.untilEnded(ctx, id)
	rep := a.Report
	if err != nil {
		rep.Stopping, rep.Stopped = rep.Stopped, nil
		return rep, fmt.Errorf("%w: the stop of task %s is recorded, and its run had not stopped when the wait ended: %w", bgtask.ErrStopPending, id, err)
	}
	if status != bgtask.StatusCancelled { // it ended by itself first: the stop stopped nothing (as Manager.Stop says)
		return bgtask.ClosureReport{}, nil
	}
	rep.Stopped[0].Status = status
	return rep, nil
}

// untilEnded waits until the ledger's latest change of task id shows it
// ended, and returns its status.
func (n *Node) untilEnded(ctx context.Context, id string) (bgtask.Status, error) {
	t := time.NewTicker(n.o.Poll)
	defer t.Stop()
	for {
		wake := n.nextChange()
		var status bgtask.Status
		err := n.pool.QueryRow(ctx, `SELECT coalesce((SELECT body->>'status' FROM bgtask_changes WHERE ledger = $1 AND task_id = $2 ORDER BY id DESC LIMIT 1), '')`,
			n.o.Ledger, id).Scan(&status)
		if err == nil && status.Terminal() {
			return status, nil
		}
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-wake:
		case <-t.C:
		}
	}
}

// ask asks the owner of task id to act, and waits for its answer.
func (n *Node) ask(ctx context.Context, id string, a wireAsk) (wireAnswer, error) {
	ctx, cancel := context.WithTimeout(ctx, askFor)
	defer cancel()
	var owner string
	var live, ended bool
	var expires time.Time
	err := n.pool.QueryRow(ctx, `SELECT t.member, t.ended, coalesce(m.expires_at > now(), false), coalesce(m.expires_at, now())
  FROM bgtask_tasks t LEFT JOIN bgtask_members m ON m.ledger = t.ledger AND m.member = t.member
 WHERE t.ledger = $1 AND t.task_id = $2`, n.o.Ledger, id).Scan(&owner, &ended, &live, &expires)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return wireAnswer{}, fmt.Errorf("%w: %q: no member of ledger %s has it", bgtask.ErrUnknownTask, id, n.o.Ledger)
	case err != nil:
		return wireAnswer{}, dbErr("finding the owner of task "+id, err)
	case ended && a.Extend != nil: // whoever owned it, and whether or not it is there
		return wireAnswer{}, fmt.Errorf("%w: task %s has ended", bgtask.ErrNotRunning, id)
	case ended: // a stop of an ended task stops nothing, as Manager.Stop says
		return wireAnswer{}, nil
	case !live:
		return wireAnswer{}, ownerGoneError{task: id, member: owner, since: expires}
	}
	if mb := n.live(owner); mb != nil { // this node's (taken over since it looked, say)
		return n.act(ctx, mb, a)
	}
	a.ID, a.From = uuid.NewString(), n.o.Member
	if d, ok := ctx.Deadline(); ok {
		a.Until = d
	}
	answer := make(chan wireAnswer, 1)
	n.mu.Lock()
	if n.asks == nil {
		n.asks = map[string]chan wireAnswer{}
	}
	n.asks[a.ID] = answer
	n.mu.Unlock()
	defer func() {
		n.mu.Lock()
		delete(n.asks, a.ID)
		n.mu.Unlock()
	}()
	if err := n.send(ctx, owner, wireEvent{Ask: &a}); err != nil {
		return wireAnswer{}, err
	}
	select {
	case got := <-answer:
		return got, got.err()
	case <-ctx.Done():
		return wireAnswer{}, fmt.Errorf("pgledger: member %s did not answer in time (the action may still take effect): %w", owner, ctx.Err())
	}
}

// err is the answer's error, matching the sentinel it named.
func (a wireAnswer) err() error {
	if a.Err == "" {
		return nil
	}
	return &wirecode.Error{Text: a.Err, Code: a.Code}
}

// act makes ask a on mb's Manager: its answer, and the Manager's error.
func (n *Node) act(ctx context.Context, mb *member, a wireAsk) (wireAnswer, error) {
	out := wireAnswer{ID: a.ID}
	var err error
	switch {
	case !a.Until.IsZero() && time.Now().After(a.Until):
		err = fmt.Errorf("%w: the ask reached task %s's owner after its asker had stopped waiting: nothing was done", context.DeadlineExceeded, a.target())
	case a.Stop != nil:
		out.Report, err = mb.m.Stop(ctx, bgtask.Target{Task: a.Stop.Task, Run: a.Stop.Run, Cause: a.Stop.Cause, Actor: a.Stop.Actor, NoWait: true})
	case a.Extend != nil:
		out.Invocation, err = mb.m.Extend(bgtask.WithActor(ctx, a.Extend.Actor), a.Extend.Task, a.Extend.Prompt)
	default:
		err = fmt.Errorf("%w: an ask of nothing this node knows", bgtask.ErrInvalidArgument)
	}
	if err != nil {
		out.Err = err.Error()
		out.Code, _, _ = wirecode.Of(err)
	}
	return out, err
}

// target is the task an ask is about.
func (a wireAsk) target() string {
	switch {
	case a.Extend != nil:
		return a.Extend.Task
	case a.Stop != nil && a.Stop.Task != "":
		return a.Stop.Task
	case a.Stop != nil:
		return a.Stop.Run.TaskID
	}
	return ""
}

// answerAsk acts on a, asked of mb, on a goroutine the node owns, and
// sends the answer to the asker. The Manager's call (a Host's prompt, an
// abort asked) runs beside it, as a Notifier call does (n.stray): one
// that ignores its context holds up neither the answer, which says so
// at askFor, nor the node's Close beyond its context.
func (n *Node) answerAsk(mb *member, a wireAsk) {
	n.goOwned(func() {
		ctx, cancel := context.WithTimeout(n.loopCtx, askFor)
		defer cancel()
		done := make(chan wireAnswer, 1)
		n.stray.Add(1)
		go func() {
			defer n.stray.Done()
			out, _ := n.act(ctx, mb, a) // the error travels in the answer
			done <- out
		}()
		var out wireAnswer
		select {
		case out = <-done:
		case <-ctx.Done():
			out = wireAnswer{ID: a.ID, Code: "deadline_exceeded",
				Err: fmt.Sprintf("pgledger: member %s did not finish the action on task %s in time (it may still take effect)", mb.name, a.target())}
		}
		if err := n.send(ctx, a.From, wireEvent{Answer: &out}); err != nil {
			n.o.Logger.Warn("pgledger: answering an action asked by another process", "member", a.From, "err", err)
		}
	})
}

// answered hands an answer to the ask that waits for it, if one does.
func (n *Node) answered(a wireAnswer) {
	n.mu.Lock()
	ch := n.asks[a.ID]
	n.mu.Unlock()
	if ch != nil {
		select {
		case ch <- a:
		default: // answered already
		}
	}
}

// send puts w in member's inbox and wakes its owner, in one transaction.
// An answer goes only to a member whose lease is live: no one waits for
// it otherwise, and it would be left in an inbox no one drains.
func (n *Node) send(ctx context.Context, member string, w wireEvent) error {
	body, err := json.Marshal(w)
	if err != nil {
		return err
	}
	err = pgx.BeginFunc(ctx, n.pool, func(tx pgx.Tx) error {
		if w.Answer != nil {
			tag, err := tx.Exec(ctx, `INSERT INTO bgtask_inbox (ledger, member, event) SELECT $1, $2, $3
 WHERE EXISTS (SELECT 1 FROM bgtask_members WHERE ledger = $1 AND member = $2 AND expires_at > now())`, n.o.Ledger, member, body)
			if err != nil || tag.RowsAffected() == 0 {
				return err
			}
		} else if _, err := tx.Exec(ctx, `INSERT INTO bgtask_inbox (ledger, member, event) VALUES ($1, $2, $3)`, n.o.Ledger, member, body); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `SELECT pg_notify($1, $2)`, inboxChannel, n.o.Ledger+"\x1f"+member)
		return err
	})
	if err != nil {
		return dbErr("writing to the inbox of member "+member, err)
	}
	return nil
}

// Process is one member of the ledger as its lease shows it: the
// process that writes its tasks, or the one that took it over.
type Process struct {
	Member  string    `json:"member"`
	Holder  string    `json:"holder"` // the process that holds its lease (Options.Holder)
	Expires time.Time `json:"expires"`
	// Live says its lease has not lapsed; Idle, that it was given back
	// with nothing live (a member that is neither live nor idle is gone:
	// its live tasks wait for a takeover, and actions on them fail with
	// ErrOwnerGone).
	Live    bool `json:"live"`
	Idle    bool `json:"idle"`
	Running int  `json:"running"` // its tasks that have not ended
}

// Processes are the ledger's members, by name, with how many of their
// tasks have not ended.
func (n *Node) Processes(ctx context.Context) ([]Process, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	rows, err := n.pool.Query(ctx, `SELECT m.member, m.holder, m.expires_at, m.expires_at > now(), m.idle,
  (SELECT count(*) FROM bgtask_tasks t WHERE t.ledger = m.ledger AND t.member = m.member AND NOT t.ended)
  FROM bgtask_members m WHERE m.ledger = $1 ORDER BY m.member`, n.o.Ledger)
	if err != nil {
		return nil, dbErr("reading the members", err)
	}
	var out []Process
	var p Process
	_, err = pgx.ForEachRow(rows, []any{&p.Member, &p.Holder, &p.Expires, &p.Live, &p.Idle, &p.Running}, func() error {
		out = append(out, p)
		return nil
	})
	if err != nil {
		return nil, dbErr("reading the members", err)
	}
	return out, nil
}
