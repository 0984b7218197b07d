// Package errclass recognises what kind of failure a child session reported,
// from typed errors (an HTTP status method or field, as the official provider
// SDKs carry) or from the messages common providers send, and reads the
// retry delay a provider asked for. The root package decides retries from the
// class.
package errclass

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Class is a kind of failure. The zero value is Unknown.
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

// String returns the class's snake_case name; out-of-range values are
// "unknown".
func (c Class) String() string {
	if c < 0 || int(c) >= len(names) {
		return "unknown"
	}
	return names[c]
}

// Retryable reports whether another model may succeed where this one failed:
// rate limits, overload, server errors, a forbidden or unauthorized provider,
// a model not found and timeouts.
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

// retryAfterer is implemented by errors that know how long to wait.
type retryAfterer interface{ RetryAfter() time.Duration }

// Classify returns the class of err, looking at the whole chain. An HTTP
// status wins over the message: the first error in the chain (outermost
// first, errors.Join trees depth first) with a StatusCode() int or
// HTTPStatus() int method, or an exported int field named StatusCode,
// HTTPStatusCode, HTTPStatus, Status or Code, or a Response, HTTPResponse
// or RawResponse field that points to an http.Response or a struct shaped
// like one (see responseFields), holding a value in 100–599. A 400 or 422
// is refined by the message (err's and the status carrier's) to
// ContextOverflow, ContentFilter, Unauthorized or ModelNotFound when it
// names one of those precisely (a bad API key, a provider code such as
// model_not_found, a context-length message); otherwise it is Validation.
// Without a status, context errors are recognised by identity, net.Error
// timeouts by their method, and the rest by FromMessage. Looking for a
// status skips typed nil pointers, unexported fields and non-struct errors
// rather than panicking; fields are located once per type. Classify is safe
// for concurrent use.
func Classify(err error) Class {
	if err == nil {
		return Unknown
	}
	if code, carrier := statusOf(err); code != 0 {
		if c := FromStatus(code); c != Unknown {
			// The carrier's own message may be hidden by a wrapper's.
			msg := err.Error()
			if cm := carrier.Error(); !strings.Contains(msg, cm) {
				msg += "\n" + cm
			}
			return refine(c, msg)
		}
	}
	switch {
	case errors.Is(err, context.Canceled):
		return Aborted
	case errors.Is(err, context.DeadlineExceeded):
		return Timeout
	}
	timedOut, found, hasAs := false, false, false
	walk(err, func(e error) bool {
		if _, ok := e.(interface{ As(any) bool }); ok {
			hasAs = true
		}
		ne, ok := e.(net.Error)
		timedOut, found = ok && ne.Timeout(), ok
		return ok
	})
	if !found && hasAs { // an error that says what it is only through As
		var ne net.Error
		timedOut = errors.As(err, &ne) && ne.Timeout()
	}
	if timedOut {
		return Timeout
	}
	return FromMessage(err.Error())
}

