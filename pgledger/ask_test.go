package pgledger

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A stop of one task another process owns is asked of that process: it
// stops the run, and the asker returns once the run has ended, with the
// report of what stopped and the actor recorded.
func TestAStopOfAnotherProcesssTaskIsMadeByItsOwner(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	ns := f.nodes(svc, 2, 0)
	task := running(t, ns[1], "chat")
	other := running(t, ns[1], "chat")

	rep, err := ns[0].Stop(ctx(t), bgtask.Target{Task: task.ID, Actor: "ops@example"})
	require.NoError(t, err)
	require.Len(t, rep.Stopped, 1)
	assert.Equal(t, task.Attempts[0].Token, rep.Stopped[0].Token)
	assert.Equal(t, bgtask.StatusCancelled, rep.Stopped[0].Status, "it returned once the run had stopped")
	assert.True(t, svc.aborted(task.SessionID))
	got := mustTask(t, ns[1], task.ID)
	assert.Equal(t, bgtask.StatusCancelled, got.Status)
	require.NotNil(t, got.Stop)
	assert.Equal(t, "ops@example", got.Stop.Actor)
	assert.Equal(t, bgtask.StatusRunning, mustTask(t, ns[1], other.ID).Status, "nothing else was touched")
	inboxesEmpty(t, f)

	// A run by its token: a token no longer current stops nothing.
	rep, err = ns[0].Stop(ctx(t), bgtask.Target{Run: bgtask.RunRef{TaskID: other.ID, Token: "not-its-token"}})
	require.NoError(t, err)
	assert.Empty(t, rep.Stopped)
	assert.Equal(t, bgtask.StatusRunning, mustTask(t, ns[1], other.ID).Status)

	// NoWait: the stop is recorded; the run is still live when it returns.
	g := svc.hold(other.SessionID)
	rep, err = ns[0].Stop(ctx(t), bgtask.Target{Task: other.ID, NoWait: true})
	require.NoError(t, err)
	require.Len(t, rep.Stopped, 1)
	assert.Equal(t, bgtask.StatusRunning, rep.Stopped[0].Status, "not stopped yet: said so")
	recv(t, g.asked, "the owner to abort the run")
	assert.Equal(t, bgtask.StatusRunning, mustTask(t, ns[1], other.ID).Status)
	close(g.release)
	ended, err := ns[1].Manager().Wait(ctx(t), other.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCancelled, ended.Status)
}

// The owner's refusal reaches the asker as the sentinel it is; a task no
// member has is unknown, and nothing is asked.
func TestAnOwnersRefusalIsTheAskersError(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	ns := f.nodes(svc, 2, 0)
	task := running(t, ns[1], "chat")

	n, err := ns[0].Extend(bgtask.WithActor(ctx(t), "ops@example"), task.ID, "and also this")
	require.NoError(t, err)
	assert.Equal(t, 2, n, "the launch prompt is invocation 1")
	assert.Equal(t, []string{"and also this"}, svc.promptsTo(task.SessionID))
	got := mustTask(t, ns[1], task.ID)
	require.Len(t, got.Invocations, 2)
	assert.Equal(t, "ops@example", got.Invocations[1].Actor, "who asked, recorded at the owner")

	_, err = ns[0].Stop(ctx(t), bgtask.Target{Task: task.ID})
	require.NoError(t, err)
	_, err = ns[0].Extend(ctx(t), task.ID, "too late")
	assert.ErrorIs(t, err, bgtask.ErrNotRunning, "%v", err)
	rep, err := ns[0].Stop(ctx(t), bgtask.Target{Task: task.ID})
	require.NoError(t, err, "a stop of an ended task stops nothing, as Manager.Stop's does")
	assert.Empty(t, rep.Stopped)

	_, err = ns[0].Extend(ctx(t), "no-such-task", "hello")
	assert.ErrorIs(t, err, bgtask.ErrUnknownTask)
	_, err = ns[0].Stop(ctx(t), bgtask.Target{Task: "no-such-task"})
	assert.ErrorIs(t, err, bgtask.ErrUnknownTask)
	_, err = ns[0].Extend(ctx(t), task.ID, "")
	assert.ErrorIs(t, err, bgtask.ErrInvalidArgument)
	inboxesEmpty(t, f)
}

// inboxesEmpty waits until every ask and answer left the inboxes: each
// is deleted once its drain handed it on, which may be just after the
// asker had its answer.
func inboxesEmpty(t *testing.T, f *fixture) {
	t.Helper()
	for f.count("bgtask_inbox", "") > 0 {
		recv(t, f.drained, "an inbox to be drained")
	}
}

// A task whose process died, with no process to take its member over,
// says so: the action fails with ErrOwnerGone (owner_gone), naming the
// member, and nothing is asked of anyone.
func TestAnActionOnATaskWhoseOwnerIsGoneSaysSo(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	dead := f.nodes(svc, 1, longLease)[0]
	task := running(t, dead, "chat")
	asker, err := Join(context.Background(), f.pool, NodeOptions{Ledger: f.ledger, Member: "asker", Host: svc, Poll: 50 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(tlog{t}, nil)), keepOut: true})
	require.NoError(t, err)
	closeAtEnd(t, asker)
	dead.kill()
	f.expire("w0")

	_, err = asker.Stop(ctx(t), bgtask.Target{Task: task.ID})
	require.ErrorIs(t, err, ErrOwnerGone)
	assert.Contains(t, err.Error(), "member w0")
	var coded interface{ Code() string }
	require.True(t, errors.As(err, &coded))
	assert.Equal(t, "owner_gone", coded.Code())
	_, err = asker.Extend(ctx(t), task.ID, "hello")
	assert.ErrorIs(t, err, ErrOwnerGone)
	assert.Equal(t, 0, f.count("bgtask_inbox", ""), "nothing was asked")
	assert.False(t, svc.aborted(task.SessionID))
}

