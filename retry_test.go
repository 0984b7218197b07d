package bgtask

import (
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

type statedErr struct{ msg string }

func (e statedErr) Error() string { return e.msg }

type retryableErr struct {
	statedErr
	v bool
}

func (e retryableErr) IsRetryable() bool { return e.v }

type temporaryErr struct {
	statedErr
	v bool
}

func (e temporaryErr) Temporary() bool { return e.v }

type timeoutErr struct {
	statedErr
	v bool
}

func (e timeoutErr) Timeout() bool { return e.v }

type overloaded struct{ retryableErr }

func (overloaded) StatusCode() int { return 503 }

func TestDefaultRetryableHearsWhatAnErrorSaysOfItself(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{"IsRetryable true on an unknown error", retryableErr{statedErr{msg: "opaque"}, true}, true},
		{"IsRetryable false on a 503", overloaded{retryableErr{statedErr{msg: "overloaded"}, false}}, false},
		{"Temporary true", temporaryErr{statedErr{msg: "opaque"}, true}, true},
		{"Temporary false says nothing", temporaryErr{statedErr{msg: "opaque"}, false}, false},
		{"Temporary false leaves a 429 retried", fmt.Errorf("%w: 429 Too Many Requests", temporaryErr{statedErr{msg: "x"}, false}), true},
		{"Timeout true", timeoutErr{statedErr{msg: "opaque"}, true}, true},
		{"wrapped", fmt.Errorf("calling: %w", retryableErr{statedErr{msg: "opaque"}, true}), true},
		{"Permanent wins", Permanent(retryableErr{statedErr{msg: "opaque"}, true}), false},
		{"context overflow wins", errors.Join(ReasonContextOverflow, retryableErr{statedErr{msg: "opaque"}, true}), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, DefaultRetryable(tt.err))
		})
	}
}

func TestWithRetryableSeesTheDefaultsAnswer(t *testing.T) {
	var mu sync.Mutex
	var defaults []bool
	h := newHarness(t, nil, WithRetryable(func(err error, retry bool) bool {
		mu.Lock()
		defaults = append(defaults, retry)
		mu.Unlock()
		var q *quotaError
		return retry || errors.As(err, &q)
	}))
	task := h.running("chat", func(s *Spec) { s.Models = mustModels(t, "a/one", "b/two", "c/three") })
	require.NoError(t, h.observe(Event{SessionID: task.SessionID, Kind: SessionError, Err: &quotaError{code: 400}}))
	h.settle()
	second := h.task(task.ID)
	require.Len(t, second.Attempts, 2, "the classifier made a 400 quota error retryable")
	require.NoError(t, h.observe(Event{SessionID: second.SessionID, Kind: SessionError, Err: errors.New("HTTP 503 overloaded")}))
	h.settle()
	third := h.task(task.ID)
	require.Len(t, third.Attempts, 3, "the default's own answer is kept")
	require.NoError(t, h.observe(Event{SessionID: third.SessionID, Kind: SessionError, Err: errors.New("400 invalid request")}))
	done := h.wait(task.ID)
	assert.Equal(t, StatusError, done.Status)
	mu.Lock()
	assert.Equal(t, []bool{false, true, false}, defaults, "it saw the default's answers")
	mu.Unlock()
}

func TestAPanickingRetryClassifierMakesTheFailureFinal(t *testing.T) {
	h := newHarness(t, nil, WithRetryable(func(error, bool) bool { panic("classifier bug") }))
	task := h.running("chat")
	require.NoError(t, h.observe(Event{SessionID: task.SessionID, Kind: SessionError, Err: errors.New("HTTP 503")}))
	done := h.wait(task.ID)
	assert.Equal(t, StatusError, done.Status)
	assert.Len(t, done.Attempts, 1)
	assert.Contains(t, done.Error, "classifier bug")
}
