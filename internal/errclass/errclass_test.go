package errclass

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bgtask/bgtask/internal/errclass/sdkerrs"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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

// sdkCases are provider failures as the SDKs report them.
var sdkCases = []struct {
	name string
	give error
	want Class
}{
	{name: "openai 404 model_not_found", give: sdkerrs.NewOpenAI(404, "invalid_request_error", "model_not_found", "The model `gpt-9` does not exist or you do not have access to it."), want: ModelNotFound},
	{name: "openai 401 invalid_api_key", give: sdkerrs.NewOpenAI(401, "invalid_request_error", "invalid_api_key", "Incorrect API key provided: sk-abc."), want: Unauthorized},
	{name: "openai 403 region", give: sdkerrs.NewOpenAI(403, "request_forbidden", "unsupported_country_region_territory", "Country, region, or territory not supported"), want: Forbidden},
	{name: "openai 429 rate limit", give: sdkerrs.NewOpenAI(429, "requests", "rate_limit_exceeded", "Rate limit reached for gpt-4o"), want: RateLimited},
	{name: "openai 429 quota", give: sdkerrs.NewOpenAI(429, "insufficient_quota", "insufficient_quota", "You exceeded your current quota"), want: RateLimited},
	{name: "openai 500", give: sdkerrs.NewOpenAI(500, "server_error", "", "The server had an error while processing your request."), want: ServerError},
	{name: "openai 503", give: sdkerrs.NewOpenAI(503, "server_error", "", "The engine is currently overloaded"), want: Overloaded},
	{name: "openai 400 max_tokens", give: sdkerrs.NewOpenAI(400, "invalid_request_error", "", "max_tokens is too large: 100000. This model supports at most 16384 completion tokens."), want: Validation},
	{name: "openai 400 bad param", give: sdkerrs.NewOpenAI(400, "invalid_request_error", "unknown_parameter", "Unrecognized request argument supplied: foo"), want: Validation},
	{name: "openai 400 context length", give: sdkerrs.NewOpenAI(400, "invalid_request_error", "context_length_exceeded", "This model's maximum context length is 128000 tokens. However, your messages resulted in 130000 tokens."), want: ContextOverflow},
	{name: "openai 400 content filter", give: sdkerrs.NewOpenAI(400, "invalid_request_error", "content_filter", "The response was filtered"), want: ContentFilter},
	{name: "anthropic 404 not_found_error", give: sdkerrs.NewAnthropic(404, "not_found_error", "model: claude-9"), want: ModelNotFound},
	{name: "anthropic 401 authentication_error", give: sdkerrs.NewAnthropic(401, "authentication_error", "invalid x-api-key"), want: Unauthorized},
	{name: "anthropic 403 permission_error", give: sdkerrs.NewAnthropic(403, "permission_error", "Your API key does not have permission to use the specified resource."), want: Forbidden},
	{name: "anthropic 429 rate_limit_error", give: sdkerrs.NewAnthropic(429, "rate_limit_error", "This request would exceed the rate limit for your organization of 80,000 output tokens per minute."), want: RateLimited},
	{name: "anthropic 500 api_error", give: sdkerrs.NewAnthropic(500, "api_error", "Internal server error"), want: ServerError},
	{name: "anthropic 529 overloaded_error", give: sdkerrs.NewAnthropic(529, "overloaded_error", "Overloaded"), want: Overloaded},
	{name: "anthropic 400 prompt too long", give: sdkerrs.NewAnthropic(400, "invalid_request_error", "prompt is too long: 210000 tokens > 200000 maximum"), want: ContextOverflow},
	{name: "anthropic 400 context limit", give: sdkerrs.NewAnthropic(400, "invalid_request_error", "input length and `max_tokens` exceed context limit: 198000 + 8192 > 200000"), want: ContextOverflow},
	{name: "anthropic 400 max_tokens", give: sdkerrs.NewAnthropic(400, "invalid_request_error", "max_tokens: 100000 > 64000, which is the maximum allowed number of output tokens"), want: Validation},
	{name: "genai 429 RESOURCE_EXHAUSTED", give: sdkerrs.GenaiError{Code: 429, Message: "Resource has been exhausted (e.g. check quota).", Status: "RESOURCE_EXHAUSTED"}, want: RateLimited},
	{name: "genai 503 UNAVAILABLE", give: sdkerrs.GenaiError{Code: 503, Message: "The model is overloaded. Please try again later.", Status: "UNAVAILABLE"}, want: Overloaded},
	{name: "genai 403 PERMISSION_DENIED", give: sdkerrs.GenaiError{Code: 403, Message: "Permission denied on resource project x.", Status: "PERMISSION_DENIED"}, want: Forbidden},
	{name: "genai 401 UNAUTHENTICATED", give: sdkerrs.GenaiError{Code: 401, Message: "Request had invalid authentication credentials.", Status: "UNAUTHENTICATED"}, want: Unauthorized},
	{name: "genai 404 NOT_FOUND", give: sdkerrs.GenaiError{Code: 404, Message: "models/gemini-9 is not found for API version v1beta.", Status: "NOT_FOUND"}, want: ModelNotFound},
	{name: "genai 504 DEADLINE_EXCEEDED", give: sdkerrs.GenaiError{Code: 504, Message: "Deadline expired before operation could complete.", Status: "DEADLINE_EXCEEDED"}, want: Timeout},
	{name: "genai 500 INTERNAL", give: sdkerrs.GenaiError{Code: 500, Message: "An internal error has occurred.", Status: "INTERNAL"}, want: ServerError},
	{name: "genai 400 bad api key", give: sdkerrs.GenaiError{Code: 400, Message: "API key not valid. Please pass a valid API key.", Status: "INVALID_ARGUMENT"}, want: Unauthorized},
	{name: "genai 400 too many tokens", give: sdkerrs.GenaiError{Code: 400, Message: "The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).", Status: "INVALID_ARGUMENT"}, want: ContextOverflow},
	{name: "genai 400 bad value", give: sdkerrs.GenaiError{Code: 400, Message: "Invalid value at 'generation_config.temperature' (TYPE_FLOAT), \"hot\"", Status: "INVALID_ARGUMENT"}, want: Validation},
	{name: "genai pointer", give: &sdkerrs.GenaiError{Code: 429, Message: "quota", Status: "RESOURCE_EXHAUSTED"}, want: RateLimited},
}

