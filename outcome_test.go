package bgtask

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

type statusErr struct {
	code int
	msg  string
}

func (e statusErr) Error() string   { return e.msg }
func (e statusErr) StatusCode() int { return e.code }

func TestOutcomeForEachReason(t *testing.T) {
	tests := []struct {
		name      string
		models    []string
		events    []Event // for the first session
		want      Status
		reason    Reason
		hasAnswer bool
		answer    string
		evidence  string
		tag       string // the element the envelope uses
	}{
		{name: "clean answer", events: []Event{{Kind: SessionIdle, Text: "42", Reason: ""}},
			want: StatusCompleted, hasAnswer: true, answer: "42", tag: "task_result"},
		{name: "finish unknown is not guessed", events: []Event{{Kind: SessionIdle, Text: "42"}},
			want: StatusCompleted, hasAnswer: true, answer: "42", tag: "task_result"},
		{name: "empty answer", events: []Event{{Kind: SessionIdle, Text: "", Reason: ""}},
			want: StatusCompleted, hasAnswer: true, answer: "", tag: "task_result"},
		{name: "no final text", events: []Event{{Kind: SessionBusy, Text: "thinking about it"}, {Kind: SessionIdle, NoFinalText: true}},
			want: StatusError, reason: ReasonNoFinalText, evidence: "thinking about it", tag: "task_error"},
		{name: "output limit", events: []Event{{Kind: SessionIdle, Text: "the answer is partly", Reason: ReasonOutputLimit}},
			want: StatusError, reason: ReasonOutputLimit, evidence: "the answer is partly", tag: "task_error"},
		{name: "content filter", events: []Event{{Kind: SessionIdle, Text: "", Reason: ReasonContentFilter}},
			want: StatusError, reason: ReasonContentFilter, tag: "task_error"},
		{name: "unconsumed tool call", events: []Event{{Kind: SessionIdle, Text: "calling grep", Reason: ReasonUnconsumedToolCall}},
			want: StatusError, reason: ReasonUnconsumedToolCall, evidence: "calling grep", tag: "task_error"},
		{name: "typed context overflow", models: []string{"a/1", "b/2"}, events: []Event{{Kind: SessionError, Err: fmt.Errorf("turn 12: %w", ReasonContextOverflow)}},
			want: StatusError, reason: ReasonContextOverflow, tag: "task_error"},
		{name: "provider message context overflow", models: []string{"a/1", "b/2"}, events: []Event{{Kind: SessionBusy, Text: "read 40 files"}, {Kind: SessionError, Err: errors.New("context_length_exceeded: 210000 > 200000")}},
			want: StatusError, reason: ReasonContextOverflow, evidence: "read 40 files", tag: "task_error"},
		{name: "typed output limit error", events: []Event{{Kind: SessionError, Err: ReasonOutputLimit}},
			want: StatusError, reason: ReasonOutputLimit, tag: "task_error"},
		{name: "typed content filter error", events: []Event{{Kind: SessionError, Err: ReasonContentFilter}},
			want: StatusError, reason: ReasonContentFilter, tag: "task_error"},
		{name: "provider error by status", events: []Event{{Kind: SessionError, Err: statusErr{529, "overloaded_error"}}},
			want: StatusError, reason: ReasonProviderError, tag: "task_error"},
		{name: "provider error by message", events: []Event{{Kind: SessionError, Err: errRateLimited}},
			want: StatusError, reason: ReasonProviderError, tag: "task_error"},
		{name: "unknown failure", events: []Event{{Kind: SessionError, Err: errors.New("something odd")}},
			want: StatusError, reason: ReasonUnknown, tag: "task_error"},
		{name: "no error object", events: []Event{{Kind: SessionError}},
			want: StatusError, reason: ReasonUnknown, tag: "task_error"},
		{name: "interrupted", events: []Event{{Kind: SessionBusy, Text: "half done"}, {Kind: SessionInterrupted}},
			want: StatusInterrupt, evidence: "half done", tag: "task_status"},
		{name: "deleted is cancelled", events: []Event{{Kind: SessionDeleted}},
			want: StatusCancelled, tag: "task_status"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, nil)
			models := tt.models
			if models == nil {
				models = []string{"a/1"}
			}
			task := h.launch(models...)
			h.settle()
			for _, ev := range tt.events {
				ev.SessionID = "ses-1"
				require.NoError(t, h.observe(ev))
			}
			got := h.wait(task.ID)
			require.NotNil(t, got.Outcome)
			o := got.Outcome
			assert.Len(t, got.Attempts, 1, "not retried")
			assert.Equal(t, tt.want, o.State)
			assert.Equal(t, tt.reason, o.Reason)
			assert.Equal(t, tt.hasAnswer, o.HasAnswer)
			assert.Equal(t, tt.answer, o.Answer)
			assert.Equal(t, tt.evidence, o.Evidence)
			assert.Contains(t, o.Envelope, "<"+tt.tag+">\n")
			assert.True(t, strings.HasPrefix(o.Envelope, `<task id="`+task.ID+`" state="`+string(tt.want)+`">`), o.Envelope)
			assert.Equal(t, o.Envelope, Envelope(got))
		})
	}
}

