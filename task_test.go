package bgtask

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestLaunchRecordsFirstAttemptPending(t *testing.T) {
	block := make(chan struct{})
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		<-block
		return sid, nil
	}})
	task := h.launch("openai/gpt-5.4-mini", "google/gemini-2.5-flash-lite")

	require.Len(t, task.Attempts, 1)
	a := task.Attempts[0]
	assert.Equal(t, 1, a.Number)
	assert.Equal(t, StatusPending, a.Status)
	assert.Equal(t, PendingAwaitingSession, a.Pending)
	assert.Equal(t, "openai/gpt-5.4-mini", a.Model.String())
	assert.Empty(t, a.SessionID)
	assert.NotEmpty(t, a.Token)
	assert.Equal(t, a.ID, task.CurrentAttemptID)
	assert.Equal(t, StatusPending, task.Status, "Launch returns before the slow host answers")

	close(block)
	h.settle()
	got := h.task(task.ID)
	assert.Equal(t, StatusRunning, got.Status)
	assert.Equal(t, "ses-1", got.SessionID)
	assert.Equal(t, t0, got.StartedAt)
	checkInvariants(t, h.m)
}

func TestTaskIDsAreUnique(t *testing.T) {
	h := newHarness(t, nil, WithIDs(newUUIDs()))
	seen := map[string]bool{}
	for range 50 {
		task := h.launch("a/b")
		require.False(t, seen[task.ID], "task id %s reused", task.ID)
		seen[task.ID] = true
	}
}

// The default ids are random version 4 UUIDs (run tokens prefixed "run_"),
// distinct across generators: two Managers never share a token.
func TestDefaultIDsAreRandomUUIDs(t *testing.T) {
	a, b := newUUIDs(), newUUIDs()
	seen := map[string]bool{}
	for range 1000 {
		for i, g := range []*uuidIDs{a, b} {
			// One generator makes the pair one by one, the other (as the
			// ledger does) in one allocation.
			var id, tok string
			if i == 0 {
				id, tok = g.NewID(idAttempt), g.NewID(idToken)
			} else {
				id, tok = g.attemptIDs()
			}
			u, err := uuid.Parse(id)
			require.NoError(t, err, id)
			assert.Equal(t, uuid.Version(4), u.Version(), id)
			assert.Equal(t, uuid.RFC4122, u.Variant(), id)
			assert.Equal(t, u.String(), id)
			require.True(t, strings.HasPrefix(tok, "run_"), tok)
			v, err := uuid.Parse(strings.TrimPrefix(tok, "run_"))
			require.NoError(t, err, tok)
			assert.Equal(t, v.String(), strings.TrimPrefix(tok, "run_"))
			require.False(t, seen[id] || seen[tok], "id reused")
			seen[id], seen[tok] = true, true
		}
	}
}

func TestLaunchRejectsBadSpecs(t *testing.T) {
	ok := Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "b"}}}
	tests := []struct {
		name  string
		give  func(s *Spec)
		field string
	}{
		{name: "no parent, with a Notifier", give: func(s *Spec) { s.ParentSessionID = "" }, field: "ParentSessionID"},
		{name: "a white-space parent", give: func(s *Spec) { s.ParentSessionID = " \t" }, field: "ParentSessionID"},
		{name: "empty model id", give: func(s *Spec) { s.Models = []Model{{Provider: "a", ID: "b"}, {Provider: "c"}} }, field: "Models[1].ID"},
		{name: "blank provider", give: func(s *Spec) { s.Models = []Model{{Provider: " ", ID: "b"}} }, field: "Models[0].Provider"},
		{name: "negative max attempts", give: func(s *Spec) { s.MaxAttempts = -1 }, field: "MaxAttempts"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, nil)
			spec := ok
			spec.Models = append([]Model(nil), ok.Models...)
			tt.give(&spec)
			_, err := h.m.Launch(context.Background(), spec)
			require.Error(t, err)
			assert.ErrorIs(t, err, ErrInvalidArgument)
			var se *SpecError
			require.ErrorAs(t, err, &se)
			assert.Equal(t, tt.field, se.Field)
			assert.Contains(t, err.Error(), tt.field)
			assert.Empty(t, h.m.Snapshot().Tasks, "a rejected spec records nothing")
		})
	}
}

