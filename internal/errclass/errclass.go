// Package errclass recognises what kind of failure a child session reported,
// from typed errors (an HTTP status) or from the messages common providers
// send. The root package decides retries from the class.
package errclass

import (
	"context"
	"errors"
	"net"
	"strings"
)

// Class is a kind of failure.
type Class int

// The classes. Unknown is the zero value: nothing was recognised.
const (
	Unknown Class = iota
	RateLimited
	Overloaded
	ServerError
	Forbidden
	Unauthorized
	ModelNotFound
	Timeout
	ContextOverflow
	Validation
	Aborted
	OutputLimit
	ContentFilter
)

var names = [...]string{
	Unknown:         "unknown",
	RateLimited:     "rate_limited",
	Overloaded:      "overloaded",
	ServerError:     "server_error",
	Forbidden:       "forbidden",
	Unauthorized:    "unauthorized",
	ModelNotFound:   "model_not_found",
	Timeout:         "timeout",
	ContextOverflow: "context_overflow",
	Validation:      "validation",
	Aborted:         "aborted",
	OutputLimit:     "output_limit",
	ContentFilter:   "content_filter",
}

func (c Class) String() string {
	if c < 0 || int(c) >= len(names) {
		return "unknown"
	}
	return names[c]
}

// Retryable reports whether another model may succeed where this one failed.
func (c Class) Retryable() bool {
	switch c {
	case RateLimited, Overloaded, ServerError, Forbidden, Unauthorized, ModelNotFound, Timeout:
		return true
	}
	return false
}

// statusCoder is implemented by provider errors that carry an HTTP status.
type statusCoder interface{ StatusCode() int }

// httpStatuser is the other common spelling of the same method.
type httpStatuser interface{ HTTPStatus() int }

// Classify returns the class of err, looking at the whole chain: a status
// code wins over the message; context errors are recognised by identity.
func Classify(err error) Class {
	if err == nil {
		return Unknown
	}
	if c := FromStatus(statusOf(err)); c != Unknown {
		// A 400 often means "context too long"; let the message refine it.
		if c != Validation {
			return c
		}
		if m := FromMessage(err.Error()); m == ContextOverflow {
			return m
		}
		return c
	}
	switch {
	case errors.Is(err, context.Canceled):
		return Aborted
	case errors.Is(err, context.DeadlineExceeded):
		return Timeout
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return Timeout
	}
	return FromMessage(err.Error())
}

func statusOf(err error) int {
	var sc statusCoder
	if errors.As(err, &sc) {
		return sc.StatusCode()
	}
	var hs httpStatuser
	if errors.As(err, &hs) {
		return hs.HTTPStatus()
	}
	return 0
}

// FromStatus maps an HTTP status to a class; 0 and unmapped codes are Unknown.
func FromStatus(code int) Class {
	switch {
	case code == 429:
		return RateLimited
	case code == 503 || code == 529:
		return Overloaded
	case code == 401:
		return Unauthorized
	case code == 403:
		return Forbidden
	case code == 404:
		return ModelNotFound
	case code == 408 || code == 504:
		return Timeout
	case code == 413:
		return ContextOverflow
	case code == 400 || code == 422:
		return Validation
	case code >= 500 && code <= 599:
		return ServerError
	}
	return Unknown
}

// patterns are checked in order; the first match wins. Non-retryable kinds
// come first so "invalid request: rate limit field" is not a rate limit.
var patterns = []struct {
	class Class
	subs  []string
}{
	{OutputLimit, []string{"max_tokens", "max output tokens", "maximum output", "output limit", "output token limit"}},
	{ContentFilter, []string{"content_filter", "content filter", "content policy", "content management policy", "safety system", "responsible ai"}},
	{ContextOverflow, []string{"context_length_exceeded", "context length", "context window", "maximum context", "prompt is too long", "too many tokens", "context overflow"}},
	{Aborted, []string{"aborted", "operation was canceled", "context canceled"}},
	{Validation, []string{"validation", "invalid request", "invalid_request", "bad request"}},
	{RateLimited, []string{"rate limit", "rate_limit", "too many requests", "429", "quota exceeded", "resource_exhausted", "resource exhausted"}},
	{Overloaded, []string{"overloaded", "529", "503", "service unavailable", "capacity"}},
	{Forbidden, []string{"forbidden", "403", "permission denied"}},
	{Unauthorized, []string{"unauthorized", "401", "invalid api key", "authentication"}},
	{ModelNotFound, []string{"model not found", "model_not_found", "no such model", "unknown model", "model does not exist"}},
	{Timeout, []string{"timeout", "timed out", "deadline exceeded"}},
	{ServerError, []string{"internal server error", "bad gateway", "500", "502", "server error"}},
}

// FromMessage recognises common provider messages, case-insensitively.
func FromMessage(msg string) Class {
	if msg == "" {
		return Unknown
	}
	lower := strings.ToLower(msg)
	for _, p := range patterns {
		for _, s := range p.subs {
			if containsTerm(lower, s) {
				return p.class
			}
		}
	}
	return Unknown
}

// containsTerm reports whether s occurs in msg; a status code ("429") must
// stand alone, not inside a longer number ("1429 ms").
func containsTerm(msg, s string) bool {
	if !isDigits(s) {
		return strings.Contains(msg, s)
	}
	for i := 0; ; {
		j := strings.Index(msg[i:], s)
		if j < 0 {
			return false
		}
		start, end := i+j, i+j+len(s)
		if (start == 0 || !isDigit(msg[start-1])) && (end == len(msg) || !isDigit(msg[end])) {
			return true
		}
		i = start + 1
	}
}

func isDigit(b byte) bool { return b >= '0' && b <= '9' }

func isDigits(s string) bool {
	for i := range len(s) {
		if !isDigit(s[i]) {
			return false
		}
	}
	return s != ""
}
