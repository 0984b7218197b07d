package main

import (
	"bytes"
	"io"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The program runs the chain to its third model and the parent hears each
// retry, then the summary; what it prints is what the README shows.
func TestQuickStartRuns(t *testing.T) {
	r, w, err := os.Pipe()
	require.NoError(t, err)
	stdout := os.Stdout
	os.Stdout = w
	var out bytes.Buffer
	copied := make(chan error, 1)
	go func() { _, err := io.Copy(&out, r); copied <- err }()
	func() {
		defer func() { os.Stdout = stdout }()
		main()
	}()
	require.NoError(t, w.Close())
	require.NoError(t, <-copied)

	var kinds []string
	for _, line := range strings.Split(out.String(), "\n") {
		if k, ok := strings.CutPrefix(line, "parent: "); ok {
			kinds = append(kinds, k)
		}
	}
	assert.Equal(t, []string{"retry_scheduled", "retry_session_ready", "retry_scheduled", "retry_session_ready", "final_summary", "all_complete"}, kinds,
		"Shutdown delivers what is queued before main returns")
	assert.Contains(t, out.String(), "completed | six times seven is 42\n")
	assert.Greater(t, strings.Index(out.String(), "completed | "), strings.LastIndex(out.String(), "parent: "),
		"as the README says, every notification is printed before the result")
	sessions := regexp.MustCompile(`fn_[0-9a-f-]{36}`)
	assert.Contains(t, sessions.ReplaceAllString(out.String(), "fn_…"), `Background task attempts:
- Attempt 1 — ERROR — openai/gpt-5.4-mini — fn_…
  Error: 403 Forbidden: Selected provider is forbidden
- Attempt 2 — ERROR — anthropic/claude-haiku-4.5 — fn_…
  Error: 429 Too Many Requests
- Attempt 3 — COMPLETED — google/gemini-2.5-flash-lite — fn_…`)
}

// The README's Quick start is this program, from its package clause on, so
// a reader can copy it whole.
func TestTheREADMEShowsThisProgram(t *testing.T) {
	src, err := os.ReadFile("main.go")
	require.NoError(t, err)
	readme, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	_, body, ok := strings.Cut(string(src), "package main\n")
	require.True(t, ok)
	assert.Contains(t, string(readme), "```go\npackage main\n"+body+"```\n", "README's Quick start differs from examples/quickstart/main.go")
}