func TestRetryFinalizesFailedAttemptAndBindsNewSession(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("openai/gpt-5.4-mini", "google/gemini-2.5-flash-lite")
	h.settle()
	h.clock.Advance(time.Second)

	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: errForbidden}))
	h.settle()

	got := h.task(task.ID)
	require.Len(t, got.Attempts, 2)
	first, second := got.Attempts[0], got.Attempts[1]
	assert.Equal(t, StatusError, first.Status)
	assert.Equal(t, errForbidden.Error(), first.Error)
	assert.Equal(t, t0.Add(time.Second), first.CompletedAt)
	assert.Equal(t, "ses-1", first.SessionID)

	assert.Equal(t, StatusRunning, second.Status)
	assert.Equal(t, "ses-2", second.SessionID, "the retry attempt gets the new session")
	assert.Equal(t, "google/gemini-2.5-flash-lite", second.Model.String())
	assert.Equal(t, second.ID, got.CurrentAttemptID)
	assert.NotEqual(t, first.Token, second.Token)
	assert.Equal(t, StatusRunning, got.Status)
	assert.Equal(t, "ses-2", got.SessionID)

	starts := h.host.Starts()
	require.Len(t, starts, 2)
	assert.Equal(t, second.ID, starts[1].AttemptID, "the start is for the exact scheduled attempt")
	assert.Equal(t, []string{"ses-1"}, h.host.Aborts(), "the failed session is aborted before the retry")
}

func TestForbiddenProviderThenSuccessHasTwoAttempts(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("openai/gpt-5.4-mini", "google/gemini-2.5-flash-lite")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: errForbidden}))
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-2", Kind: SessionIdle, Text: "the answer"}))

	got := h.wait(task.ID)
	assert.Equal(t, StatusCompleted, got.Status)
	assert.Equal(t, "the answer", got.Result)
	require.Len(t, got.Attempts, 2)
	assert.Equal(t, []Status{StatusError, StatusCompleted}, []Status{got.Attempts[0].Status, got.Attempts[1].Status})
}

func TestSeveralFailedRetriesThenSuccessShowsFullChain(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("openai/gpt-5.4-mini", "anthropic/claude-haiku-4.5", "google/gemini-2.5-flash-lite")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: errForbidden}))
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-2", Kind: SessionError, Err: errRateLimited}))
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-3", Kind: SessionIdle, Text: "done"}))
	got := h.wait(task.ID)

	want := "Background task attempts:\n" +
		"- Attempt 1 — ERROR — openai/gpt-5.4-mini — ses-1\n" +
		"  Error: Forbidden: Selected provider is forbidden\n" +
		"- Attempt 2 — ERROR — anthropic/claude-haiku-4.5 — ses-2\n" +
		"  Error: Too Many Requests\n" +
		"- Attempt 3 — COMPLETED — google/gemini-2.5-flash-lite — ses-3"
	assert.Equal(t, want, Timeline(got))
}

func TestFailureWithNoFallbackHasOneTerminalAttempt(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("openai/gpt-5.4-mini")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: errForbidden}))
	got := h.wait(task.ID)
	require.Len(t, got.Attempts, 1)
	assert.Equal(t, StatusError, got.Status)
	assert.Equal(t, errForbidden.Error(), got.Error)
	h.settle()
	assert.Equal(t, []NotificationKind{NotifyFinalSummary}, h.rec.Kinds(task.ID))
}

func TestNonRetryableErrorsEndTheTask(t *testing.T) {
	tests := []struct {
		name string
		give error
	}{
		{name: "permanent", give: Permanent(errRateLimited)},
		{name: "wrapped permanent", give: errors.Join(errors.New("ctx"), Permanent(errForbidden))},
		{name: "context length", give: errors.New("context_length_exceeded: prompt is too long")},
		{name: "validation", give: errors.New("validation error: bad tool schema")},
		{name: "aborted", give: errors.New("The operation was aborted")},
		{name: "unrecognised", give: errors.New("something odd")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, nil)
			task := h.launch("a/one", "b/two")
			h.settle()
			require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: tt.give}))
			got := h.wait(task.ID)
			assert.Equal(t, StatusError, got.Status)
			assert.Len(t, got.Attempts, 1, "no retry")
		})
	}
}