// wrapper wraps an error without calling its Error method.
type wrapper struct {
	msg string
	err error
}

func (w wrapper) Error() string { return w.msg }
func (w wrapper) Unwrap() error { return w.err }

// TestClassifySDKErrors checks each SDK shape as returned, wrapped, joined,
// and as its message alone (a host that passes on only the text).
func TestClassifySDKErrors(t *testing.T) {
	forms := []struct {
		name string
		wrap func(error) error
	}{
		{name: "as returned", wrap: func(err error) error { return err }},
		{name: "wrapped", wrap: func(err error) error { return fmt.Errorf("start session: %w", err) }},
		{name: "joined", wrap: func(err error) error { return errors.Join(errors.New("attempt 1"), err) }},
		{name: "under an opaque wrapper", wrap: func(err error) error { return wrapper{msg: "provider failed", err: err} }},
		{name: "message only", wrap: func(err error) error { return errors.New(err.Error()) }},
	}
	for _, tt := range sdkCases {
		for _, f := range forms {
			t.Run(tt.name+"/"+f.name, func(t *testing.T) {
				got := Classify(f.wrap(tt.give))
				assert.Equal(t, tt.want, got, "%v", tt.give)
			})
		}
	}
}

func TestFromMessage(t *testing.T) {
	tests := []struct {
		name string
		give string
		want Class
	}{
		{name: "openai body model_not_found", give: `{"error":{"message":"The model gpt-9 does not exist","type":"invalid_request_error","param":null,"code":"model_not_found"}}`, want: ModelNotFound},
		{name: "openai body invalid_api_key", give: `{"error":{"message":"Incorrect API key provided","type":"invalid_request_error","code":"invalid_api_key"}}`, want: Unauthorized},
		{name: "openai body no code, bad key", give: `{"error":{"message":"Incorrect API key provided: sk-abc","type":"invalid_request_error"}}`, want: Unauthorized},
		{name: "openai body no code, missing model", give: `{"error":{"message":"The model gpt-9 does not exist or you do not have access to it.","type":"invalid_request_error"}}`, want: ModelNotFound},
		{name: "anthropic body not_found_error", give: `{"type":"error","error":{"type":"not_found_error","message":"model: claude-9"}}`, want: ModelNotFound},
		{name: "anthropic body max_tokens is validation", give: `{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: 100000 > 64000"}}`, want: Validation},
		{name: "anthropic body api_error", give: `{"type":"error","error":{"type":"api_error","message":"Internal server error"}}`, want: ServerError},
		{name: "anthropic body permission_error", give: `{"type":"error","error":{"type":"permission_error","message":"no"}}`, want: Forbidden},
		{name: "anthropic body rate_limit_error beats output tokens", give: `{"type":"error","error":{"type":"rate_limit_error","message":"exceeds 8,000 output tokens per minute; max_tokens"}}`, want: RateLimited},
		{name: "invalid request with prompt too long", give: "invalid_request_error: prompt is too long", want: ContextOverflow},
		{name: "invalid request is not a rate limit", give: "invalid request: rate limit field", want: Validation},
		{name: "google body", give: `{"error":{"code":429,"message":"Resource has been exhausted","status":"RESOURCE_EXHAUSTED"}}`, want: RateLimited},
		{name: "google json code 404", give: `{"error": {"code": 404, "message": "models/x is not found"}}`, want: ModelNotFound},
		{name: "google status alone", give: "rpc error: Status: NOT_FOUND", want: ModelNotFound},
		{name: "google UNAVAILABLE", give: "UNAVAILABLE: try later", want: Overloaded},
		{name: "google UNAUTHENTICATED", give: "UNAUTHENTICATED", want: Unauthorized},
		{name: "google INVALID_ARGUMENT", give: "INVALID_ARGUMENT: bad schema", want: Validation},
		{name: "google INTERNAL", give: "Status: INTERNAL", want: ServerError},
		{name: "google DEADLINE_EXCEEDED", give: "DEADLINE_EXCEEDED", want: Timeout},
		{name: "lowercase words are not google statuses", give: "the internal file_not_found list is unavailable here", want: Unknown},
		{name: "status text wins over validation", give: `400 nope; 404 Not Found {"type":"invalid_request_error"}`, want: ModelNotFound},
		{name: "sdk url then bare 529", give: `POST "https://api.anthropic.com/v1/messages": 529  {"type":"invalid_request_error"}`, want: Overloaded},
		{name: "status code words", give: "request failed with status code: 503", want: Overloaded},
		{name: "status equals", give: "upstream status=401 body=invalid_request", want: Unauthorized},
		{name: "http prefix", give: "HTTP/1.1 403 whatever invalid_request", want: Forbidden},
		{name: "bare 404", give: "upstream answered 404", want: ModelNotFound},
		{name: "go 404 page", give: "404 page not found", want: ModelNotFound},
		{name: "404 with unit is no code", give: "took 404ms", want: Unknown},
		{name: "404 inside a number is no code", give: "read 14040 bytes", want: Unknown},
		{name: "a number in a JSON body is no status", give: `invalid_request_error: "max_tokens": 500 is too large`, want: Validation},
		{name: "a quoted non-url before a number is no status", give: `limit "x": 500 then invalid request`, want: Validation},
		{name: "200 is skipped for a later status", give: "HTTP 200 then HTTP 429", want: RateLimited},
		{name: "400 refined to a bad key", give: `POST "https://x.test/v1": 400 Bad Request {"code":"invalid_api_key"}`, want: Unauthorized},
		{name: "400 stays validation with a model word", give: `POST "https://x.test/v1": 400 Bad Request {"message":"model must be a string"}`, want: Validation},
		{name: "empty", give: "", want: Unknown},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, FromMessage(tt.give))
		})
	}
}

