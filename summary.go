package bgtask

import (
	"errors"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/bgtask/bgtask/internal/errclass"
	"github.com/bgtask/bgtask/internal/markup"
	"github.com/bgtask/bgtask/internal/textbound"
)

// maxTimelineErrorRunes bounds the error line of one attempt in a Timeline.
const maxTimelineErrorRunes = 200

// Timeline renders t's attempts for the parent chat, one line per attempt
// (number, status in upper case, model, session) and, for an attempt with an
// error, one bounded "Error:" line under it:
//
//	Background task attempts:
//	- Attempt 1 — ERROR — openai/gpt-5.4-mini — ses_aaa
//	  Error: Forbidden: Selected provider is forbidden
//	- Attempt 2 — COMPLETED — google/gemini-2.5-flash-lite — ses_ccc
//
// An attempt with no session reads "no session"; a pending attempt shows
// why it waits. A model the chain skipped because it was cooling
// (WithHealth) reads, before the attempt that moved past it:
//
//   - Skipped openai/gpt-5.4-mini before attempt 2 — cooling (rate_limited) until 2026-12-02T10:00:30Z
//
// The text has no trailing newline.
func Timeline(t Task) string {
	var b strings.Builder
	b.WriteString("Background task attempts:")
	skips := t.Skips
	for _, a := range t.Attempts {
		for len(skips) > 0 && skips[0].Attempt <= a.Number {
			sk := skips[0]
			skips = skips[1:]
			b.WriteString("\n- Skipped " + sk.Model.String() + " before attempt " + strconv.Itoa(sk.Attempt) + " — cooling (" + textbound.OneLine(sk.Why, maxTimelineErrorRunes) + ")")
			if !sk.Until.IsZero() {
				b.WriteString(" until " + sk.Until.UTC().Format(time.RFC3339))
			}
		}
		b.WriteString("\n- Attempt ")
		b.WriteString(strconv.Itoa(a.Number))
		b.WriteString(" — ")
		b.WriteString(strings.ToUpper(string(a.Status)))
		if a.Status == StatusPending && a.Pending != "" {
			b.WriteString(" (" + strings.ReplaceAll(string(a.Pending), "_", " ") + ")")
		}
		b.WriteString(" — ")
		if a.Model == (Model{}) {
			b.WriteString("no model") // a launch with no chain
		} else {
			b.WriteString(a.Model.String())
		}
		b.WriteString(" — ")
		if a.SessionID != "" {
			b.WriteString(a.SessionID)
		} else {
			b.WriteString("no session")
		}
		if a.Error != "" {
			b.WriteString("\n  Error: ")
			b.WriteString(textbound.OneLine(a.Error, maxTimelineErrorRunes))
		}
	}
	if t.Stop != nil {
		b.WriteString("\nStopped: ")
		b.WriteString(textbound.OneLine(t.Stop.String(), maxTimelineErrorRunes))
	}
	b.WriteString(usageLine(t))
	return b.String()
}

func sessionOrNone(id string) string {
	if id == "" {
		return "no session"
	}
	return "session " + id
}

// retryScheduledText tells the parent that failed ended and next was chosen.
func retryScheduledText(failed, next Attempt) string {
	return "[Background task retry] Attempt " + strconv.Itoa(failed.Number) +
		" failed on " + failed.Model.String() + " (" + sessionOrNone(failed.SessionID) + "): " +
		textbound.OneLine(failed.Error, maxTimelineErrorRunes) +
		". Retrying on " + next.Model.String() + " as attempt " + strconv.Itoa(next.Number) +
		"; its session is being created."
}

// retrySessionReadyText tells the parent a retry attempt's session exists.
func retrySessionReadyText(a Attempt) string {
	return "[Background task retry] Attempt " + strconv.Itoa(a.Number) + " is running on " +
		a.Model.String() + " in session " + a.SessionID + "."
}

// finalSummaryText is the final notification: a headline, the <task>
// envelope (the same the task's Outcome holds), and the timeline.
func finalSummaryText(t Task) string {
	head := headline(strings.ToUpper(string(t.Status)), t.ID, t.Description)
	if t.Outcome != nil {
		head += "\n" + t.Outcome.Envelope
	}
	return head + "\n" + Timeline(t)
}