func TestWithRetryableReplacesClassifierButNotPermanent(t *testing.T) {
	h := newHarness(t, nil, WithRetryable(func(err error, _ bool) bool { return strings.Contains(err.Error(), "odd") }))
	task := h.launch("a/one", "b/two", "c/three")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: errors.New("something odd")}))
	h.settle()
	assert.Len(t, h.task(task.ID).Attempts, 2, "the custom classifier retried")
	require.NoError(t, h.observe(Event{SessionID: "ses-2", Kind: SessionError, Err: Permanent(errors.New("odd but permanent"))}))
	got := h.wait(task.ID)
	assert.Len(t, got.Attempts, 2)
	assert.Equal(t, StatusError, got.Status)
}

func TestMaxAttempts(t *testing.T) {
	tests := []struct {
		name   string
		models []string
		max    int
		want   []string // model of each attempt made when every attempt fails
	}{
		{name: "zero means one per model", models: []string{"a/1", "b/2"}, max: 0, want: []string{"a/1", "b/2"}},
		{name: "more reuses the last model", models: []string{"a/1", "b/2"}, max: 4, want: []string{"a/1", "b/2", "b/2", "b/2"}},
		{name: "fewer caps the chain", models: []string{"a/1", "b/2", "c/3"}, max: 2, want: []string{"a/1", "b/2"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
				return "", errRateLimited
			}})
			task := h.launchSpec(Spec{ParentSessionID: "p", Models: mustModels(t, tt.models...), MaxAttempts: tt.max})
			got := h.wait(task.ID)
			var models []string
			for _, a := range got.Attempts {
				models = append(models, a.Model.String())
				assert.Equal(t, StatusError, a.Status)
				assert.Empty(t, a.SessionID)
			}
			assert.Equal(t, tt.want, models)
		})
	}
}

func TestSessionStartFailureFallsBack(t *testing.T) {
	needRecords(t)
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		if req.AttemptNumber == 1 {
			return "", errors.New("provider returned 503 Service Unavailable")
		}
		return sid, nil
	}})
	task := h.launch("a/one", "b/two")
	h.settle()
	got := h.task(task.ID)
	require.Len(t, got.Attempts, 2)
	first := got.Attempts[0]
	assert.Equal(t, StatusError, first.Status)
	assert.Empty(t, first.SessionID, "no session ever existed")
	assert.Contains(t, first.Error, "503")
	assert.Equal(t, StatusRunning, got.Status)
	assert.Equal(t, "ses-2", got.SessionID)
	assert.Empty(t, h.host.Aborts(), "nothing to abort")

	// The failed start was recorded as its own pending sub-state first.
	h.m.mu.Lock()
	var reasons []PendingReason
	for _, r := range recordsOf(h.m.led, task.ID) {
		if r.attempt.ID == first.ID && r.kind == recAttemptPending {
			reasons = append(reasons, r.attempt.Pending)
		}
	}
	h.m.unlock()
	assert.Equal(t, []PendingReason{PendingSessionFailed}, reasons)
}

func TestSessionStartFailureWithNoFallbackEndsInErrorWithNoSession(t *testing.T) {
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		return "", errors.New("boom")
	}})
	task := h.launch("a/one", "b/two")
	got := h.wait(task.ID)
	assert.Equal(t, StatusError, got.Status)
	require.Len(t, got.Attempts, 2, "a failed start is retried by default")
	assert.Empty(t, got.Attempts[1].SessionID)
	assert.Contains(t, Timeline(got), "— no session")
}

