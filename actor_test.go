package bgtask

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A stop says who acted when its caller names them (Target.Actor): on
// the task it stopped (Task.Stop, the cause, the history), on a
// closure's report and record, and across a restart.
func TestAStopRecordsWhoActed(t *testing.T) {
	dir := t.TempDir()
	block := func(ctx context.Context, run Run) (string, error) { <-ctx.Done(); return "", ctx.Err() }
	j1, err := OpenFileJournal(dir)
	require.NoError(t, err)
	m1, err := Open(context.Background(), NewFuncHost(block), WithJournal(j1))
	require.NoError(t, err)
	ctx := context.Background()
	spec := func(parent string) Spec {
		return Spec{ParentSessionID: parent, Models: []Model{{Provider: "a", ID: "1"}}}
	}

	one, err := m1.Launch(ctx, spec("p1"))
	require.NoError(t, err)
	one = waitStatus(t, m1, one.ID, StatusRunning)
	_, err = m1.Stop(ctx, Target{Task: one.ID, Actor: "alice@example.com"})
	require.NoError(t, err)
	got, err := m1.Task(one.ID)
	require.NoError(t, err)
	require.Equal(t, StatusCancelled, got.Status)
	require.NotNil(t, got.Stop)
	assert.Equal(t, StopCause{Kind: StopCancel, Actor: "alice@example.com"}, *got.Stop)
	assert.Contains(t, got.Cause.Error(), "alice@example.com", "the cause names who acted")

	root, err := m1.Launch(ctx, spec("p2"))
	require.NoError(t, err)
	root = waitStatus(t, m1, root.ID, StatusRunning)
	kid, err := m1.Launch(ctx, spec(root.SessionID))
	require.NoError(t, err)
	waitStatus(t, m1, kid.ID, StatusRunning)
	rep, err := m1.Stop(ctx, Target{Task: root.ID, Tree: true, Actor: "bob"})
	require.NoError(t, err)
	assert.Equal(t, "bob", rep.Actor, "the closure's report")
	got, err = m1.Task(kid.ID)
	require.NoError(t, err)
	require.NotNil(t, got.Stop)
	assert.Equal(t, StopCause{Kind: StopClosure, TaskID: root.ID, Actor: "bob"}, *got.Stop, "each task the closure stopped")

	views, err := m1.History(ctx, one.ID)
	require.NoError(t, err)
	var said string
	for _, v := range views {
		if v.Kind == "stop_requested" {
			said = v.Change
		}
	}
	assert.Equal(t, "stop requested by cancel (alice@example.com): it ends cancelled", said)

	require.NoError(t, m1.Shutdown(ctx))
	j2, err := OpenFileJournal(dir)
	require.NoError(t, err)
	m2, err := Open(ctx, NewFuncHost(block), WithJournal(j2))
	require.NoError(t, err)
	defer func() { require.NoError(t, m2.Shutdown(context.Background())) }()
	got, err = m2.Task(one.ID)
	require.NoError(t, err)
	require.NotNil(t, got.Stop)
	assert.Equal(t, "alice@example.com", got.Stop.Actor, "a restart keeps who acted")
	got, err = m2.Task(kid.ID)
	require.NoError(t, err)
	assert.Equal(t, "bob", got.Stop.Actor)
	closures := m2.Snapshot().Closures
	require.NotEmpty(t, closures)
	assert.Equal(t, "bob", closures[len(closures)-1].Actor, "the closure's record")
}

// An actor is one line of printable text, at most 200 bytes.
func TestATargetsActorIsOneLine(t *testing.T) {
	for _, actor := range []string{"a\nb", "a\x1fb", "   ", strings.Repeat("x", 201), "tab\there"} {
		err := Target{Task: "t", Actor: actor}.Validate()
		assert.ErrorIs(t, err, ErrInvalidArgument, "%q", actor)
	}
	assert.NoError(t, Target{Task: "t", Actor: "Zoë Müller <zoe@example.com>"}.Validate())
	// A cause whose note or actor would read back as another actor.
	for _, c := range []*StopCause{{Kind: StopOther, Note: "x\x1fmallory"}, {Kind: StopCancel, Actor: "a\x1fb"}, {Kind: StopCancel, Actor: "two\nlines"}} {
		assert.ErrorIs(t, Target{Task: "t", Cause: c}.Validate(), ErrInvalidArgument, "%+v", *c)
	}
	assert.NoError(t, Target{Task: "t", Cause: &StopCause{Kind: StopOther, Note: "maintenance", Actor: "ops"}}.Validate())
	assert.NoError(t, Target{Session: "s", Actor: strings.Repeat("x", 200)}.Validate())
}