// refine narrows the class a status gave by what the message says. Only a
// 400/422 is refined: providers use it for context overflow, content
// filtering and (Google) a bad API key as well as for plain validation.
func refine(c Class, msg string) Class {
	if c != Validation {
		return c
	}
	switch m := fromCodes(msg); m {
	case ContextOverflow, ContentFilter, Unauthorized, ModelNotFound:
		return m
	}
	lower := strings.ToLower(msg)
	for _, p := range patterns {
		if (p.class == ContextOverflow || p.class == ContentFilter) && p.matches(msg, lower) {
			return p.class
		}
	}
	return c
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

// FromMessage recognises common provider messages. A status the message
// states as one wins and is refined as in Classify: "404 Not Found", the
// number after an SDK's quoted URL (`POST "https://…": 529 `), or a number
// after "HTTP", "status", "status code", "code" or "Error" ("Error 429,",
// `"code": 404`). Otherwise provider codes that name one failure
// (model_not_found, invalid_api_key, not_found_error, authentication_error,
// permission_error, rate_limit_error, overloaded_error, api_error,
// context_length_exceeded, …, and Google's RESOURCE_EXHAUSTED, UNAVAILABLE,
// PERMISSION_DENIED, UNAUTHENTICATED, NOT_FOUND and DEADLINE_EXCEEDED) win
// over generic wording such as "invalid_request_error" or INVALID_ARGUMENT,
// which is checked before the generic retryable wording and bare status
// numbers. Words match case-insensitively, codes as whole words; Google's
// UNAVAILABLE, UNAUTHENTICATED, NOT_FOUND, INVALID_ARGUMENT and INTERNAL
// only in capitals; a bare status number only standing alone ("429", not
// "1429" or "429ms").
func FromMessage(msg string) Class {
	if msg == "" {
		return Unknown
	}
	if len(msg) > maxCachedMessage {
		return fromMessage(msg)
	}
	msgCache.mu.Lock()
	c, ok := msgCache.m[msg]
	msgCache.mu.Unlock()
	if ok {
		return c
	}
	c = fromMessage(msg)
	msgCache.mu.Lock()
	if len(msgCache.m) >= maxCachedMessages {
		clear(msgCache.m) // a burst of distinct messages: start again
	}
	msgCache.m[msg] = c
	msgCache.mu.Unlock()
	return c
}

// The message cache: a provider sends the same few messages again and
// again (a rate limit hits many tasks at once), and matching a message is
// most of what classifying it costs. The class depends on the text alone,
// so a hit is exact. It is bounded in entries and in message length.
const (
	maxCachedMessages = 4096
	maxCachedMessage  = 1024
)

var msgCache = struct {
	mu sync.Mutex
	m  map[string]Class
}{m: make(map[string]Class)}

func fromMessage(msg string) Class {
	if c := FromStatus(statusInMessage(msg)); c != Unknown {
		return refine(c, msg)
	}
	if c := fromCodes(msg); c != Unknown {
		return c
	}
	lower := strings.ToLower(msg)
	for _, p := range patterns {
		if p.matches(msg, lower) {
			return p.class
		}
	}
	return Unknown
}

// rule is one class's words: subs match the lowercased message as
// substrings (or, for digits, as standalone numbers), tokens match the
// lowercased message as whole words or phrases, caps match the message as
// it is, as whole words.
type rule struct {
	class  Class
	subs   []string
	tokens []string
	caps   []string
}

func (r rule) matches(msg, lower string) bool {
	for _, s := range r.subs {
		if containsTerm(lower, s) {
			return true
		}
	}
	for _, s := range r.tokens {
		if containsToken(lower, s) {
			return true
		}
	}
	for _, s := range r.caps {
		if containsToken(msg, s) {
			return true
		}
	}
	return false
}

// codes are provider codes and phrases that name one failure precisely. They
// are checked, in order, before patterns, so that a body whose error type is
// the generic "invalid_request_error" but whose code is "model_not_found"
// is a missing model.
var codes = []rule{
	{class: ContextOverflow, tokens: []string{"context_length_exceeded", "request_too_large", "string_above_max_length"}},
	{class: ContentFilter, tokens: []string{"content_filter", "content_policy_violation"}},
	{class: ModelNotFound, tokens: []string{"model_not_found", "not_found_error", "does not exist or you do not have access"}, caps: []string{"NOT_FOUND"}},
	{class: Unauthorized, tokens: []string{"invalid_api_key", "api_key_invalid", "authentication_error", "incorrect api key", "invalid api key", "api key not valid", "invalid x-api-key"}, caps: []string{"UNAUTHENTICATED"}},
	{class: Forbidden, tokens: []string{"permission_error", "permission_denied"}},
	{class: RateLimited, tokens: []string{"rate_limit_error", "rate_limit_exceeded", "insufficient_quota", "resource_exhausted"}},
	{class: Overloaded, tokens: []string{"overloaded_error"}, caps: []string{"UNAVAILABLE"}},
	{class: Timeout, tokens: []string{"deadline_exceeded", "timeout_error"}},
	{class: ServerError, tokens: []string{"api_error", "server_error", "internal_error"}},
}

func fromCodes(msg string) Class {
	lower := strings.ToLower(msg)
	for _, r := range codes {
		if r.matches(msg, lower) {
			return r.class
		}
	}
	return Unknown
}

// patterns are generic wording, checked in order after codes; the first
// match wins. Non-retryable kinds come first so "invalid request: rate limit
// field" is not a rate limit, and validation comes before the output limit
// so "invalid_request_error: max_tokens must be …" is a bad request.
var patterns = []rule{
	{class: ContextOverflow, subs: []string{"context length", "context window", "context limit", "maximum context", "prompt is too long", "too many tokens", "context overflow", "exceeds the maximum number of tokens"}},
	{class: ContentFilter, subs: []string{"content filter", "content policy", "content management policy", "safety system", "responsible ai"}},
	{class: Aborted, subs: []string{"aborted", "operation was canceled", "context canceled"}},
	{class: Validation, subs: []string{"validation", "invalid request", "invalid_request", "bad request"}, caps: []string{"INVALID_ARGUMENT", "FAILED_PRECONDITION"}},
	{class: OutputLimit, subs: []string{"max_tokens", "max output tokens", "maximum output", "output limit", "output token limit"}},
	{class: RateLimited, subs: []string{"rate limit", "rate_limit", "too many requests", "429", "quota exceeded", "resource exhausted"}},
	{class: Overloaded, subs: []string{"overloaded", "529", "503", "service unavailable", "capacity"}},
	{class: Forbidden, subs: []string{"forbidden", "403", "permission denied"}},
	{class: Unauthorized, subs: []string{"unauthorized", "401", "authentication"}},
	{class: ModelNotFound, subs: []string{"model not found", "no such model", "unknown model", "model does not exist", "404"}},
	{class: Timeout, subs: []string{"timeout", "timed out", "deadline exceeded"}},
	{class: ServerError, subs: []string{"internal server error", "bad gateway", "500", "502", "server error"}, caps: []string{"INTERNAL"}},
}

// statusInMessage returns the first mapped HTTP status msg states as one
// (see FromMessage), or 0.
func statusInMessage(msg string) int {
	for i := 0; i < len(msg); i++ {
		if !isDigit(msg[i]) {
			continue
		}
		j := i
		for j < len(msg) && isDigit(msg[j]) {
			j++
		}
		if j-i == 3 && (j == len(msg) || !isWordByte(msg[j])) {
			code, _ := strconv.Atoi(msg[i:j])
			if FromStatus(code) != Unknown && statedAsStatus(msg[:i], msg[j:], code) {
				return code
			}
		}
		i = j
	}
	return 0
}

// statusWords introduce a status number: "HTTP 429", "status code: 503",
// `"code": 404`, genai's "Error 429,".
var statusWords = []string{"http", "http/1.0", "http/1.1", "http/2", "http/2.0", "status", "statuscode", "status_code", "code", "error"}

// statedAsStatus reports whether the number code, between before and
// after, is stated as an HTTP status.
func statedAsStatus(before, after string, code int) bool {
	if text := statusText(code); text != "" {
		rest := strings.TrimLeft(after, " ")
		if len(rest) < len(after) && len(rest) >= len(text) && strings.EqualFold(rest[:len(text)], text) {
			return true
		}
	}
	// An SDK message: METHOD "URL": NNN …
	if head, ok := strings.CutSuffix(before, `": `); ok {
		if k := strings.LastIndexByte(head, '"'); k >= 0 {
			url := strings.ToLower(head[k+1:])
			if strings.HasPrefix(url, "https://") || strings.HasPrefix(url, "http://") {
				return true
			}
		}
	}
	head := strings.ToLower(strings.TrimRight(before, ` :="'`))
	for _, w := range statusWords {
		if rest, ok := strings.CutSuffix(head, w); ok && (rest == "" || !isWordByte(rest[len(rest)-1])) {
			return true
		}
	}
	return false
}

// containsTerm reports whether s occurs in msg; a status code ("429") must
// stand alone, not inside a longer number ("1429") nor before a unit
// ("429ms").
func containsTerm(msg, s string) bool {
	if !isDigits(s) {
		return strings.Contains(msg, s)
	}
	return containsBounded(msg, s, isDigit, isWordByte)
}

// containsToken reports whether s occurs in msg as a whole word: not
// preceded or followed by a letter, digit or underscore.
func containsToken(msg, s string) bool {
	return containsBounded(msg, s, isWordByte, isWordByte)
}

// containsBounded reports whether s occurs in msg with a byte before it
// that is not inLeft and a byte after it that is not inRight (or an end).
func containsBounded(msg, s string, inLeft, inRight func(byte) bool) bool {
	for i := 0; ; {
		j := strings.Index(msg[i:], s)
		if j < 0 {
			return false
		}
		start, end := i+j, i+j+len(s)
		if (start == 0 || !inLeft(msg[start-1])) && (end == len(msg) || !inRight(msg[end])) {
			return true
		}
		i = start + 1
	}
}

func isDigit(b byte) bool { return b >= '0' && b <= '9' }

func isWordByte(b byte) bool {
	return isDigit(b) || b == '_' || (b >= 'a' && b <= 'z') || (b >= 'A' && b <= 'Z')
}

func isDigits(s string) bool {
	for i := range len(s) {
		if !isDigit(s[i]) {
			return false
		}
	}
	return s != ""
}

// RetryAfter returns how long the provider asked the caller to wait before
// trying again, from the first error in err's chain (outermost first,
// errors.Join trees depth first) that carries a hint:
//
//   - a RetryAfter() time.Duration method, or an exported RetryAfter
//     time.Duration field, with a positive value (zero or less is no hint);
//   - a retry-after-ms header (milliseconds, decimals allowed) or else a
//     Retry-After header (seconds, decimals allowed, or an HTTP-date read
//     relative to time.Now; a date in the past gives 0), found on an
//     exported Header field of type http.Header (or any map[string][]string
//     type), or on the Header of an exported Response, HTTPResponse or
//     RawResponse field shaped like *http.Response (the shape openai-go and
//     anthropic-sdk-go errors have).
//
// ok is false when no hint is found; a header that does not parse, is
// negative or is absurdly long (≥ 292 years) is no hint. The delay is not
// capped: callers should bound it. Like Classify, RetryAfter skips typed nil
// pointers, unexported fields and non-struct errors rather than panicking,
// and is safe for concurrent use.
func RetryAfter(err error) (d time.Duration, ok bool) {
	return retryAfterAt(err, time.Now())
}

func retryAfterAt(err error, now time.Time) (d time.Duration, ok bool) {
	walk(err, func(e error) bool {
		d, ok = nodeRetryAfter(e, now)
		return ok
	})
	return d, ok
}

func nodeRetryAfter(e error, now time.Time) (time.Duration, bool) {
	if ra, isRA := e.(retryAfterer); isRA {
		if d := ra.RetryAfter(); d > 0 {
			return d, true
		}
	}
	v, p := inspect(e)
	if p.retryAfter != nil {
		if f, ok := fieldAt(v, p.retryAfter); ok {
			if d := time.Duration(f.Int()); d > 0 {
				return d, true
			}
		}
	}
	if p.header != nil {
		if h, ok := headerAt(v, p.header); ok {
			if d, ok := retryAfterHeader(h, now); ok {
				return d, true
			}
		}
	}
	for _, rf := range p.responses {
		if r, ok := responseAt(v, rf); ok {
			if h, ok := headerAt(r, rf.header); ok {
				if d, ok := retryAfterHeader(h, now); ok {
					return d, true
				}
			}
		}
	}
	return 0, false
}

// retryAfterHeader reads retry-after-ms, then Retry-After, from h.
func retryAfterHeader(h map[string][]string, now time.Time) (time.Duration, bool) {
	if v, ok := headerValue(h, "Retry-After-Ms"); ok {
		if d, ok := parseDelay(v, float64(time.Millisecond)); ok {
			return d, true
		}
	}
	v, ok := headerValue(h, "Retry-After")
	if !ok {
		return 0, false
	}
	if d, ok := parseDelay(v, float64(time.Second)); ok {
		return d, true
	}
	if t, err := parseHTTPTime(v); err == nil {
		return max(t.Sub(now), 0), true
	}
	return 0, false
}

// parseDelay parses a non-negative decimal count of unit.
func parseDelay(s string, unit float64) (time.Duration, bool) {
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsNaN(f) || f < 0 || f*unit >= math.MaxInt64 {
		return 0, false
	}
	return time.Duration(f * unit), true
}

// headerValue returns the first value of name in h, by canonical key or, for
// maps built by hand, by any spelling.
func headerValue(h map[string][]string, name string) (string, bool) {
	if vs := h[name]; len(vs) > 0 {
		return strings.TrimSpace(vs[0]), true
	}
	for k, vs := range h {
		if len(vs) > 0 && strings.EqualFold(k, name) {
			return strings.TrimSpace(vs[0]), true
		}
	}
	return "", false
}

// maxNodes bounds the walk of an error chain, so a chain that loops back on
// itself ends.
const maxNodes = 1000

// Stated reports what an error says of itself about retrying, from the
// first error in err's chain with one of these methods: IsRetryable()
// bool decides either way; Temporary() bool or Timeout() bool returning
// true says retry (false says nothing: many errors have the method and
// know nothing). ok is false when nothing in the chain said. The methods
// are user code: a panic in one is the caller's to recover.
func Stated(err error) (retry, ok bool) {
	walk(err, func(e error) bool {
		if r, has := e.(interface{ IsRetryable() bool }); has {
			retry, ok = r.IsRetryable(), true
			return true
		}
		if t, has := e.(interface{ Temporary() bool }); has && t.Temporary() {
			retry, ok = true, true
			return true
		}
		if t, has := e.(interface{ Timeout() bool }); has && t.Timeout() {
			retry, ok = true, true
			return true
		}
		return false
	})
	return retry, ok
}

// walk calls f on err and each error it wraps, outermost first and
// errors.Join trees depth first (the order errors.As uses), until f returns
// true. Typed nil pointers are skipped, with what they would wrap.
func walk(err error, f func(error) bool) {
	var buf [8]error
	stack := append(buf[:0], err)
	for n := 0; len(stack) > 0 && n < maxNodes; n++ {
		e := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		if e == nil || isNilPointer(e) {
			continue
		}
		if f(e) {
			return
		}
		switch u := e.(type) {
		case interface{ Unwrap() error }:
			stack = append(stack, u.Unwrap())
		case interface{ Unwrap() []error }:
			errs := u.Unwrap()
			for i := len(errs) - 1; i >= 0; i-- {
				stack = append(stack, errs[i])
			}
		}
	}
}

func isNilPointer(err error) bool {
	v := reflect.ValueOf(err)
	return v.Kind() == reflect.Pointer && v.IsNil()
}

// statusOf returns the HTTP status of the first error in err's chain that
// carries one (see Classify), and that error; or 0 and nil.
func statusOf(err error) (code int, carrier error) {
	walk(err, func(e error) bool {
		code, carrier = nodeStatus(e), e
		return code != 0
	})
	if code == 0 {
		return 0, nil
	}
	return code, carrier
}

func nodeStatus(e error) int {
	if sc, ok := e.(statusCoder); ok {
		if c := sc.StatusCode(); validStatus(c) {
			return c
		}
	}
	if hs, ok := e.(httpStatuser); ok {
		if c := hs.HTTPStatus(); validStatus(c) {
			return c
		}
	}
	v, p := inspect(e)
	for _, idx := range p.status {
		if f, ok := fieldAt(v, idx); ok {
			if c, ok := intOf(f); ok && validStatus(c) {
				return c
			}
		}
	}
	for _, rf := range p.responses {
		if r, ok := responseAt(v, rf); ok {
			if f, ok := fieldAt(r, rf.status); ok {
				if c := int(f.Int()); validStatus(c) {
					return c
				}
			}
		}
	}
	return 0
}

func validStatus(c int) bool { return c >= 100 && c <= 599 }

// plan says which fields of a struct type carry a status, a retry delay or
// headers: index paths for reflect.Value.FieldByIndexErr, nil when absent.
type plan struct {
	status     [][]int         // int fields, in statusFields order
	responses  []responseField // *http.Response-like fields, in responseFields order
	header     []int           // http.Header (map[string][]string) field
	retryAfter []int           // time.Duration field
}

// responseField is a field that points to an http.Response, or to any
// struct shaped like one: idx is the field's path in the error, status and
// header the paths of the pointee's StatusCode and Header fields. Reading
// it by shape rather than by type keeps net/http (and crypto/tls with it)
// out of every program that imports the package.
type responseField struct {
	idx, status, header []int
}

// statusFields are the exported int fields read as a status, in order.
var statusFields = []string{"StatusCode", "HTTPStatusCode", "HTTPStatus", "Status", "Code"}

// responseFields are the exported fields read for a status and headers, in
// order, when they are pointers to a struct shaped like http.Response: an
// exported StatusCode int field and an exported Header field of type
// map[string][]string or one defined on it (http.Header).
var responseFields = []string{"Response", "HTTPResponse", "RawResponse"}

// plain are the struct types of the standard library's errors (errors.New,
// fmt.Errorf with one and with several %w, errors.Join): the most common
// links of a chain, known to carry nothing, so no plan is looked up.
var plain = [4]reflect.Type{
	reflect.TypeOf(errors.New("")).Elem(),
	reflect.TypeOf(fmt.Errorf("%w", errors.New(""))).Elem(),
	reflect.TypeOf(fmt.Errorf("%w %w", errors.New(""), errors.New(""))).Elem(),
	reflect.TypeOf(errors.Join(errors.New(""), errors.New(""))).Elem(),
}

var (
	plans        sync.Map // reflect.Type (a struct type) → *plan
	noPlan       = &plan{}
	rawHeader    = reflect.TypeFor[map[string][]string]()
	stringType   = reflect.TypeFor[string]()
	stringsType  = reflect.TypeFor[[]string]()
	durationType = reflect.TypeFor[time.Duration]()
)

// inspect returns e's struct value (through one pointer) and the plan for
// its type, built once per type. Non-struct errors get an empty plan.
func inspect(e error) (reflect.Value, *plan) {
	v := reflect.ValueOf(e)
	if v.Kind() == reflect.Pointer {
		if v.IsNil() {
			return reflect.Value{}, noPlan
		}
		v = v.Elem()
	}
	if v.Kind() != reflect.Struct {
		return reflect.Value{}, noPlan
	}
	t := v.Type()
	if plain[0] == t || plain[1] == t || plain[2] == t || plain[3] == t {
		return reflect.Value{}, noPlan // the standard library's own: nothing to read
	}
	if p, ok := plans.Load(t); ok {
		return v, p.(*plan)
	}
	p, _ := plans.LoadOrStore(t, planFor(t))
	return v, p.(*plan)
}

func planFor(t reflect.Type) *plan {
	p := &plan{}
	for _, name := range statusFields {
		if f, ok := t.FieldByName(name); ok && f.IsExported() && isIntKind(f.Type.Kind()) {
			p.status = append(p.status, f.Index)
		}
	}
	for _, name := range responseFields {
		if f, ok := t.FieldByName(name); ok && f.IsExported() {
			if rf, ok := responseShape(f); ok {
				p.responses = append(p.responses, rf)
			}
		}
	}
	if f, ok := t.FieldByName("Header"); ok && f.IsExported() && isHeaderType(f.Type) {
		p.header = f.Index
	}
	if f, ok := t.FieldByName("RetryAfter"); ok && f.IsExported() && f.Type == durationType {
		p.retryAfter = f.Index
	}
	if p.status == nil && p.responses == nil && p.header == nil && p.retryAfter == nil {
		return noPlan
	}
	return p
}

func isIntKind(k reflect.Kind) bool {
	switch k {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return true
	}
	return false
}

// fieldAt returns v's field at idx, or false when the path passes through a
// nil embedded pointer.
func fieldAt(v reflect.Value, idx []int) (reflect.Value, bool) {
	f, err := v.FieldByIndexErr(idx)
	return f, err == nil
}

func intOf(f reflect.Value) (int, bool) {
	switch f.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		n := f.Int()
		return int(n), n >= math.MinInt32 && n <= math.MaxInt32
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		n := f.Uint()
		return int(n), n <= math.MaxInt32
	}
	return 0, false
}