// branchClosedText renders a closure record for the root's parent.
func branchClosedText(r ClosureReport) string {
	var b strings.Builder
	if r.SessionID == "" { // a Stop with Tree of a task that had no session yet
		b.WriteString("[Branch closure] Task " + r.TaskID + ": ")
	} else {
		b.WriteString("[Branch closure] Session " + r.SessionID + ": ")
	}
	switch {
	case len(r.Stopped) == 0 && len(r.Failed) == 0:
		b.WriteString("nothing was running.")
	case len(r.Failed) == 0:
		b.WriteString(strconv.Itoa(len(r.Stopped)) + " run(s) stopped.")
	default:
		b.WriteString(strconv.Itoa(len(r.Stopped)) + " run(s) stopped, " + strconv.Itoa(len(r.Failed)) + " did not stop.")
	}
	// Runs that did not stop come first: they are what the parent must know.
	lines := 0
	for _, f := range r.Failed {
		if lines == maxClosureLines {
			break
		}
		b.WriteString("\n- task " + f.TaskID + " — STILL RUNNING — " + sessionOrNone(f.SessionID) + " — " + textbound.OneLine(f.Err, maxTimelineErrorRunes))
		lines++
	}
	for _, s := range r.Stopped {
		if lines == maxClosureLines {
			break
		}
		b.WriteString("\n- task " + s.TaskID + " — " + strings.ToUpper(string(s.Status)) + " — " + sessionOrNone(s.SessionID))
		lines++
	}
	if more := len(r.Failed) + len(r.Stopped) - lines; more > 0 {
		b.WriteString("\n- … and " + strconv.Itoa(more) + " more")
	}
	return b.String()
}

// maxClosureLines bounds the runs listed in a branch closure notification;
// the ClosureReport has them all.
const maxClosureLines = 50

// Reason says why an outcome is not a clean answer; it is empty for a clean
// one. It is also how a host or a function says so, in one vocabulary: a
// Reason is an error, returned (wrapped or not) by a FuncHost function or
// in a SessionError's Err (ReasonContextOverflow: the outcome names it
// without guessing from messages, and DefaultRetryable does not retry
// context_overflow, output_limit or content_filter), or set as
// Event.Reason on a SessionIdle whose answer is not clean
// (ReasonOutputLimit, ReasonContentFilter, ReasonUnconsumedToolCall).
// A task stopped at its deadline has ReasonDeadline in its Cause's chain.
type Reason string

const (
	// ReasonContextOverflow: the child ran out of context window.
	ReasonContextOverflow Reason = "context_overflow"
	// ReasonOutputLimit: the child's answer was cut off by an output limit.
	ReasonOutputLimit Reason = "output_limit"
	// ReasonContentFilter: the provider filtered the child's output.
	ReasonContentFilter Reason = "content_filter"
	// ReasonProviderError: the provider failed the request (rate limit,
	// overload, 5xx, forbidden, unknown model, timeout, bad request).
	ReasonProviderError Reason = "provider_error"
	// ReasonNoFinalText: the child's turn ended with no final message.
	ReasonNoFinalText Reason = "no_final_text"
	// ReasonUnconsumedToolCall: the turn ended on a tool call nobody
	// answered.
	ReasonUnconsumedToolCall Reason = "unconsumed_tool_call"
	// ReasonDeadline: the run was stopped at its wall-clock deadline
	// (Spec.Timeout, Spec.AttemptTimeout).
	ReasonDeadline Reason = "deadline"
	// ReasonUnknown: the run failed and the library could not establish
	// why. It is never a guess.
	ReasonUnknown Reason = "unknown"
)

// Error says what r means, in a few words: a Reason is an error a host or
// a function returns (see Reason).
func (r Reason) Error() string {
	switch r {
	case ReasonContextOverflow:
		return "context window exceeded"
	case ReasonOutputLimit:
		return "output limit reached"
	case ReasonContentFilter:
		return "output blocked by a content filter"
	case ReasonProviderError:
		return "the provider failed the request"
	case ReasonNoFinalText:
		return "the turn ended with no final message"
	case ReasonUnconsumedToolCall:
		return "the turn ended on a tool call nobody answered"
	case ReasonDeadline:
		return "deadline"
	case "":
		return "no reason"
	}
	return string(r)
}