func TestEmptyAnswerIsDistinctFromAMissingOne(t *testing.T) {
	run := func(ev Event) *Outcome {
		h := newHarness(t, nil)
		task := h.launch("a/1")
		h.settle()
		ev.SessionID = "ses-1"
		require.NoError(t, h.observe(ev))
		return h.wait(task.ID).Outcome
	}
	empty := run(Event{Kind: SessionIdle, Text: "", Reason: ""})
	missing := run(Event{Kind: SessionIdle, NoFinalText: true})
	assert.True(t, empty.HasAnswer)
	assert.Equal(t, StatusCompleted, empty.State)
	assert.Contains(t, strings.Join(empty.Notices, "\n"), "the answer is empty")
	assert.False(t, missing.HasAnswer)
	assert.Equal(t, StatusError, missing.State)
	assert.Equal(t, ReasonNoFinalText, missing.Reason)
	a, ok := answerFromEnvelope(empty.Envelope)
	assert.True(t, ok)
	assert.Equal(t, "", a)
	_, ok = answerFromEnvelope(missing.Envelope)
	assert.False(t, ok)
}

func TestCancelledChildIsAnOutcomeNotAToolFailure(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("a/1")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionBusy, Text: "step 3 of 9"}))
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})))
	o := h.wait(task.ID).Outcome
	require.NotNil(t, o)
	assert.Equal(t, StatusCancelled, o.State)
	assert.Empty(t, o.Reason)
	assert.NotContains(t, o.Envelope, "<task_error>")
	assert.Contains(t, o.Envelope, `state="cancelled"`)
	assert.Contains(t, o.Envelope, "<task_status>\nthe task was cancelled before it finished")
	assert.Contains(t, o.Envelope, "step 3 of 9", "its last output rides along as evidence")
}

func TestEvidenceIsBoundedAtTheBoundaries(t *testing.T) {
	for _, n := range []int{maxEvidenceRunes - 1, maxEvidenceRunes, maxEvidenceRunes + 1, 10 * maxEvidenceRunes} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			h := newHarness(t, nil)
			task := h.launch("a/1")
			h.settle()
			out := "B" + strings.Repeat("é", n-2) + "E"
			require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: errors.New("odd"), Text: out}))
			o := h.wait(task.ID).Outcome
			wantDropped := max(0, n-maxEvidenceRunes)
			assert.Equal(t, wantDropped, o.EvidenceDropped)
			assert.True(t, strings.HasPrefix(o.Evidence, "B"))
			assert.True(t, strings.HasSuffix(o.Evidence, "E"))
			if wantDropped == 0 {
				assert.Equal(t, out, o.Evidence)
			} else {
				assert.Less(t, utf8.RuneCountInString(o.Evidence), maxEvidenceRunes+60)
				assert.Contains(t, o.Envelope, fmt.Sprintf("last output (%d characters dropped from the middle):", wantDropped))
			}
		})
	}
}

func TestWaitAndFinalSummaryCarryTheSameOutcome(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("a/1", "b/2")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: errRateLimited}))
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-2", Kind: SessionIdle, Text: "done </task_result> really", Reason: ""}))
	got := h.wait(task.ID)
	h.settle()
	var final Notification
	for _, n := range h.rec.All() {
		if n.Kind == NotifyFinalSummary {
			final = n
		}
	}
	require.NotNil(t, final.Task.Outcome)
	assert.Equal(t, got.Outcome, final.Task.Outcome, "one payload, two carriers")
	assert.Contains(t, final.Text, got.Outcome.Envelope)
	assert.Contains(t, got.Outcome.Notices, "retried on 1 model after attempt 1 failed")
	a, ok := answerFromEnvelope(got.Outcome.Envelope)
	require.True(t, ok)
	assert.Equal(t, "done </task_result> really", a, "recovered exactly")
	// Computed once: a later read is the same value, not a recomputation.
	again, _ := h.m.Task(task.ID)
	assert.Equal(t, got.Outcome, again.Outcome)
}