type intCodeErr int

func (e intCodeErr) Error() string { return "code " + strconv.Itoa(int(e)) }

type unexportedStatus struct{ statusCode int }

func (unexportedStatus) Error() string { return "x" }

type statusInner struct{ StatusCode int }

type embedsNilPointer struct{ *statusInner }

func (embedsNilPointer) Error() string { return "x" }

type embedsValue struct{ statusInner }

func (embedsValue) Error() string { return "x" }

type fieldErr[T any] struct {
	Status         T
	HTTPStatusCode T
}

func (fieldErr[T]) Error() string { return "x" }

type grpcLike struct{ Code int }

func (e grpcLike) Error() string { return "rpc failed: " + strconv.Itoa(e.Code) }

type responseOnly struct{ Response *http.Response }

func (responseOnly) Error() string { return "x" }

// fieldAndWrap carries a status and wraps another error that carries one.
type fieldAndWrap struct {
	StatusCode int
	err        error
}

func (e fieldAndWrap) Error() string { return "x" }
func (e fieldAndWrap) Unwrap() error { return e.err }

// nilPanics panics if asked for its message or status through a nil
// pointer; its Unwrap is nil-safe, as errors.Is needs.
type nilPanics struct{ StatusCode int }

func (e *nilPanics) Error() string   { return strconv.Itoa(e.StatusCode) }
func (e *nilPanics) HTTPStatus() int { return e.StatusCode }