// idleReason is the Reason a SessionIdle's word says (Event.Reason, as
// recorded): a Reason's own word, or a finish reason as earlier releases
// recorded it ("length", "content_filter", "tool_calls"; "stop" and
// "unknown" are a clean answer).
func idleReason(word string) Reason {
	switch word {
	case "length", string(ReasonOutputLimit):
		return ReasonOutputLimit
	case string(ReasonContentFilter):
		return ReasonContentFilter
	case "tool_calls", string(ReasonUnconsumedToolCall):
		return ReasonUnconsumedToolCall
	case string(ReasonNoFinalText):
		return ReasonNoFinalText
	}
	return ""
}

// maxEvidenceRunes bounds Outcome.Evidence: longer output keeps its
// beginning and end.
const maxEvidenceRunes = 2000

// maxProgressRunes bounds Task.Progress, one line.
const maxProgressRunes = 200

// Outcome is what a parent gets when a task ends: computed once, at its
// first read after the task became terminal (from what the task ended
// with, which never changes after), and carried by both Wait
// (Task.Outcome) and the final summary notification with the same value.
//
// Status says how the child's run ended; Outcome says what the parent was
// given. A run that ended idle but was cut off, filtered, or ended with no
// final text has Status completed and an Outcome whose State is error with
// the reason.
type Outcome struct {
	// State is completed (a clean answer), error, cancelled or interrupt.
	State Status `json:"state"`
	// Reason says why an outcome is not a clean answer; empty if it is.
	Reason Reason `json:"reason,omitempty"`
	// Answer is the final answer, verbatim; HasAnswer tells an empty
	// answer ("") from a missing one.
	Answer string `json:"answer,omitempty"`
	// HasAnswer says Answer is the child's answer (which may be "").
	HasAnswer bool `json:"hasAnswer"`
	// Error is the failure text, for error (and a cancelled run that
	// failed while stopping).
	Error string `json:"error,omitempty"`
	// Evidence is the child's last output when the outcome is not a clean
	// answer, bounded to maxEvidenceRunes; EvidenceDropped counts the
	// characters dropped from its middle.
	Evidence string `json:"evidence,omitempty"`
	// EvidenceDropped counts the characters dropped from Evidence's middle.
	EvidenceDropped int `json:"evidenceDropped,omitempty"`
	// PriorOutput is the output of the ended task whose session this task
	// continued (Spec.ContinueFrom), bounded as Evidence is: reported once,
	// in this task's envelope.
	PriorOutput string `json:"priorOutput,omitempty"`
	// Notices are one-line facts that ride along ("retried on 2 models").
	Notices []string `json:"notices,omitempty"`
	// Envelope is the <task> block for the parent model.
	Envelope string `json:"envelope"`
}

func (o *Outcome) clone() *Outcome {
	if o == nil {
		return nil
	}
	c := *o
	c.Notices = slices.Clone(o.Notices)
	return &c
}

// reasonOf classifies a failure: the typed errors first, then the error
// classes DefaultRetryable uses.
func reasonOf(err error) Reason {
	var r Reason
	switch {
	case err == nil:
		return ReasonUnknown
	case errors.As(err, &r) && r != "":
		return r
	}
	switch errclass.Classify(err) {
	case errclass.ContextOverflow:
		return ReasonContextOverflow
	case errclass.OutputLimit:
		return ReasonOutputLimit
	case errclass.ContentFilter:
		return ReasonContentFilter
	case errclass.RateLimited, errclass.Overloaded, errclass.ServerError, errclass.Forbidden,
		errclass.Unauthorized, errclass.ModelNotFound, errclass.Timeout, errclass.Validation:
		return ReasonProviderError
	}
	return ReasonUnknown
}

// outcomeOf computes a terminal task's outcome from its current attempt and
// what its run reported (ev, from the attempt's final record; nil if the
// run reported nothing that bears on it).
func outcomeOf(t Task, ev *evidence, sessions sessionKind) *Outcome {
	o := outcomeFacts(t, ev, sessions)
	o.Envelope = renderEnvelope(t.ID, o)
	return o
}

