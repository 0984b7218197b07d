package errclass

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type statusErr struct {
	code int
	msg  string
}

func (e statusErr) Error() string   { return e.msg }
func (e statusErr) StatusCode() int { return e.code }

type timeoutErr struct{}

func (timeoutErr) Error() string   { return "i/o" }
func (timeoutErr) Timeout() bool   { return true }
func (timeoutErr) Temporary() bool { return true }

func TestClassify(t *testing.T) {
	tests := []struct {
		name      string
		give      error
		want      Class
		retryable bool
	}{
		{name: "nil", give: nil, want: Unknown},
		{name: "429 status", give: statusErr{429, "slow down"}, want: RateLimited, retryable: true},
		{name: "503 status", give: statusErr{503, "x"}, want: Overloaded, retryable: true},
		{name: "529 status", give: statusErr{529, "x"}, want: Overloaded, retryable: true},
		{name: "500 status", give: statusErr{500, "x"}, want: ServerError, retryable: true},
		{name: "502 status", give: statusErr{502, "x"}, want: ServerError, retryable: true},
		{name: "403 status", give: statusErr{403, "x"}, want: Forbidden, retryable: true},
		{name: "401 status", give: statusErr{401, "x"}, want: Unauthorized, retryable: true},
		{name: "404 status", give: statusErr{404, "x"}, want: ModelNotFound, retryable: true},
		{name: "400 status", give: statusErr{400, "missing field"}, want: Validation},
		{name: "400 context length", give: statusErr{400, "This model's maximum context length is 8192 tokens"}, want: ContextOverflow},
		{name: "wrapped status", give: fmt.Errorf("provider: %w", statusErr{429, "x"}), want: RateLimited, retryable: true},
		{name: "forbidden message", give: errors.New("Forbidden: Selected provider is forbidden"), want: Forbidden, retryable: true},
		{name: "too many requests", give: errors.New("Too Many Requests"), want: RateLimited, retryable: true},
		{name: "anthropic overloaded", give: errors.New(`{"type":"overloaded_error","message":"Overloaded"}`), want: Overloaded, retryable: true},
		{name: "model not found", give: errors.New("model_not_found: gpt-9"), want: ModelNotFound, retryable: true},
		{name: "timeout message", give: errors.New("request timed out"), want: Timeout, retryable: true},
		{name: "net timeout", give: fmt.Errorf("dial: %w", timeoutErr{}), want: Timeout, retryable: true},
		{name: "deadline", give: context.DeadlineExceeded, want: Timeout, retryable: true},
		{name: "context length", give: errors.New("context_length_exceeded"), want: ContextOverflow},
		{name: "validation", give: errors.New("validation failed: prompt"), want: Validation},
		{name: "aborted", give: errors.New("The operation was aborted"), want: Aborted},
		{name: "canceled", give: context.Canceled, want: Aborted},
		{name: "unrecognised", give: errors.New("something odd"), want: Unknown},
		{name: "output limit", give: errors.New("stop_reason: max_tokens"), want: OutputLimit},
		{name: "content filter", give: errors.New("The response was filtered due to the prompt triggering content management policy"), want: ContentFilter},
		{name: "code alone", give: errors.New("HTTP 429: slow down"), want: RateLimited, retryable: true},
		{name: "digits inside a number are no code", give: errors.New("took 1500 ms to parse 4290 tokens"), want: Unknown},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Classify(tt.give)
			assert.Equal(t, tt.want, got)
			assert.Equal(t, tt.retryable, got.Retryable())
		})
	}
}

func TestClassString(t *testing.T) {
	assert.Equal(t, "rate_limited", RateLimited.String())
	assert.Equal(t, "unknown", Class(99).String())
}