// An owner that does not answer (it died after it took the ask) leaves
// the asker waiting no longer than its context, with an error that says
// the action may still take effect.
func TestAnAskNobodyAnswersEndsWithItsContext(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	ns := f.nodes(svc, 2, 0)
	task := running(t, ns[1], "chat")
	// The task is moved to a member with a live lease whose process does
	// not drain its inbox.
	_, err := f.pool.Exec(context.Background(), `INSERT INTO bgtask_members (ledger, member, fence, holder, expires_at) VALUES ($1, 'silent', 1, 'nobody', now() + interval '1 hour')`, f.ledger)
	require.NoError(t, err)
	_, err = f.pool.Exec(context.Background(), `UPDATE bgtask_tasks SET member = 'silent' WHERE ledger = $1 AND task_id = $2`, f.ledger, task.ID)
	require.NoError(t, err)
	short, cancel := context.WithTimeout(ctx(t), 300*time.Millisecond)
	defer cancel()
	_, err = ns[0].Stop(short, bgtask.Target{Task: task.ID})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Contains(t, err.Error(), "may still take effect")
	assert.Equal(t, 1, f.count("bgtask_inbox", "member = 'silent'"), "the ask waits in the silent member's inbox")
	assert.Equal(t, bgtask.StatusRunning, mustTask(t, ns[1], task.ID).Status)
}

// A task that ended needs no owner: a stop of it stops nothing and an
// extend is refused as not running, even once its process is gone.
func TestAnActionOnAnEndedTaskNeedsNoOwner(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	ns := f.nodes(svc, 2, 0)
	task := running(t, ns[1], "chat")
	require.NoError(t, ns[1].Observe(ctx(t), bgtask.Event{SessionID: task.SessionID, Kind: bgtask.SessionIdle, Text: "done"}))
	_, err := ns[1].Manager().Wait(ctx(t), task.ID)
	require.NoError(t, err)
	require.NoError(t, ns[1].Close(ctx(t))) // its lease ends now: it is gone, and no one takes an idle member over

	rep, err := ns[0].Stop(ctx(t), bgtask.Target{Task: task.ID})
	require.NoError(t, err, "not owner_gone: there is nothing to stop")
	assert.Empty(t, rep.Stopped)
	_, err = ns[0].Extend(ctx(t), task.ID, "more")
	assert.ErrorIs(t, err, bgtask.ErrNotRunning)
	assert.Equal(t, 0, f.count("bgtask_inbox", ""), "nothing was asked")
}

// A run that ends by itself while its stop is on the way was not
// stopped: the report says nothing stopped, as Manager.Stop's does.
func TestARunThatEndedByItselfWasNotStopped(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	ns := f.nodes(svc, 2, 0)
	task := running(t, ns[1], "chat")
	g := svc.hold(task.SessionID)
	done := stopping(t, ns[0], bgtask.Target{Task: task.ID})
	recv(t, g.asked, "the owner to abort the run")
	require.NoError(t, ns[1].Observe(ctx(t), bgtask.Event{SessionID: task.SessionID, Kind: bgtask.SessionIdle, Text: "finished first"}))
	close(g.release)
	r := recv(t, done, "the stop to return")
	require.NoError(t, r.err)
	got := mustTask(t, ns[1], task.ID)
	if got.Status == bgtask.StatusCancelled { // the abort won after all: then it was stopped, and says so
		require.Len(t, r.rep.Stopped, 1)
		return
	}
	assert.Equal(t, bgtask.StatusCompleted, got.Status)
	assert.Empty(t, r.rep.Stopped, "it ended by itself")
}

// An ask that reaches its owner after the asker stopped waiting is not
// acted on: the owner answers that it did nothing.
func TestAnAskPastItsTimeIsNotActedOn(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	ns := f.nodes(svc, 2, 0)
	task := running(t, ns[1], "chat")
	late := wireAsk{ID: "late", From: "w0", Until: time.Now().Add(-time.Minute), Stop: &wireTarget{Task: task.ID}}
	answer := make(chan wireAnswer, 1)
	ns[0].mu.Lock()
	ns[0].asks = map[string]chan wireAnswer{"late": answer}
	ns[0].mu.Unlock()
	require.NoError(t, ns[0].send(ctx(t), "w1", wireEvent{Ask: &late}))
	got := recv(t, answer, "the owner's answer")
	assert.ErrorIs(t, got.err(), context.DeadlineExceeded)
	assert.Contains(t, got.Err, "nothing was done")
	assert.Equal(t, bgtask.StatusRunning, mustTask(t, ns[1], task.ID).Status)
	assert.False(t, svc.aborted(task.SessionID))
	inboxesEmpty(t, f)
}

// stopped is what a Stop returned.
type stopped struct {
	rep bgtask.ClosureReport
	err error
}

// stopping calls n.Stop(t) on a goroutine of its own and delivers what
// it returned, once it did.
func stopping(t *testing.T, n *Node, target bgtask.Target) <-chan stopped {
	done := make(chan stopped, 1)
	go func() {
		rep, err := n.Stop(ctx(t), target)
		done <- stopped{rep, err}
	}()
	return done
}