func TestStaleEventsFromSupersededSessionChangeNothing(t *testing.T) {
	for _, kind := range []EventKind{SessionBusy, SessionIdle, SessionError, SessionInterrupted, SessionDeleted, SessionCompacted} {
		t.Run(string(kind), func(t *testing.T) {
			h := newHarness(t, nil)
			task := h.launch("a/one", "b/two")
			h.settle()
			require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: errRateLimited}))
			h.settle()
			before := h.task(task.ID)
			require.Equal(t, "ses-2", before.SessionID)
			first := before.Attempts[0]

			for _, ev := range []Event{
				{SessionID: "ses-1", Kind: kind, Text: "late", Err: errForbidden},
				{AttemptID: first.ID, Kind: kind, Err: errForbidden},
				{SessionID: "ses-2", Token: first.Token, Kind: kind, Err: errForbidden},
			} {
				assert.ErrorIs(t, h.observe(ev), ErrStaleEvent)
			}
			h.settle()
			assert.Equal(t, before, h.task(task.ID), "nothing changed, revision included")
		})
	}
}

func TestEventsAfterTerminalChangeNothing(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("a/one", "b/two")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionIdle, Text: "ok"}))
	done := h.wait(task.ID)
	for _, kind := range []EventKind{SessionBusy, SessionIdle, SessionError, SessionInterrupted, SessionDeleted, SessionCompacted} {
		assert.ErrorIs(t, h.observe(Event{SessionID: "ses-1", Kind: kind, Err: errRateLimited}), ErrStaleEvent, kind)
	}
	h.settle()
	assert.Equal(t, done, h.task(task.ID))
	assert.Equal(t, []NotificationKind{NotifyFinalSummary}, h.rec.Kinds(task.ID), "one final summary")
}

func TestCompactionThenBusyKeepsTaskRunning(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("a/one")
	h.settle()
	before := h.task(task.ID)
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionCompacted}))
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionBusy}))
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionCompacted}))
	got := h.task(task.ID)
	assert.Equal(t, StatusRunning, got.Status)
	assert.Equal(t, before.Revision, got.Revision)
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionIdle, Text: "after compaction"}))
	assert.Equal(t, StatusCompleted, h.wait(task.ID).Status)
}

func TestUnknownSessionIsRejectedAndLogged(t *testing.T) {
	h := newHarness(t, nil)
	assert.ErrorIs(t, h.observe(Event{SessionID: "nobody", Kind: SessionIdle}), ErrUnknownSession)
	assert.ErrorIs(t, h.observe(Event{AttemptID: "no-attempt", Kind: SessionIdle}), ErrUnknownSession)
	recs := h.logs.Records()
	require.NotEmpty(t, recs)
	assert.Equal(t, "DEBUG", recs[0]["level"])
	assert.Equal(t, "nobody", recs[0]["session"])
}

func TestStaleEventIsLoggedWithIdentity(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("a/one")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionIdle}))
	require.ErrorIs(t, h.observe(Event{SessionID: "ses-1", Kind: SessionBusy}), ErrStaleEvent)
	var found bool
	for _, r := range h.logs.Records() {
		if r["msg"] == "event ignored" && r["level"] == "DEBUG" {
			found = true
			assert.Equal(t, task.ID, r["task"])
			assert.Equal(t, task.Attempts[0].ID, r["attempt"])
			assert.Equal(t, "ses-1", r["session"])
		}
	}
	assert.True(t, found, "stale event logged at debug")
}

func TestObserveRejectsInvalidEvents(t *testing.T) {
	h := newHarness(t, nil)
	assert.ErrorIs(t, h.m.Observe(Event{Kind: SessionIdle}), ErrInvalidArgument)
	assert.ErrorIs(t, h.m.Observe(Event{SessionID: "s", Kind: "weird"}), ErrInvalidArgument)
}

func TestEarlyEventsAreHeldUntilBind(t *testing.T) {
	tests := []struct {
		name string
		ev   func(req SessionRequest, sid string) Event
	}{
		{name: "by session id", ev: func(req SessionRequest, sid string) Event {
			return Event{SessionID: sid, Kind: SessionIdle, Text: "fast"}
		}},
		{name: "by attempt id", ev: func(req SessionRequest, sid string) Event {
			return Event{AttemptID: req.AttemptID, Kind: SessionIdle, Text: "fast"}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var m *Manager
			var obsErrs []error
			host := &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
				obsErrs = append(obsErrs, m.Observe(Event{SessionID: sid, Kind: SessionBusy}))
				obsErrs = append(obsErrs, m.Observe(tt.ev(req, sid)))
				return sid, nil
			}}
			h := newHarness(t, host)
			m = h.m
			task := h.launch("a/one")
			got := h.wait(task.ID)
			assert.Equal(t, []error{nil, nil}, obsErrs, "held events return nil")
			assert.Equal(t, StatusCompleted, got.Status)
			assert.Equal(t, "ses-1", got.SessionID, "bound before the held events were applied")
			assert.Equal(t, "fast", got.Result)
		})
	}
}