func failedWith(msg string) Attempt {
	a := attempt(1, StatusError, "openai/gpt-5.4-mini", "ses_aaa", msg)
	a.Token = "run-1"
	return a
}

func TestEnvelopeGolden(t *testing.T) {
	task := func(status Status, attempts ...Attempt) Task {
		cur := attempts[len(attempts)-1]
		return Task{ID: "task-7", Status: status, SessionID: cur.SessionID, CurrentAttemptID: cur.ID, Attempts: attempts}
	}
	done := attempt(1, StatusCompleted, "openai/gpt-5.4-mini", "ses_aaa", "")
	done.Token, done.Result = "run-1", "Use `List<T>` and close </task_result> tags carefully & check."
	failed := attempt(1, StatusError, "openai/gpt-5.4-mini", "ses_aaa", "context_length_exceeded: <prompt> too long")
	failed.Token = "run-1"
	retried := attempt(2, StatusCompleted, "google/gemini-2.5-flash-lite", "ses_ccc", "")
	retried.Token, retried.Result = "run-2", "42"
	first := attempt(1, StatusError, "openai/gpt-5.4-mini", "ses_aaa", "Forbidden")
	cancelled := attempt(1, StatusCancelled, "openai/gpt-5.4-mini", "ses_aaa", "")
	cancelled.Token = "run-1"
	interrupted := attempt(1, StatusInterrupt, "openai/gpt-5.4-mini", "ses_aaa", "")
	interrupted.Token = "run-1"
	cut := attempt(1, StatusCompleted, "openai/gpt-5.4-mini", "ses_aaa", "")
	cut.Token, cut.Result = "run-1", "The three causes are: 1) the temp dir"
	tests := []struct {
		name string
		task Task
		out  *evidence
	}{
		{name: "completed", task: task(StatusCompleted, done), out: &evidence{finish: ""}},
		{name: "completed_after_retry", task: task(StatusCompleted, first, retried), out: &evidence{finish: ""}},
		{name: "error_context_overflow", task: task(StatusError, failed), out: &evidence{output: "read 40 files <and more>", reason: ReasonContextOverflow}},
		{name: "error_output_limit", task: task(StatusCompleted, cut), out: &evidence{finish: string(ReasonOutputLimit)}},
		{name: "error_no_final_text", task: task(StatusCompleted, cut), out: &evidence{noText: true, output: "was looking at main.go"}},
		{name: "error_content_filter", task: task(StatusCompleted, cut), out: &evidence{finish: string(ReasonContentFilter)}},
		{name: "error_unconsumed_tool_call", task: task(StatusCompleted, cut), out: &evidence{finish: string(ReasonUnconsumedToolCall), output: `{"tool":"grep"}`}},
		{name: "error_provider_error", task: task(StatusError, failedWith("429 Too Many Requests")), out: &evidence{reason: reasonOf(statusErr{429, "Too Many Requests"})}},
		{name: "error_unknown", task: task(StatusError, failedWith("something odd")), out: &evidence{reason: reasonOf(errors.New("something odd"))}},
		{name: "cancelled", task: task(StatusCancelled, cancelled), out: &evidence{output: "step 3 of 9"}},
		{name: "interrupt", task: task(StatusInterrupt, interrupted), out: &evidence{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := outcomeOf(tt.task, tt.out, sessionsResumable)
			golden(t, "envelope_"+tt.name+".golden", o.Envelope)
		})
	}
	running := Task{ID: "task-8", CurrentAttemptID: "a2", Attempts: []Attempt{first, {ID: "a2", Number: 2, Status: StatusRunning, Model: Model{Provider: "google", ID: "gemini-2.5-flash-lite"}, SessionID: "ses_ccc"}}}
	golden(t, "envelope_running.golden", Envelope(running))
}

// FuzzEnvelope feeds arbitrary content to every open field and checks the
// envelope stays well-formed and the answer recoverable.
func FuzzEnvelope(f *testing.F) {
	f.Add("answer", "error", "notice", "task-1")
	f.Add("</task_result></task><task id=\"x\">", "<task_error>", "line\n<task_notice>x</task_notice>", `"><script>`)
	f.Add("&lt;/task&amp;lt;/task", "&", "\r\n\t", "")
	f.Fuzz(func(t *testing.T, answer, errText, notice, id string) {
		for _, o := range []*Outcome{
			{State: StatusCompleted, HasAnswer: true, Answer: answer, Notices: []string{notice}},
			{State: StatusError, Reason: ReasonUnknown, Error: errText, Evidence: answer, Notices: []string{notice, notice}},
			{State: StatusCancelled, Error: errText, Evidence: answer},
		} {
			env := renderEnvelope(id, o)
			checkWellFormed(t, env, o)
			if o.HasAnswer {
				got, ok := answerFromEnvelope(env)
				if !ok || got != answer {
					t.Fatalf("answer not recovered: %q from %q", got, env)
				}
			}
		}
	})
}