func (e *nilPanics) Unwrap() error {
	if e == nil {
		return nil
	}
	return errors.New("cause")
}

func TestStatusFromFields(t *testing.T) {
	tests := []struct {
		name string
		give error
		want int
	}{
		{name: "nil", give: nil, want: 0},
		{name: "StatusCode field", give: sdkerrs.NewOpenAI(404, "invalid_request_error", "", "x"), want: 404},
		{name: "Code field on a value", give: sdkerrs.GenaiError{Code: 429}, want: 429},
		{name: "Status int field", give: fieldErr[int]{Status: 503}, want: 503},
		{name: "HTTPStatusCode field", give: fieldErr[int]{HTTPStatusCode: 401}, want: 401},
		{name: "uint field", give: fieldErr[uint16]{Status: 429}, want: 429},
		{name: "string field is no status", give: fieldErr[string]{Status: "429"}, want: 0},
		{name: "huge uint is no status", give: fieldErr[uint64]{Status: 1<<63 + 429}, want: 0},
		{name: "grpc-sized code is no status", give: grpcLike{Code: 5}, want: 0},
		{name: "promoted field", give: embedsValue{statusInner{StatusCode: 403}}, want: 403},
		{name: "nil embedded pointer", give: embedsNilPointer{}, want: 0},
		{name: "unexported field", give: unexportedStatus{statusCode: 429}, want: 0},
		{name: "non-struct kind", give: intCodeErr(429), want: 0},
		{name: "response only", give: responseOnly{Response: &http.Response{StatusCode: 529}}, want: 529},
		{name: "nil response", give: responseOnly{}, want: 0},
		{name: "method", give: statusErr{code: 502}, want: 502},
		{name: "outermost wins", give: fieldAndWrap{StatusCode: 429, err: statusErr{code: 404}}, want: 429},
		{name: "zero falls through to the cause", give: fieldAndWrap{err: sdkerrs.NewAnthropic(401, "authentication_error", "x")}, want: 401},
		{name: "joined tree in order", give: errors.Join(errors.New("a"), fieldErr[int]{Status: 503}, statusErr{code: 404}), want: 503},
		{name: "nested join", give: fmt.Errorf("x: %w", errors.Join(errors.Join(errors.New("a")), sdkerrs.GenaiError{Code: 504})), want: 504},
		{name: "typed nil pointer is skipped", give: wrapper{msg: "x", err: (*nilPanics)(nil)}, want: 0},
		{name: "typed nil pointer in a join", give: errors.Join(wrapper{msg: "x", err: (*nilPanics)(nil)}, statusErr{code: 429}), want: 429},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, _ := statusOf(tt.give)
			assert.Equal(t, tt.want, code)
			assert.NotPanics(t, func() { Classify(tt.give) })
		})
	}
}

// TestClassifyConcurrentTypes classifies many errors of fresh types from
// many goroutines at once, for the race detector and the type cache.
func TestClassifyConcurrentTypes(t *testing.T) {
	gives := []error{
		&sdkerrs.OpenAIError{StatusCode: 404, Request: &http.Request{Method: "POST", URL: &url.URL{}}, Response: &http.Response{StatusCode: 404}},
		sdkerrs.GenaiError{Code: 429},
		fieldErr[int8]{Status: 100},
		fieldErr[int32]{HTTPStatusCode: 503},
		embedsValue{statusInner{StatusCode: 401}},
	}
	want := []Class{ModelNotFound, RateLimited, Unknown, Overloaded, Unauthorized}
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i, err := range gives {
				assert.Equal(t, want[i], Classify(err))
			}
		}()
	}
	wg.Wait()
}