func TestEarlyErrorIsHeldAndFallsBack(t *testing.T) {
	var m *Manager
	host := &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		if req.AttemptNumber == 1 {
			_ = m.Observe(Event{SessionID: sid, Kind: SessionError, Err: errForbidden})
		}
		return sid, nil
	}}
	h := newHarness(t, host)
	m = h.m
	task := h.launch("a/one", "b/two")
	h.settle()
	got := h.task(task.ID)
	require.Len(t, got.Attempts, 2)
	assert.Equal(t, "ses-1", got.Attempts[0].SessionID)
	assert.Equal(t, StatusError, got.Attempts[0].Status)
	assert.Equal(t, StatusRunning, got.Status)
}

func TestHeldEventsAreBounded(t *testing.T) {
	block := make(chan struct{})
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		<-block
		return sid, nil
	}}, WithHoldLimit(2))
	task := h.launch("a/one")
	require.NoError(t, h.m.Observe(Event{SessionID: "ses-1", Kind: SessionBusy}))
	require.NoError(t, h.m.Observe(Event{SessionID: "ses-1", Kind: SessionBusy}))
	assert.ErrorIs(t, h.m.Observe(Event{SessionID: "ses-1", Kind: SessionBusy}), ErrUnknownSession, "liveness past the bound is dropped")
	close(block)
	h.settle()
	assert.Equal(t, StatusRunning, h.task(task.ID).Status)
}

func TestHeldEventsForSessionsNeverBoundAreDropped(t *testing.T) {
	block := make(chan struct{})
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		<-block
		return sid, nil
	}})
	h.launch("a/one")
	require.NoError(t, h.m.Observe(Event{SessionID: "someone-else", Kind: SessionIdle}))
	close(block)
	h.settle()
	assert.ErrorIs(t, h.m.Observe(Event{SessionID: "someone-else", Kind: SessionIdle}), ErrUnknownSession)
	h.m.mu.Lock()
	assert.Zero(t, h.m.calls.held.Len())
	h.m.unlock()
}

func TestWaitReturnsContextError(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("a/one")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := h.m.Wait(ctx, task.ID)
	assert.ErrorIs(t, err, context.Canceled)
	_, err = h.m.Wait(context.Background(), "missing")
	assert.ErrorIs(t, err, ErrUnknownTask)
}

func TestNotificationsInOrderWithOneFinalSummaryLast(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("openai/gpt-5.4-mini", "anthropic/claude-haiku-4.5", "google/gemini-2.5-flash-lite")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: errForbidden}))
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-2", Kind: SessionError, Err: errRateLimited}))
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-3", Kind: SessionIdle, Text: "ok"}))
	h.wait(task.ID)
	h.settle()

	got := h.rec.All()
	kinds := h.rec.Kinds(task.ID)
	assert.Equal(t, []NotificationKind{
		NotifyRetryScheduled, NotifyRetrySessionReady,
		NotifyRetryScheduled, NotifyRetrySessionReady,
		NotifyFinalSummary,
	}, kinds)
	require.Len(t, got, 6)
	for _, n := range got[:5] {
		assert.Equal(t, "parent", n.ParentSessionID)
		assert.Equal(t, task.ID, n.TaskID)
	}
	assert.Equal(t, NotifyAllComplete, got[5].Kind, "the round ends after the last final summary")
	first := got[0].Text
	for _, want := range []string{"ses-1", "openai/gpt-5.4-mini", "Forbidden: Selected provider is forbidden", "anthropic/claude-haiku-4.5"} {
		assert.Contains(t, first, want, "retry scheduled names %q", want)
	}
	ready := got[1].Text
	for _, want := range []string{"ses-2", "Attempt 2", "anthropic/claude-haiku-4.5"} {
		assert.Contains(t, ready, want, "retry session ready names %q", want)
	}
	final := got[4]
	assert.Contains(t, final.Text, Timeline(final.Task))
	assert.Equal(t, StatusCompleted, final.Task.Status)
}

