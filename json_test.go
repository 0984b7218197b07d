package bgtask

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func jsonTask() Task {
	first := Attempt{ID: "att-1", Number: 1, Token: "run-1", SessionID: "ses_aaa", Model: Model{Provider: "openai", ID: "gpt-5.4-mini"},
		Status: StatusError, Error: "Forbidden: Selected provider is forbidden", StartedAt: t0, CompletedAt: t0.Add(2 * time.Second)}
	second := Attempt{ID: "att-2", Number: 2, Token: "run-2", SessionID: "ses_ccc", Model: Model{Provider: "google", ID: "gemini-2.5-flash-lite", Variant: "fast"},
		Status: StatusCompleted, Result: "42", StartedAt: t0.Add(3 * time.Second), CompletedAt: t0.Add(9 * time.Second)}
	task := Task{ID: "task-1", ParentSessionID: "ses_parent", Description: "answer", Agent: "explore",
		Status: StatusCompleted, SessionID: "ses_ccc", Model: second.Model, StartedAt: second.StartedAt, CompletedAt: second.CompletedAt,
		Result: "42", CurrentAttemptID: "att-2", Attempts: []Attempt{first, second}, Revision: 7, LaunchedAt: t0,
		Metadata: map[string]string{"ticket": "T-1"}}
	task.Outcome = outcomeOf(task, &evidence{finish: ""}, sessionsResumable)
	return task
}

func TestJSONGolden(t *testing.T) {
	task := jsonTask()
	running := Task{ID: "task-2", ParentSessionID: "ses_parent", Status: StatusPending, Pending: PendingQueued,
		Model: Model{Provider: "a", ID: "b"}, CurrentAttemptID: "att-3", Revision: 2, LaunchedAt: t0,
		Attempts: []Attempt{{ID: "att-3", Number: 1, Token: "run-3", Model: Model{Provider: "a", ID: "b"}, Status: StatusPending, Pending: PendingQueued}}}
	tests := []struct {
		name string
		give any
	}{
		{name: "task", give: task},
		{name: "attempt", give: task.Attempts[0]},
		{name: "change", give: Change{Seq: 41, Task: running}},
		{name: "snapshot", give: Snapshot{Seq: 42, Tasks: []Task{task, running}}},
		{name: "notification", give: Notification{Kind: NotifyFinalSummary, ParentSessionID: "ses_parent", TaskID: "task-1", Task: task, Text: finalSummaryText(task)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := json.MarshalIndent(tt.give, "", "  ")
			require.NoError(t, err)
			golden(t, "json_"+tt.name+".golden", string(b))
		})
	}
}

func TestJSONFieldNamesMatchTheDesign(t *testing.T) {
	b, err := json.Marshal(jsonTask())
	require.NoError(t, err)
	s := string(b)
	for _, key := range []string{`"currentAttemptID":"att-2"`, `"attemptID":"att-1"`, `"attemptNumber":1`, `"sessionID":"ses_aaa"`,
		`"providerID":"openai"`, `"modelID":"gpt-5.4-mini"`, `"variant":"fast"`, `"status":"error"`,
		`"startedAt":"2026-04-27T12:00:00Z"`, `"completedAt":"2026-04-27T12:00:02Z"`, `"parentSessionID":"ses_parent"`} {
		assert.Contains(t, s, key)
	}
	assert.NotContains(t, s, `"pendingReason"`, "empty optional fields are omitted")
	assert.NotContains(t, s, `"activity"`)
	assert.False(t, strings.Contains(s, `0001-01-01`), "zero times are omitted")
}

func TestJSONRoundTrip(t *testing.T) {
	task := jsonTask()
	b, err := json.Marshal(task)
	require.NoError(t, err)
	var back Task
	require.NoError(t, json.Unmarshal(b, &back))
	assert.Equal(t, task, back)
}

// An attempt's model has the shape a task's has; the flat form of earlier
// versions is still read.
func TestAnAttemptsModelIsNestedAsATasksIs(t *testing.T) {
	a := Attempt{ID: "a1", Number: 1, Model: Model{Provider: "openai", ID: "gpt-5", Variant: "fast"}, Status: StatusRunning}
	b, err := json.Marshal(a)
	require.NoError(t, err)
	tb, err := json.Marshal(Task{Model: a.Model})
	require.NoError(t, err)
	var task, att map[string]any
	require.NoError(t, json.Unmarshal(b, &att))
	require.NoError(t, json.Unmarshal(tb, &task))
	assert.Equal(t, task["model"], att["model"], "one shape for a model")
	assert.NotContains(t, att, "providerID")

	var back Attempt
	require.NoError(t, json.Unmarshal(b, &back))
	assert.Equal(t, a, back)
	var old Attempt
	require.NoError(t, json.Unmarshal([]byte(`{"attemptID":"a1","attemptNumber":1,"providerID":"openai","modelID":"gpt-5","variant":"fast","status":"running"}`), &old))
	assert.Equal(t, a, old)
}