// outcomeFacts is outcomeOf without the envelope.
func outcomeFacts(t Task, ev *evidence, sessions sessionKind) *Outcome {
	cur := t.Current()
	o := &Outcome{State: cur.Status}
	last := evidence{}
	if ev != nil {
		last = *ev
	}
	switch cur.Status {
	case StatusCompleted:
		switch r := idleReason(last.finish); {
		case last.noText:
			o.State, o.Reason = StatusError, ReasonNoFinalText
		case r != "":
			o.State, o.Reason = StatusError, r
		default:
			o.Answer, o.HasAnswer = cur.Result, true
		}
		if o.State == StatusError {
			o.Error = unusableAnswer[o.Reason]
		}
	case StatusError:
		o.Error = cur.Error
		o.Reason = last.reason
		if o.Reason == "" {
			o.Reason = reasonOf(errors.New(cur.Error)) // our own error: no user code runs
		}
	case StatusCancelled, StatusInterrupt:
		o.Error = cur.Error
	}
	if !o.HasAnswer && ev != nil {
		evidence := last.output
		if evidence == "" && cur.Status == StatusCompleted {
			evidence = cur.Result
		}
		o.Evidence, o.EvidenceDropped = textbound.Middle(evidence, maxEvidenceRunes)
	}
	o.Notices = notices(t, o, sessions)
	if last.notice != "" {
		o.Notices = append(o.Notices, last.notice)
	}
	if last.budget != "" {
		o.Notices = append(o.Notices, last.budget)
	}
	return o
}

// withPrior adds to o, the outcome of task id, the output of the ended
// task from whose session it continued, and renders its envelope again.
func (o *Outcome) withPrior(id, from, prior string) {
	o.PriorOutput = prior
	o.Notices = append(o.Notices, "continues the session of task "+from+": its output is given once, as prior output")
	o.Envelope = renderEnvelope(id, o)
}

// unusableAnswer explains a turn that ended without a usable answer.
var unusableAnswer = map[Reason]string{
	ReasonNoFinalText:        "the child's turn ended with no final message",
	ReasonOutputLimit:        "the child's answer was cut off by an output limit",
	ReasonContentFilter:      "the provider's content filter blocked the child's answer",
	ReasonUnconsumedToolCall: "the child's turn ended on a tool call that was never answered",
}

// maxNoticeRunes bounds one <task_notice> line.
const maxNoticeRunes = 200

func notices(t Task, o *Outcome, sessions sessionKind) []string {
	var out []string
	if len(t.Attempts) > 1 {
		seen := map[Model]bool{}
		for _, a := range t.Attempts[1:] {
			seen[a.Model] = true
		}
		out = append(out, "retried on "+strconv.Itoa(len(seen))+" model"+plural(len(seen))+" after attempt 1 failed")
	}
	if t.Stop != nil && !o.HasAnswer {
		out = append(out, "stopped: "+t.Stop.String())
	}
	if o.HasAnswer && o.Answer == "" {
		out = append(out, "the answer is empty: the child ended its turn with an empty final message")
	}
	if !o.HasAnswer && t.SessionID != "" {
		switch sessions { // offer only what the host can do
		case sessionsResumable:
			out = append(out, "the task's session "+t.SessionID+" can be inspected or resumed by task id "+t.ID)
		case sessionsKept:
			out = append(out, "the task's session "+t.SessionID+" can be inspected by task id "+t.ID)
		}
	}
	return out
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}

