package bgtask

import (
	"strconv"
	"strings"

	"github.com/bgtask/bgtask/internal/textbound"
)

// MaxTimelineErrorRunes bounds the error line of one attempt in a Timeline.
const MaxTimelineErrorRunes = 200

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
// why it waits. The text has no trailing newline.
func Timeline(t Task) string {
	var b strings.Builder
	b.WriteString("Background task attempts:")
	for _, a := range t.Attempts {
		b.WriteString("\n- Attempt ")
		b.WriteString(strconv.Itoa(a.Number))
		b.WriteString(" — ")
		b.WriteString(strings.ToUpper(string(a.Status)))
		if a.Status == StatusPending && a.Pending != "" {
			b.WriteString(" (" + strings.ReplaceAll(string(a.Pending), "_", " ") + ")")
		}
		b.WriteString(" — ")
		b.WriteString(a.Model.String())
		b.WriteString(" — ")
		if a.SessionID != "" {
			b.WriteString(a.SessionID)
		} else {
			b.WriteString("no session")
		}
		if a.Error != "" {
			b.WriteString("\n  Error: ")
			b.WriteString(textbound.OneLine(a.Error, MaxTimelineErrorRunes))
		}
	}
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
		textbound.OneLine(failed.Error, MaxTimelineErrorRunes) +
		". Retrying on " + next.Model.String() + " as attempt " + strconv.Itoa(next.Number) +
		"; its session is being created."
}

// retrySessionReadyText tells the parent a retry attempt's session exists.
func retrySessionReadyText(a Attempt) string {
	return "[Background task retry] Attempt " + strconv.Itoa(a.Number) + " is running on " +
		a.Model.String() + " in session " + a.SessionID + "."
}

// finalSummaryText is the final notification: a headline and the timeline.
func finalSummaryText(t Task) string {
	head := "[Background task " + strings.ToUpper(string(t.Status)) + "] " + t.ID
	if t.Description != "" {
		head += ": " + textbound.OneLine(t.Description, 120)
	}
	return head + "\n" + Timeline(t)
}

// branchClosedText renders a closure record for the root's parent.
func branchClosedText(r ClosureRecord) string {
	var b strings.Builder
	b.WriteString("[Branch closure] Session " + r.SessionID + ": ")
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
		b.WriteString("\n- task " + f.TaskID + " — STILL RUNNING — " + sessionOrNone(f.SessionID) + " — " + textbound.OneLine(f.Err, MaxTimelineErrorRunes))
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
// the ClosureRecord has them all.
const maxClosureLines = 50
