// Command inprocess runs subagents as Go functions: each is a small tool
// loop calling a chat-completions provider over HTTP. The provider here is a
// loopback test server that forbids the first model (403), rate-limits the
// second (429 with Retry-After) and answers on the third, so every task
// falls back twice. Three tasks run under one parent; one is cancelled
// mid-flight. The program prints the parent's notifications and each
// task's timeline.
//
//	go run ./examples/inprocess
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/bgtask/bgtask"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "inprocess:", err)
		os.Exit(1)
	}
}

// --- a minimal chat-completions API -----------------------------------------

type message struct {
	Role       string     `json:"role"`
	Content    string     `json:"content,omitempty"`
	ToolCalls  []toolCall `json:"tool_calls,omitempty"`
	ToolCallID string     `json:"tool_call_id,omitempty"`
}

type toolCall struct {
	ID       string `json:"id"`
	Function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

type chatRequest struct {
	Model    string    `json:"model"`
	Messages []message `json:"messages"`
}

type chatResponse struct {
	Choices []struct {
		Message message `json:"message"`
	} `json:"choices"`
	Error *struct {
		Message string `json:"message"`
	} `json:"error,omitempty"`
}

// provider is the loopback server. Requests whose prompt says "slow" hang
// until the client gives up, and announce themselves on slowSeen.
type provider struct {
	slowSeen chan struct{}
	once     sync.Once
}

func (p *provider) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var req chatRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		writeError(w, http.StatusBadRequest, "invalid request: "+err.Error())
		return
	}
	switch req.Model {
	case "gpt-5.4-mini":
		writeError(w, http.StatusForbidden, "Forbidden: Selected provider is forbidden")
		return
	case "claude-haiku-4.5":
		w.Header().Set("Retry-After", "2")
		writeError(w, http.StatusTooManyRequests, "Too Many Requests")
		return
	}
	if strings.Contains(req.Messages[0].Content, "slow") {
		p.once.Do(func() { close(p.slowSeen) })
		<-r.Context().Done()
		return
	}
	last := req.Messages[len(req.Messages)-1]
	var reply message
	if last.Role == "user" {
		// First turn: ask for the word_count tool.
		reply = message{Role: "assistant", ToolCalls: []toolCall{{ID: "call_1"}}}
		reply.ToolCalls[0].Function.Name = "word_count"
		reply.ToolCalls[0].Function.Arguments = strconv.Quote(last.Content)
	} else {
		reply = message{Role: "assistant", Content: "The prompt has " + last.Content + " words."}
	}
	_ = json.NewEncoder(w).Encode(map[string]any{"choices": []map[string]any{{"message": reply}}})
}

func writeError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]string{"message": msg}})
}

// apiError is a provider failure; bgtask's classifier reads StatusCode.
type apiError struct {
	Status     int
	Message    string
	RetryAfter string
}

func (e *apiError) Error() string {
	s := strconv.Itoa(e.Status) + " " + e.Message
	if e.RetryAfter != "" {
		s += " (retry after " + e.RetryAfter + "s)"
	}
	return s
}

func (e *apiError) StatusCode() int { return e.Status }

type client struct {
	base string
	http *http.Client
}

func (c *client) complete(ctx context.Context, model string, msgs []message) (message, error) {
	body, _ := json.Marshal(chatRequest{Model: model, Messages: msgs})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return message{}, err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return message{}, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return message{}, err
	}
	var out chatResponse
	if err := json.Unmarshal(data, &out); err != nil {
		return message{}, fmt.Errorf("decode %d response: %w", resp.StatusCode, err)
	}
	if resp.StatusCode != http.StatusOK {
		e := &apiError{Status: resp.StatusCode, RetryAfter: resp.Header.Get("Retry-After")}
		if out.Error != nil {
			e.Message = out.Error.Message
		}
		return message{}, e
	}
	if len(out.Choices) == 0 {
		return message{}, bgtask.Permanent(fmt.Errorf("provider returned no choices"))
	}
	return out.Choices[0].Message, nil
}

// --- the subagent: a tool loop ---------------------------------------------

func subagent(c *client) bgtask.RunFunc {
	return func(ctx context.Context, run bgtask.Run) (string, error) {
		msgs := []message{{Role: "user", Content: run.Prompt}}
		for turn := 0; turn < 8; turn++ {
			run.Busy()
			reply, err := c.complete(ctx, run.Model.ID, msgs)
			if err != nil {
				return "", err
			}
			if len(reply.ToolCalls) == 0 {
				return reply.Content, nil
			}
			msgs = append(msgs, reply)
			for _, call := range reply.ToolCalls {
				msgs = append(msgs, message{Role: "tool", ToolCallID: call.ID, Content: runTool(call)})
			}
		}
		return "", bgtask.Permanent(fmt.Errorf("tool loop did not finish in 8 turns"))
	}
}

func runTool(call toolCall) string {
	if call.Function.Name != "word_count" {
		return "unknown tool " + call.Function.Name
	}
	text, err := strconv.Unquote(call.Function.Arguments)
	if err != nil {
		return "bad arguments"
	}
	return strconv.Itoa(len(strings.Fields(text)))
}

// --- the harness ------------------------------------------------------------

func run(ctx context.Context, w io.Writer) error {
	prov := &provider{slowSeen: make(chan struct{})}
	srv := httptest.NewServer(prov)
	defer srv.Close()
	c := &client{base: srv.URL, http: srv.Client()}

	var mu sync.Mutex // keeps printed notifications whole
	m, err := bgtask.Open(ctx, bgtask.NewFuncHost(subagent(c)),
		bgtask.WithIDs(bgtask.SequentialIDs()),
		bgtask.WithNotifier(bgtask.NotifierFunc(func(ctx context.Context, n bgtask.Notification) error {
			mu.Lock()
			defer mu.Unlock()
			fmt.Fprintf(w, "→ %s [%s] %s\n", n.ParentSessionID, n.TaskID, firstLine(n.Text))
			return nil
		})),
	)
	if err != nil {
		return err
	}
	defer m.Shutdown(context.Background())

	models := []bgtask.Model{
		{Provider: "openai", ID: "gpt-5.4-mini"},
		{Provider: "anthropic", ID: "claude-haiku-4.5"},
		{Provider: "google", ID: "gemini-2.5-flash-lite"},
	}
	var ids []string
	for _, prompt := range []string{
		"count the words in this short prompt",
		"how many words are here",
		"slow: crawl the whole wiki and count every word",
	} {
		task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "ses_parent", Description: prompt, Prompt: prompt, Models: models})
		if err != nil {
			return err
		}
		ids = append(ids, task.ID)
	}

	// Stop the slow task once its request is in flight at the provider.
	select {
	case <-prov.slowSeen:
	case <-ctx.Done():
		return ctx.Err()
	}
	if _, err := m.Stop(ctx, bgtask.Target{Task: ids[2]}); err != nil {
		return fmt.Errorf("cancel: %w", err)
	}

	var done []bgtask.Task
	for _, id := range ids {
		t, err := m.Wait(ctx, id)
		if err != nil {
			return err
		}
		done = append(done, t)
	}
	if err := m.Shutdown(ctx); err != nil { // delivers what is queued
		return err
	}
	for _, t := range done {
		fmt.Fprintf(w, "\n%s %s: %q\n%s\n", t.ID, strings.ToUpper(string(t.Status)), t.Result, bgtask.Timeline(t))
	}
	return nil
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}