type retryAfterMethod time.Duration

func (r retryAfterMethod) Error() string { return "slow down" }

func (r retryAfterMethod) RetryAfter() time.Duration { return time.Duration(r) }

type retryAfterField struct {
	RetryAfter time.Duration
	Header     http.Header
}

func (retryAfterField) Error() string { return "slow down" }

type rawHeaderErr struct{ Header map[string][]string }

func (rawHeaderErr) Error() string { return "slow down" }

// methodAndHeader has a zero RetryAfter method but carries a header.
type methodAndHeader struct{ Response *http.Response }

func (methodAndHeader) Error() string             { return "slow down" }
func (methodAndHeader) RetryAfter() time.Duration { return 0 }

// loop wraps itself.
type loop struct{}

func (l *loop) Error() string { return "loop" }
func (l *loop) Unwrap() error { return l }

func withHeader(h http.Header) *sdkerrs.OpenAIError {
	e := sdkerrs.NewOpenAI(429, "requests", "rate_limit_exceeded", "slow down")
	e.Response.Header = h
	return e
}

func TestRetryAfter(t *testing.T) {
	now := time.Date(2026, 4, 27, 12, 0, 0, 0, time.UTC)
	tests := []struct {
		name   string
		give   error
		want   time.Duration
		wantOK bool
	}{
		{name: "nil", give: nil},
		{name: "no hint", give: errors.New("429")},
		{name: "method", give: retryAfterMethod(3 * time.Second), want: 3 * time.Second, wantOK: true},
		{name: "method wrapped", give: fmt.Errorf("x: %w", retryAfterMethod(time.Minute)), want: time.Minute, wantOK: true},
		{name: "zero method is no hint", give: retryAfterMethod(0)},
		{name: "negative method is no hint", give: retryAfterMethod(-time.Second)},
		{name: "zero method falls through to the header", give: methodAndHeader{Response: &http.Response{Header: http.Header{"Retry-After": {"4"}}}}, want: 4 * time.Second, wantOK: true},
		{name: "field", give: retryAfterField{RetryAfter: 2 * time.Second}, want: 2 * time.Second, wantOK: true},
		{name: "field beats header", give: retryAfterField{RetryAfter: 2 * time.Second, Header: http.Header{"Retry-After": {"9"}}}, want: 2 * time.Second, wantOK: true},
		{name: "Header field", give: retryAfterField{Header: http.Header{"Retry-After": {"9"}}}, want: 9 * time.Second, wantOK: true},
		{name: "raw header map any case", give: rawHeaderErr{Header: map[string][]string{"retry-after": {" 5 "}}}, want: 5 * time.Second, wantOK: true},
		{name: "response seconds", give: withHeader(http.Header{"Retry-After": {"7"}}), want: 7 * time.Second, wantOK: true},
		{name: "response decimal seconds", give: withHeader(http.Header{"Retry-After": {"1.5"}}), want: 1500 * time.Millisecond, wantOK: true},
		{name: "response zero seconds", give: withHeader(http.Header{"Retry-After": {"0"}}), want: 0, wantOK: true},
		{name: "response ms", give: withHeader(http.Header{"Retry-After-Ms": {"1500"}}), want: 1500 * time.Millisecond, wantOK: true},
		{name: "ms beats seconds", give: withHeader(http.Header{"Retry-After-Ms": {"250"}, "Retry-After": {"1"}}), want: 250 * time.Millisecond, wantOK: true},
		{name: "bad ms falls back to seconds", give: withHeader(http.Header{"Retry-After-Ms": {"soon"}, "Retry-After": {"1"}}), want: time.Second, wantOK: true},
		{name: "http date", give: withHeader(http.Header{"Retry-After": {now.Add(90 * time.Second).Format(http.TimeFormat)}}), want: 90 * time.Second, wantOK: true},
		{name: "http date in the past", give: withHeader(http.Header{"Retry-After": {now.Add(-time.Hour).Format(http.TimeFormat)}}), want: 0, wantOK: true},
		{name: "garbage", give: withHeader(http.Header{"Retry-After": {"soon"}})},
		{name: "negative", give: withHeader(http.Header{"Retry-After": {"-1"}})},
		{name: "infinite", give: withHeader(http.Header{"Retry-After": {"Inf"}})},
		{name: "absurd", give: withHeader(http.Header{"Retry-After": {"1e300"}})},
		{name: "nan", give: withHeader(http.Header{"Retry-After-Ms": {"NaN"}})},
		{name: "no header", give: withHeader(http.Header{})},
		{name: "nil response", give: &sdkerrs.AnthropicError{StatusCode: 429}},
		{name: "anthropic wrapped", give: fmt.Errorf("x: %w", &sdkerrs.AnthropicError{Response: &http.Response{Header: http.Header{"Retry-After": {"12"}}}}), want: 12 * time.Second, wantOK: true},
		{name: "joined", give: errors.Join(errors.New("a"), withHeader(http.Header{"Retry-After": {"3"}})), want: 3 * time.Second, wantOK: true},
		{name: "outermost wins", give: fmt.Errorf("%w", wrapper{msg: "x", err: retryAfterMethod(time.Second)}), want: time.Second, wantOK: true},
		{name: "first in a join wins", give: errors.Join(retryAfterMethod(time.Second), retryAfterMethod(time.Hour)), want: time.Second, wantOK: true},
		{name: "typed nil pointer", give: wrapper{msg: "x", err: (*nilPanics)(nil)}},
		{name: "non-struct", give: intCodeErr(3)},
		{name: "a loop ends", give: &loop{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := retryAfterAt(tt.give, now)
			assert.Equal(t, tt.wantOK, ok)
			assert.Equal(t, tt.want, got)
		})
	}
}