// Envelope renders the <task> block a parent model reads for t: the
// outcome's envelope for a terminal task (the same text Wait and the final
// summary carry), or a <task_status> receipt for work still running.
//
// Content cannot break the envelope: attributes, errors, statuses and
// notices are escaped ("<" and "&" become entities; a notice is one line,
// capped at maxNoticeRunes); the answer and the evidence are verbatim but
// for "</task", which is escaped so it cannot close a tag (see the package
// docs for how to recover the exact answer).
func Envelope(t Task) string {
	if t.Outcome != nil {
		return t.Outcome.Envelope
	}
	cur := t.Current()
	status := "running: attempt " + strconv.Itoa(cur.Number) + " on " + cur.Model.String()
	if cur.SessionID != "" {
		status += " in session " + cur.SessionID
	}
	if cur.Status == StatusPending {
		status = "pending (" + strings.ReplaceAll(string(cur.Pending), "_", " ") + "): attempt " + strconv.Itoa(cur.Number) + " on " + cur.Model.String()
	}
	var b strings.Builder
	openTask(&b, t.ID, "running", 0)
	openElement(&b, "task_status")
	b.WriteString(markup.Text(status))
	closeElement(&b, "task_status")
	receipt := []string{deliveryPromise} // the receipt's share of TaskProtocol
	if n := budgetNotice(t.Budget); n != "" {
		receipt = append(receipt, n)
	}
	closeTask(&b, receipt)
	return b.String()
}

func renderEnvelope(id string, o *Outcome) string { return renderAnswerEnvelope(id, 0, o) }

// renderAnswerEnvelope is the envelope of o as the answer of invocation n
// (0: the task's own, with no invocation attribute).
func renderAnswerEnvelope(id string, n int, o *Outcome) string {
	var b strings.Builder
	b.Grow(180 + len(o.Answer) + len(o.Error) + len(o.Evidence))
	openTask(&b, id, string(o.State), n)
	switch {
	case o.HasAnswer:
		openElement(&b, "task_result")
		b.WriteString(markup.Body(o.Answer))
		closeElement(&b, "task_result")
	case o.State == StatusError:
		openElement(&b, "task_error")
		b.WriteString("reason: ")
		b.WriteString(string(o.Reason))
		b.WriteString("\nerror: ")
		b.WriteString(markup.Text(o.Error))
		writeEvidence(&b, o)
		closeElement(&b, "task_error")
	default: // cancelled, interrupt: an outcome, not a tool failure
		openElement(&b, "task_status")
		if o.State == StatusInterrupt {
			b.WriteString("the task was interrupted before it finished")
		} else {
			b.WriteString("the task was cancelled before it finished")
		}
		if o.Error != "" {
			b.WriteString("\nerror: ")
			b.WriteString(markup.Text(o.Error))
		}
		writeEvidence(&b, o)
		closeElement(&b, "task_status")
	}
	if o.PriorOutput != "" {
		openElement(&b, "task_prior_output")
		b.WriteString(markup.Body(o.PriorOutput))
		closeElement(&b, "task_prior_output")
	}
	closeTask(&b, o.Notices)
	return b.String()
}

func writeEvidence(b *strings.Builder, o *Outcome) {
	if o.Evidence == "" {
		return
	}
	if o.EvidenceDropped > 0 {
		b.WriteString("\nlast output (")
		b.WriteString(strconv.Itoa(o.EvidenceDropped))
		b.WriteString(" characters dropped from the middle):\n")
	} else {
		b.WriteString("\nlast output:\n")
	}
	b.WriteString(markup.Body(o.Evidence))
}

// openTask opens a <task> element; n > 0 names the invocation answered.
func openTask(b *strings.Builder, id, state string, n int) {
	b.WriteString(`<task id="`)
	b.WriteString(markup.Attr(id))
	if n > 0 {
		b.WriteString(`" invocation="`)
		b.WriteString(strconv.Itoa(n))
	}
	b.WriteString(`" state="`)
	b.WriteString(markup.Attr(state))
	b.WriteString("\">\n")
}

func openElement(b *strings.Builder, tag string) {
	b.WriteByte('<')
	b.WriteString(tag)
	b.WriteString(">\n")
}

func closeElement(b *strings.Builder, tag string) {
	b.WriteString("\n</")
	b.WriteString(tag)
	b.WriteString(">\n")
}

func closeTask(b *strings.Builder, notices []string) {
	for _, n := range notices {
		b.WriteString("<task_notice>")
		b.WriteString(markup.Text(textbound.OneLine(n, maxNoticeRunes)))
		b.WriteString("</task_notice>\n")
	}
	b.WriteString("</task>")
}

