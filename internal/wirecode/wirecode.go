// Package wirecode names the bgtask sentinel errors on a wire — HTTP
// (bgtaskhttp) and a fleet's inbox (pgledger) — and turns a name back
// into an error that matches its sentinel.
package wirecode

import (
	"context"
	"errors"
	"net/http"

	"github.com/bgtask/bgtask"
)

// Sentinel is a sentinel error, its wire name and its HTTP status.
type Sentinel struct {
	Err    error
	Code   string
	Status int
}

// Sentinels are bgtask's, and the context's, most specific first.
var Sentinels = []Sentinel{
	{bgtask.ErrUnknownTask, "unknown_task", http.StatusNotFound},
	{bgtask.ErrUnknownSession, "unknown_session", http.StatusNotFound},
	{bgtask.ErrForgotten, "forgotten", http.StatusNotFound},
	{bgtask.ErrBranchClosing, "branch_closing", http.StatusConflict},
	{bgtask.ErrNotRunning, "not_running", http.StatusConflict},
	{bgtask.ErrKeyHeld, "key_held", http.StatusConflict},
	{errors.ErrUnsupported, "unsupported", http.StatusConflict},
	{bgtask.ErrPromptRefused, "prompt_refused", http.StatusConflict},
	{bgtask.ErrInvalidArgument, "invalid_argument", http.StatusBadRequest},
	{bgtask.ErrBranchNotStopped, "branch_not_stopped", http.StatusConflict},
	{bgtask.ErrStopPending, "stop_pending", http.StatusConflict},
	{bgtask.ErrNotCooling, "not_cooling", http.StatusConflict},
	{bgtask.ErrShutdown, "shutdown", http.StatusServiceUnavailable},
	{bgtask.ErrJournal, "journal", http.StatusServiceUnavailable},
	{context.DeadlineExceeded, "deadline_exceeded", http.StatusGatewayTimeout},
	{context.Canceled, "canceled", http.StatusRequestTimeout},
}

// Coded is an error that names its own wire code and HTTP status: one a
// Source of bgtaskhttp's gives that is no bgtask sentinel (a fleet's
// "owner_gone").
type Coded interface {
	error
	Code() string
	Status() int
}

// Of is the code and status of err: its first sentinel's, else those of
// the Coded error it wraps; ok is false if it has neither. An error's own
// methods (Is, Unwrap, Code, Status: a Host's code) that panic, or a
// status that is no HTTP status, count as none.
func Of(err error) (code string, status int, ok bool) {
	defer func() {
		if recover() != nil {
			code, status, ok = "", 0, false
		}
	}()
	for _, s := range Sentinels {
		if errors.Is(err, s.Err) {
			return s.Code, s.Status, true
		}
	}
	var c Coded
	if errors.As(err, &c) {
		if code, status = c.Code(), c.Status(); status >= 400 && status <= 599 && code != "" {
			return code, status, true
		}
	}
	return "", 0, false
}

// SentinelOf returns the sentinel code names, or nil.
func SentinelOf(code string) error {
	for _, s := range Sentinels {
		if s.Code == code {
			return s.Err
		}
	}
	return nil
}

// Error is an error that crossed a wire as its text and code: it reads
// as the text and matches the sentinel the code names.
type Error struct {
	Text string
	Code string
}

func (e *Error) Error() string { return e.Text }

// Is reports whether target is the sentinel e's Code names.
func (e *Error) Is(target error) bool {
	s := SentinelOf(e.Code)
	return s != nil && s == target
}