func TestFinalSummaryForEveryTerminalOutcome(t *testing.T) {
	tests := []struct {
		name string
		end  func(h *harness, id string)
		want Status
	}{
		{name: "completed", end: func(h *harness, id string) {
			require.NoError(h.t, h.observe(Event{SessionID: "ses-1", Kind: SessionIdle}))
		}, want: StatusCompleted},
		{name: "error", end: func(h *harness, id string) {
			require.NoError(h.t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: Permanent(errForbidden)}))
		}, want: StatusError},
		{name: "cancelled", end: func(h *harness, id string) {
			require.NoError(h.t, stopErr(h.m.Stop(context.Background(), Target{Task: id})))
		}, want: StatusCancelled},
		{name: "deleted", end: func(h *harness, id string) {
			require.NoError(h.t, h.observe(Event{SessionID: "ses-1", Kind: SessionDeleted}))
		}, want: StatusCancelled},
		{name: "interrupted", end: func(h *harness, id string) {
			require.NoError(h.t, h.observe(Event{SessionID: "ses-1", Kind: SessionInterrupted}))
		}, want: StatusInterrupt},
		{name: "shutdown", end: func(h *harness, id string) { require.NoError(h.t, h.m.Shutdown(context.Background())) }, want: StatusInterrupt},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, nil)
			task := h.launch("a/one", "b/two")
			h.settle()
			tt.end(h, task.ID)
			got := h.wait(task.ID)
			assert.Equal(t, tt.want, got.Status)
			h.settle()
			kinds := h.rec.Kinds(task.ID)
			require.NotEmpty(t, kinds)
			assert.Equal(t, NotifyFinalSummary, kinds[len(kinds)-1])
			n := 0
			for _, k := range kinds {
				if k == NotifyFinalSummary {
					n++
				}
			}
			assert.Equal(t, 1, n, "exactly one final summary")
		})
	}
}

func TestRetryDelayShowsPendingAndCancelEndsIt(t *testing.T) {
	h := newHarness(t, nil, WithRetryDelay(func(n int, _ error) time.Duration { return time.Duration(n) * time.Second }))
	task := h.launch("a/one", "b/two", "c/three")
	h.settle()
	_, timersBefore := h.clock.Created()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: errRateLimited}))
	recv(t, timersBefore, "the retry delay's timer") // the delay timer exists
	got := h.task(task.ID)
	assert.Equal(t, StatusPending, got.Status)
	assert.Equal(t, PendingRetryDelay, got.Pending)
	assert.Len(t, h.host.Starts(), 1, "not started during the delay")

	h.clock.Advance(2 * time.Second)
	h.settle()
	got = h.task(task.ID)
	assert.Equal(t, StatusRunning, got.Status)
	assert.Equal(t, "ses-2", got.SessionID)

	_, timersBefore = h.clock.Created()
	require.NoError(t, h.observe(Event{SessionID: "ses-2", Kind: SessionError, Err: errRateLimited}))
	recv(t, timersBefore, "the second retry delay's timer")
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})))
	got = h.wait(task.ID)
	assert.Equal(t, StatusCancelled, got.Status)
	assert.Empty(t, got.SessionID)
	h.settle()
	assert.Len(t, h.host.Starts(), 2, "the delayed attempt never started")
	assert.Zero(t, h.clock.Pending(), "its timer was stopped")
}

func TestBackoff(t *testing.T) {
	f := Backoff(time.Second, 10*time.Second, 0)
	assert.Equal(t, time.Second, f(2, nil))
	assert.Equal(t, 2*time.Second, f(3, nil))
	assert.Equal(t, 4*time.Second, f(4, nil))
	assert.Equal(t, 10*time.Second, f(10, nil))
	assert.Equal(t, 10*time.Second, f(1000, nil))
	j := Backoff(time.Second, 10*time.Second, 0.5)
	for n := 2; n < 20; n++ {
		d := j(n, nil)
		base := f(n, nil)
		assert.GreaterOrEqual(t, d, base/2)
		assert.LessOrEqual(t, d, base)
	}
}