// answerFromEnvelope recovers the exact answer from an envelope rendered by
// Envelope, and reports whether it holds one (the fuzz test's check that
// no content breaks the envelope).
func answerFromEnvelope(env string) (string, bool) {
	const open, end = "<task_result>\n", "\n</task_result>\n"
	i := strings.Index(env, open)
	if i < 0 {
		return "", false
	}
	rest := env[i+len(open):]
	j := strings.Index(rest, end)
	if j < 0 {
		return "", false
	}
	return markup.Unbody(rest[:j]), true
}

// TaskProtocol is the text a harness puts in its task tool's description,
// so that the model is told only what bgtask really does. Receipts for
// running work (Envelope's <task_status>) rely on it.
const TaskProtocol = "Background tasks report back on their own: " + deliveryPromise + ".\n" +
	"While async tasks you started are still running, ending your turn does not return your result: your answer is held until they have all finished and their results have reached you.\n" +
	"The first turn you end after they have all finished is the one returned, so it must be a complete, self-contained answer.\n" +
	"A task_notice that starts with \"budget:\" tells what the task's tree has spent and has left: pace the work you start by it. Once a limit is reached, new tasks in that tree are refused and its running tasks are stopped."

// deliveryPromise is the part of TaskProtocol a running task's receipt
// repeats.
const deliveryPromise = "each task's result or error is delivered to this conversation automatically when it is ready, so never poll, wait or sleep for one"

// answerOutcome is the outcome of one turn (or failure) as an answer: the
// rules of a task's outcome (a turn with no final text, cut off, or ended
// on a tool call is not a usable answer), for a single result.
// Its Envelope is left empty: an answer renders its own
// (renderAnswerEnvelope).
func answerOutcome(id string, status Status, text, errText string, ev evidence) *Outcome {
	t := Task{ID: id, CurrentAttemptID: "answer", Attempts: []Attempt{{ID: "answer", Status: status, Result: text, Error: errText}}}
	return outcomeFacts(t, &ev, sessionsGone) // no session: no session notice
}

// answerText tells a parent that invocation a.Invocation of task id was
// answered, while the task goes on.
func answerText(id, description string, a Answer) string {
	return headline("ANSWER "+strconv.Itoa(a.Invocation), id, description) + "\n" + a.Envelope
}

// headline is the first line of a notification about task id: what it
// says (tag) and the task's description, on one line.
func headline(tag, id, description string) string {
	head := "[Background task " + tag + "] " + id
	if description != "" {
		head += ": " + textbound.OneLine(description, 120)
	}
	return head
}

// allCompleteText tells a parent every task of its round has ended,
// failures first, with the timeline of each task that took more than one
// attempt.
func allCompleteText(parent string, tasks []Task) string {
	var failed, cancelled, interrupted int // a cancel is not a failure
	for _, t := range tasks {
		switch failureRank(t) {
		case rankFailed:
			failed++
		case rankStopped:
			if t.Outcome.State == StatusCancelled {
				cancelled++
			} else {
				interrupted++
			}
		}
	}
	var b strings.Builder
	b.WriteString("[All background tasks complete] " + strconv.Itoa(len(tasks)) + " task" + plural(len(tasks)) +
		" under " + parent + ": " + strconv.Itoa(failed) + " failed, ")
	if cancelled > 0 {
		b.WriteString(strconv.Itoa(cancelled) + " cancelled, ")
	}
	if interrupted > 0 {
		b.WriteString(strconv.Itoa(interrupted) + " interrupted, ")
	}
	b.WriteString(strconv.Itoa(len(tasks)-failed-cancelled-interrupted) + " completed.")
	for _, t := range tasks {
		state := "UNKNOWN"
		if t.Outcome != nil {
			state = strings.ToUpper(string(t.Outcome.State))
			if t.Outcome.Reason != "" {
				state += " (" + string(t.Outcome.Reason) + ")"
			}
		}
		b.WriteString("\n- " + t.ID + " — " + state)
		if t.Description != "" {
			b.WriteString(" — " + textbound.OneLine(t.Description, 120))
		}
		if len(t.Attempts) > 1 {
			b.WriteString("\n  " + strings.ReplaceAll(Timeline(t), "\n", "\n  "))
		}
	}
	return b.String()
}