// A stop with a cause of its own keeps it, and adds who acted.
func TestAnActorWithACause(t *testing.T) {
	c := StopCause{Kind: StopOther, Note: "maintenance", Actor: "ops"}
	assert.Equal(t, c, stopCauseOf(c.note()))
	for _, c := range []StopCause{
		{Kind: StopCancel, Actor: "a"}, {Kind: StopClosure, Root: "s-1", Actor: "b"}, {Kind: StopClosure, TaskID: "t-1", Actor: "c"},
		{Kind: StopCaller, TaskID: "t-2", Actor: "d"}, {Kind: StopBudget, TaskID: "t-3", Limit: LimitTokens, Actor: "e"},
	} {
		assert.Equal(t, c, stopCauseOf(c.note()), "%+v reads back", c)
		assert.True(t, strings.HasSuffix(c.String(), "("+c.Actor+")"), c.String())
	}
}

// The context names who acts for calls that take no Target: Extend
// records the actor with the invocation (across a restart), and Stop
// with no Target.Actor records the context's. An actor that is not one
// line of printable text is made one.
func TestTheContextNamesWhoActs(t *testing.T) {
	assert.Equal(t, "carol", ActorOf(WithActor(context.Background(), " carol\n")))
	assert.Equal(t, "a b", ActorOf(WithActor(context.Background(), "a\x1f\x00 b")), "the separator and controls dropped")
	long := ActorOf(WithActor(context.Background(), strings.Repeat("é", 150)))
	assert.Len(t, long, 200, "cut at a character's boundary")
	assert.Equal(t, strings.Repeat("é", 100), long)
	assert.Empty(t, ActorOf(context.Background()))
	//lint:ignore SA1012 a nil context names no one
	assert.Empty(t, ActorOf(nil))

	dir := t.TempDir()
	answer := func(ctx context.Context, run Run) (string, error) {
		for {
			select {
			case <-run.Prompts(): // taken: admitted
			case <-ctx.Done():
				return "", ctx.Err()
			}
		}
	}
	j1, err := OpenFileJournal(dir)
	require.NoError(t, err)
	m1, err := Open(context.Background(), NewFuncHost(answer), WithJournal(j1))
	require.NoError(t, err)
	task, err := m1.Launch(context.Background(), Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}}})
	require.NoError(t, err)
	waitStatus(t, m1, task.ID, StatusRunning)
	n, err := m1.Extend(WithActor(context.Background(), "dave"), task.ID, "and this")
	require.NoError(t, err)
	got, err := m1.Task(task.ID)
	require.NoError(t, err)
	require.Len(t, got.Invocations, 2)
	assert.Equal(t, n, got.Invocations[1].N)
	assert.Equal(t, "dave", got.Invocations[1].Actor)
	assert.Empty(t, got.Invocations[0].Actor, "the launch prompt: no one in particular")
	require.NoError(t, m1.Shutdown(context.Background()))

	j2, err := OpenFileJournal(dir)
	require.NoError(t, err)
	m2, err := Open(context.Background(), NewFuncHost(answer), WithJournal(j2))
	require.NoError(t, err)
	defer func() { _ = m2.Shutdown(context.Background()) }()
	got, err = m2.Task(task.ID)
	require.NoError(t, err)
	require.Len(t, got.Invocations, 2)
	assert.Equal(t, "dave", got.Invocations[1].Actor, "across a restart")

	other, err := m2.Launch(context.Background(), Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}}})
	require.NoError(t, err)
	waitStatus(t, m2, other.ID, StatusRunning)
	_, err = m2.Stop(WithActor(context.Background(), "erin"), Target{Task: other.ID})
	require.NoError(t, err)
	got, err = m2.Task(other.ID)
	require.NoError(t, err)
	require.NotNil(t, got.Stop)
	assert.Equal(t, "erin", got.Stop.Actor, "the context's actor, as no Target named one")
}