func TestRetryAfterReadsDatesAgainstTheWallClock(t *testing.T) {
	d, ok := RetryAfter(withHeader(http.Header{"Retry-After": {time.Now().Add(time.Hour).UTC().Format(http.TimeFormat)}}))
	require.True(t, ok)
	assert.InDelta(t, time.Hour, d, float64(2*time.Second))

	d, ok = RetryAfter(withHeader(http.Header{"Retry-After": {"30"}}))
	require.True(t, ok)
	assert.Equal(t, 30*time.Second, d)
}

// A cached message class is the class matching it gives, for every message
// of the table, on the first and on a later call; and the cache stays
// within its bound.
func TestFromMessageCacheIsExact(t *testing.T) {
	msgs := []string{"Too Many Requests", "model_not_found", "overloaded", "429", "something else", "context_length_exceeded"}
	for _, msg := range msgs {
		want := fromMessage(msg)
		for range 3 {
			if got := FromMessage(msg); got != want {
				t.Fatalf("FromMessage(%q) = %v, want %v", msg, got, want)
			}
		}
	}
	for i := range 2 * maxCachedMessages {
		FromMessage("distinct message " + strconv.Itoa(i))
	}
	msgCache.mu.Lock()
	n := len(msgCache.m)
	msgCache.mu.Unlock()
	if n > maxCachedMessages {
		t.Fatalf("cache holds %d messages, bound %d", n, maxCachedMessages)
	}
	long := strings.Repeat("x", maxCachedMessage) + " 503"
	if got := FromMessage(long); got != fromMessage(long) {
		t.Fatalf("a long message: %v", got)
	}
}

// asTimeout says it is a net.Error only through an As method.
type asTimeout struct{}

func (asTimeout) Error() string { return "opaque" }
func (asTimeout) As(target any) bool {
	if p, ok := target.(*net.Error); ok {
		*p = netTimeout{}
		return true
	}
	return false
}

type netTimeout struct{}

func (netTimeout) Error() string   { return "i/o timeout" }
func (netTimeout) Timeout() bool   { return true }
func (netTimeout) Temporary() bool { return true }

func TestAnErrorThatIsATimeoutOnlyThroughAsIsATimeout(t *testing.T) {
	assert.Equal(t, Timeout, Classify(fmt.Errorf("wrapped: %w", asTimeout{})))
}