func TestShutdownInterruptsRunningChildrenAndRefusesWork(t *testing.T) {
	h := newHarness(t, nil)
	a := h.launch("a/one")
	b := h.launch("b/two")
	h.settle()
	require.NoError(t, h.m.Shutdown(context.Background()))
	for _, id := range []string{a.ID, b.ID} {
		got := h.task(id)
		assert.Equal(t, StatusInterrupt, got.Status)
	}
	assert.ElementsMatch(t, []string{"ses-1", "ses-2"}, h.host.Aborts())
	_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "p", Models: mustModels(t, "a/b")})
	assert.ErrorIs(t, err, ErrShutdown)
	assert.Zero(t, h.m.life.group.Running())
	kinds := h.rec.Kinds(a.ID)
	assert.Equal(t, []NotificationKind{NotifyFinalSummary}, kinds)
}

func TestShutdownReportsChildThatDidNotStop(t *testing.T) {
	h := newHarness(t, &testHost{abort: func(ctx context.Context, sid string) error { return errors.New("host unreachable") }})
	task := h.launch("a/one")
	h.settle()
	err := h.m.Shutdown(context.Background())
	require.Error(t, err)
	assert.Contains(t, err.Error(), task.ID)
	assert.Equal(t, StatusRunning, h.task(task.ID).Status, "not stopped, so not reported interrupt")
}

func TestShutdownDuringSessionStartAbortsArrivingSession(t *testing.T) {
	entered := make(chan struct{})
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		close(entered)
		<-ctx.Done() // a start that only returns when cancelled, after creating the session
		return sid, nil
	}})
	task := h.launch("a/one")
	recv(t, entered, "the start")
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // no grace: cancel host contexts at once
	require.NoError(t, h.m.Shutdown(ctx), "nothing is left behind: no error, though ctx had ended")
	got := h.task(task.ID)
	assert.Equal(t, StatusInterrupt, got.Status)
	assert.Equal(t, "ses-1", got.SessionID, "the session existed: bound, then aborted on arrival")
	assert.Equal(t, []string{"ses-1"}, h.host.Aborts())
	assert.Zero(t, h.m.life.group.Running(), "no goroutine outlives Shutdown")
}

func TestManyConcurrentTasksUnderRace(t *testing.T) {
	var m *Manager
	var wg sync.WaitGroup
	host := &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		wg.Add(1)
		go func() { // the child talks from its own goroutine, racing the bind
			defer wg.Done()
			_ = m.Observe(Event{SessionID: sid, Kind: SessionBusy})
			if req.AttemptNumber == 1 {
				_ = m.Observe(Event{AttemptID: req.AttemptID, Kind: SessionError, Err: errRateLimited})
				return
			}
			_ = m.Observe(Event{AttemptID: req.AttemptID, Kind: SessionIdle, Text: "ok"})
		}()
		return sid, nil
	}}
	h := newHarness(t, host)
	m = h.m
	const n = 64
	ids := make(chan string, n)
	var launchers sync.WaitGroup
	for range n {
		launchers.Add(1)
		go func() {
			defer launchers.Done()
			task, err := m.Launch(context.Background(), Spec{ParentSessionID: "p", Models: mustModels(t, "a/1", "b/2")})
			if err == nil {
				ids <- task.ID
			}
		}()
	}
	launchers.Wait()
	close(ids)
	for id := range ids {
		got := h.wait(id)
		assert.Equal(t, StatusCompleted, got.Status)
		assert.Len(t, got.Attempts, 2)
	}
	wg.Wait()
	checkInvariants(t, m)
}

// Every status is exactly one of live and terminal; an unknown one is
// neither.
func TestStatusIsLiveOrTerminal(t *testing.T) {
	for _, s := range []Status{StatusPending, StatusRunning} {
		assert.True(t, s.Live(), s)
		assert.False(t, s.Terminal(), s)
	}
	for _, s := range []Status{StatusCompleted, StatusError, StatusCancelled, StatusInterrupt} {
		assert.False(t, s.Live(), s)
		assert.True(t, s.Terminal(), s)
	}
	assert.False(t, Status("paused").Live())
	assert.False(t, Status("paused").Terminal())
}