// responseShape reports whether the field f is a pointer to a struct shaped
// like http.Response, and where its StatusCode and Header are.
func responseShape(f reflect.StructField) (responseField, bool) {
	if f.Type.Kind() != reflect.Pointer || f.Type.Elem().Kind() != reflect.Struct {
		return responseField{}, false
	}
	r := f.Type.Elem()
	sc, ok := r.FieldByName("StatusCode")
	if !ok || !sc.IsExported() || sc.Type.Kind() != reflect.Int {
		return responseField{}, false
	}
	h, ok := r.FieldByName("Header")
	if !ok || !h.IsExported() || !isHeaderType(h.Type) {
		return responseField{}, false
	}
	return responseField{idx: f.Index, status: sc.Index, header: h.Index}, true
}

// isHeaderType reports whether t is map[string][]string or a type defined
// on it, such as http.Header.
func isHeaderType(t reflect.Type) bool {
	return t.Kind() == reflect.Map && t.Key() == stringType && t.Elem() == stringsType
}

// responseAt returns the struct the response field rf points to, or false
// when the pointer is nil or cannot be read (reached through an unexported
// embedded field).
func responseAt(v reflect.Value, rf responseField) (reflect.Value, bool) {
	f, ok := fieldAt(v, rf.idx)
	if !ok || f.IsNil() || !f.CanInterface() {
		return reflect.Value{}, false
	}
	return f.Elem(), true
}

