package bgtask

import (
	"flag"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var update = flag.Bool("update", false, "rewrite golden files under testdata/")

// golden compares got with testdata/name, or rewrites it with -update.
func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		require.NoError(t, os.WriteFile(path, []byte(got), 0o644))
		return
	}
	want, err := os.ReadFile(path)
	require.NoError(t, err, "missing golden file; run go test -run %s -update", t.Name())
	assert.Equal(t, string(want), got)
}

func attempt(n int, status Status, model, session, errText string) Attempt {
	m, _ := ParseModel(model)
	return Attempt{ID: "a" + string(rune('0'+n)), Number: n, Model: m, Status: status, SessionID: session, Error: errText}
}

// TestTimelineMatchesSeedFormat pins the exact text of the design seed.
func TestTimelineMatchesSeedFormat(t *testing.T) {
	task := Task{Attempts: []Attempt{
		attempt(1, StatusError, "openai/gpt-5.4-mini", "ses_aaa", "Forbidden: Selected provider is forbidden"),
		attempt(2, StatusError, "anthropic/claude-haiku-4.5", "ses_bbb", "Too Many Requests"),
		attempt(3, StatusCompleted, "google/gemini-2.5-flash-lite", "ses_ccc", ""),
	}}
	want := `Background task attempts:
- Attempt 1 — ERROR — openai/gpt-5.4-mini — ses_aaa
  Error: Forbidden: Selected provider is forbidden
- Attempt 2 — ERROR — anthropic/claude-haiku-4.5 — ses_bbb
  Error: Too Many Requests
- Attempt 3 — COMPLETED — google/gemini-2.5-flash-lite — ses_ccc`
	assert.Equal(t, want, Timeline(task))
}

func TestTimelineGolden(t *testing.T) {
	long := strings.Repeat("provider said no; ", 40)
	tests := []struct {
		name     string
		attempts []Attempt
	}{
		{name: "forbidden_then_success", attempts: []Attempt{
			attempt(1, StatusError, "openai/gpt-5.4-mini", "ses_aaa", "Forbidden: Selected provider is forbidden"),
			attempt(2, StatusCompleted, "google/gemini-2.5-flash-lite", "ses_ccc", ""),
		}},
		{name: "no_fallback", attempts: []Attempt{
			attempt(1, StatusError, "openai/gpt-5.4-mini", "ses_aaa", "Too Many Requests"),
		}},
		{name: "session_failed_no_session", attempts: []Attempt{
			attempt(1, StatusError, "openai/gpt-5.4-mini", "", "session start failed on openai/gpt-5.4-mini: dial tcp: connection refused"),
			attempt(2, StatusError, "google/gemini-2.5-flash-lite", "ses_bbb", "Overloaded"),
		}},
		{name: "pending_reasons", attempts: []Attempt{
			attempt(1, StatusError, "openai/gpt-5.4-mini", "ses_aaa", "Too Many Requests"),
			{ID: "a2", Number: 2, Model: Model{Provider: "google", ID: "gemini-2.5-flash-lite"}, Status: StatusPending, Pending: PendingAwaitingSession},
		}},
		{name: "cancelled_and_interrupt", attempts: []Attempt{
			attempt(1, StatusInterrupt, "openai/gpt-5.4-mini", "ses_aaa", ""),
			attempt(2, StatusCancelled, "anthropic/claude-haiku-4.5", "ses_bbb", ""),
		}},
		{name: "multiline_long_error_bounded", attempts: []Attempt{
			{ID: "a1", Number: 1, Model: Model{Provider: "anthropic", ID: "claude-sonnet-4.5", Variant: "thinking"}, Status: StatusError, SessionID: "ses_aaa",
				Error: "upstream error:\n  status 529\n" + long},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Timeline(Task{Attempts: tt.attempts})
			golden(t, "timeline_"+tt.name+".golden", got)
			lines := strings.Split(got, "\n")
			assert.Equal(t, "Background task attempts:", lines[0])
			for _, l := range lines[1:] {
				assert.True(t, strings.HasPrefix(l, "- Attempt ") || strings.HasPrefix(l, "  Error: "), "line %q", l)
				if strings.HasPrefix(l, "  Error: ") {
					assert.LessOrEqual(t, len([]rune(strings.TrimPrefix(l, "  Error: "))), maxTimelineErrorRunes)
				}
			}
		})
	}
}

func TestNotificationTexts(t *testing.T) {
	failed := attempt(1, StatusError, "openai/gpt-5.4-mini", "ses_aaa", "Forbidden: Selected provider is forbidden")
	next := attempt(2, StatusPending, "google/gemini-2.5-flash-lite", "", "")
	golden(t, "notify_retry_scheduled.golden", retryScheduledText(failed, next))
	ready := attempt(2, StatusRunning, "google/gemini-2.5-flash-lite", "ses_ccc", "")
	golden(t, "notify_retry_session_ready.golden", retrySessionReadyText(ready))
	final := Task{ID: "task-1", Description: "find the flaky test", Status: StatusCompleted,
		CompletedAt: time.Time{}, Attempts: []Attempt{failed, attempt(2, StatusCompleted, "google/gemini-2.5-flash-lite", "ses_ccc", "")}}
	golden(t, "notify_final_summary.golden", finalSummaryText(final))
}

func TestBranchClosedText(t *testing.T) {
	rec := ClosureReport{SessionID: "ses_chat", Stopped: []StoppedRun{
		{TaskID: "task-2", SessionID: "ses_b", Status: StatusCancelled},
		{TaskID: "task-3", SessionID: "ses_c", Status: StatusCompleted},
	}, Failed: []StoppedRun{{TaskID: "task-4", SessionID: "ses_d", Err: "host unreachable\nretry later"}}}
	golden(t, "notify_branch_closed.golden", branchClosedText(rec))

	var many ClosureReport
	for i := range maxClosureLines + 7 {
		many.Stopped = append(many.Stopped, StoppedRun{TaskID: "t" + strconv.Itoa(i), Status: StatusCancelled})
	}
	text := branchClosedText(many)
	assert.Equal(t, maxClosureLines+2, strings.Count(text, "\n")+1, "headline, the cap, and the rest counted")
	assert.True(t, strings.HasSuffix(text, "- … and 7 more"), text)
}