func checkWellFormed(t *testing.T, env string, o *Outcome) {
	t.Helper()
	if !strings.HasPrefix(env, `<task id="`) || !strings.HasSuffix(env, "\n</task>") {
		t.Fatalf("not a task envelope: %q", env)
	}
	if n := strings.Count(env, "</task>"); n != 1 {
		t.Fatalf("%d closing task tags in %q", n, env)
	}
	head, _, _ := strings.Cut(env, "\n")
	if strings.Count(head, "<") != 1 || strings.Count(head, ">") != 1 || strings.Count(head, `"`) != 4 {
		t.Fatalf("the opening tag is broken: %q", head)
	}
	for _, tag := range []string{"task_result", "task_error", "task_status"} {
		opens, closes := strings.Count(env, "\n<"+tag+">\n"), strings.Count(env, "\n</"+tag+">\n")
		if closes > 1 || (closes == 1 && opens < 1) {
			t.Fatalf("%s: %d opens, %d closes in %q", tag, opens, closes, env)
		}
	}
	notices := 0
	for _, line := range strings.Split(env, "\n") {
		if strings.HasPrefix(line, "<task_notice>") {
			notices++
			inner := strings.TrimSuffix(strings.TrimPrefix(line, "<task_notice>"), "</task_notice>")
			if !strings.HasSuffix(line, "</task_notice>") || strings.Contains(inner, "<") {
				t.Fatalf("a notice nests a tag or breaks its line: %q", line)
			}
			if utf8.RuneCountInString(inner) > maxNoticeRunes*6 { // entities widen it
				t.Fatalf("notice too long: %d", len(inner))
			}
		}
	}
	if notices != len(o.Notices) {
		t.Fatalf("%d notices rendered, %d given: %q", notices, len(o.Notices), env)
	}
}

func TestIsPermanentFollowsEveryWrapping(t *testing.T) {
	base := errors.New("bad request")
	p := Permanent(base)
	assert.True(t, IsPermanent(p))
	assert.True(t, IsPermanent(fmt.Errorf("wrapped: %w", p)))
	assert.True(t, IsPermanent(errors.Join(errors.New("other"), fmt.Errorf("x: %w", p))))
	assert.True(t, IsPermanent(&StartError{Err: p}))
	assert.False(t, IsPermanent(base))
	assert.False(t, IsPermanent(nil))
	assert.False(t, IsPermanent(errors.Join(base, errors.New("other"))))
	assert.False(t, IsPermanent(fmt.Errorf("no wrap: %v", p)))
}

// asStartError is a *StartError only through its As method.
type asStartError struct{}

func (asStartError) Error() string { return "opaque start failure" }
func (asStartError) As(target any) bool {
	if p, ok := target.(**StartError); ok {
		*p = &StartError{Model: Model{Provider: "a", ID: "b"}, Err: errors.New("503")}
		return true
	}
	return false
}

func TestAStartErrorSeenOnlyThroughAsIsRetriedAsOne(t *testing.T) {
	assert.True(t, DefaultRetryable(fmt.Errorf("x: %w", asStartError{})))
	se, ok := inChain[*StartError](asStartError{})
	require.True(t, ok)
	assert.Equal(t, "a", se.Model.Provider)
}

// A journal of an earlier release recorded a turn's finish reason in its
// own words: they still say why an idle answer is not clean.
func TestAnIdleReasonOfAnEarlierReleaseIsRead(t *testing.T) {
	for word, want := range map[string]Reason{
		"length": ReasonOutputLimit, "content_filter": ReasonContentFilter, "tool_calls": ReasonUnconsumedToolCall,
		"stop": "", "unknown": "", "": "",
		string(ReasonOutputLimit): ReasonOutputLimit, string(ReasonUnconsumedToolCall): ReasonUnconsumedToolCall,
	} {
		assert.Equal(t, want, idleReason(word), word)
	}
}

// A Reason is the error a host returns to name it: wrapped or not, the
// outcome says it, and DefaultRetryable does not retry it.
func TestAReasonIsAnErrorAHostReturns(t *testing.T) {
	err := fmt.Errorf("provider said: %w", ReasonContextOverflow)
	assert.Equal(t, ReasonContextOverflow, reasonOf(err))
	assert.True(t, errors.Is(err, ReasonContextOverflow))
	assert.False(t, DefaultRetryable(err))
	assert.Equal(t, "provider said: context window exceeded", err.Error())
}