// headerAt returns the header map at idx, if it can be read.
func headerAt(v reflect.Value, idx []int) (map[string][]string, bool) {
	f, ok := fieldAt(v, idx)
	if !ok || f.IsNil() || !f.CanInterface() {
		return nil, false
	}
	h, ok := f.Convert(rawHeader).Interface().(map[string][]string)
	return h, ok
}

// httpTimeFormats are the HTTP-date layouts net/http's ParseTime tries, in
// its order (RFC 9110 §5.6.7): IMF-fixdate (http.TimeFormat), the obsolete
// RFC 850 form and ANSI C's asctime form.
var httpTimeFormats = [...]string{"Mon, 02 Jan 2006 15:04:05 GMT", time.RFC850, time.ANSIC}

// parseHTTPTime parses an HTTP-date as http.ParseTime does: with the first
// of httpTimeFormats that parses it, or the last one's error.
func parseHTTPTime(text string) (t time.Time, err error) {
	for _, layout := range httpTimeFormats {
		t, err = time.Parse(layout, text)
		if err == nil {
			return t, nil
		}
	}
	return t, err
}

// statusText is http.StatusText for the statuses FromStatus maps (the only
// ones statedAsStatus asks about), "" for any other: a table of its own, so
// the package need not import net/http. 529 has no standard text.
func statusText(code int) string {
	switch code {
	case 400:
		return "Bad Request"
	case 401:
		return "Unauthorized"
	case 403:
		return "Forbidden"
	case 404:
		return "Not Found"
	case 408:
		return "Request Timeout"
	case 413:
		return "Request Entity Too Large"
	case 422:
		return "Unprocessable Entity"
	case 429:
		return "Too Many Requests"
	case 500:
		return "Internal Server Error"
	case 501:
		return "Not Implemented"
	case 502:
		return "Bad Gateway"
	case 503:
		return "Service Unavailable"
	case 504:
		return "Gateway Timeout"
	case 505:
		return "HTTP Version Not Supported"
	case 506:
		return "Variant Also Negotiates"
	case 507:
		return "Insufficient Storage"
	case 508:
		return "Loop Detected"
	case 510:
		return "Not Extended"
	case 511:
		return "Network Authentication Required"
	}
	return ""
}
