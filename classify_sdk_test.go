package bgtask

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The look-alikes below have the shapes the official provider SDKs return
// (openai-go, anthropic-sdk-go, google genai) without depending on them: the
// status is a field, not a method, and Error() reads like the SDK's own.

// sdkHTTPError is shaped like openai-go's *openai.Error and
// anthropic-sdk-go's *anthropic.Error.
type sdkHTTPError struct {
	StatusCode int
	Request    *http.Request
	Response   *http.Response
	raw        string
}

func (e *sdkHTTPError) Error() string {
	return fmt.Sprintf("%s %q: %d %s %s", e.Request.Method, e.Request.URL, e.Response.StatusCode, http.StatusText(e.Response.StatusCode), e.raw)
}

func newSDKHTTPError(url string, status int, body any) *sdkHTTPError {
	raw, _ := json.Marshal(body)
	req, _ := http.NewRequest(http.MethodPost, url, nil)
	return &sdkHTTPError{
		StatusCode: status,
		Request:    req,
		Response:   &http.Response{StatusCode: status, Header: http.Header{}, Request: req},
		raw:        string(raw),
	}
}

func openaiErr(status int, typ, code, msg string) *sdkHTTPError {
	return newSDKHTTPError("https://api.openai.com/v1/chat/completions", status,
		map[string]any{"message": msg, "type": typ, "param": nil, "code": code})
}

func anthropicErr(status int, typ, msg string) *sdkHTTPError {
	return newSDKHTTPError("https://api.anthropic.com/v1/messages", status,
		map[string]any{"type": "error", "error": map[string]string{"type": typ, "message": msg}})
}

// sdkGenaiError is shaped like google genai's APIError, a value type.
type sdkGenaiError struct {
	Code    int
	Message string
	Status  string
	Details []map[string]any
}

func (e sdkGenaiError) Error() string {
	return fmt.Sprintf("Error %d, Message: %s, Status: %s, Details: %v", e.Code, e.Message, e.Status, e.Details)
}

func TestDefaultRetryableOnProviderSDKErrors(t *testing.T) {
	tests := []struct {
		name string
		give error
		want bool
	}{
		{name: "openai 404 model_not_found", give: openaiErr(404, "invalid_request_error", "model_not_found", "The model `gpt-9` does not exist or you do not have access to it."), want: true},
		{name: "openai 401 invalid_api_key", give: openaiErr(401, "invalid_request_error", "invalid_api_key", "Incorrect API key provided: sk-abc."), want: true},
		{name: "openai 403", give: openaiErr(403, "request_forbidden", "unsupported_country_region_territory", "Country, region, or territory not supported"), want: true},
		{name: "openai 429", give: openaiErr(429, "requests", "rate_limit_exceeded", "Rate limit reached"), want: true},
		{name: "openai 500", give: openaiErr(500, "server_error", "", "The server had an error while processing your request."), want: true},
		{name: "openai 400 max_tokens", give: openaiErr(400, "invalid_request_error", "", "max_tokens is too large: 100000. This model supports at most 16384 completion tokens."), want: false},
		{name: "openai 400 bad param", give: openaiErr(400, "invalid_request_error", "unknown_parameter", "Unrecognized request argument supplied: foo"), want: false},
		{name: "openai 400 context length", give: openaiErr(400, "invalid_request_error", "context_length_exceeded", "This model's maximum context length is 128000 tokens."), want: false},
		{name: "anthropic 404 not_found_error", give: anthropicErr(404, "not_found_error", "model: claude-9"), want: true},
		{name: "anthropic 401 authentication_error", give: anthropicErr(401, "authentication_error", "invalid x-api-key"), want: true},
		{name: "anthropic 403 permission_error", give: anthropicErr(403, "permission_error", "Your API key does not have permission to use the specified resource."), want: true},
		{name: "anthropic 429 rate_limit_error", give: anthropicErr(429, "rate_limit_error", "Number of request tokens has exceeded your per-minute rate limit"), want: true},
		{name: "anthropic 500 api_error", give: anthropicErr(500, "api_error", "Internal server error"), want: true},
		{name: "anthropic 529 overloaded_error", give: anthropicErr(529, "overloaded_error", "Overloaded"), want: true},
		{name: "anthropic 400 max_tokens", give: anthropicErr(400, "invalid_request_error", "max_tokens: 100000 > 64000, which is the maximum allowed number of output tokens"), want: false},
		{name: "anthropic 400 prompt too long", give: anthropicErr(400, "invalid_request_error", "prompt is too long: 210000 tokens > 200000 maximum"), want: false},
		{name: "genai 429", give: sdkGenaiError{Code: 429, Message: "Resource has been exhausted (e.g. check quota).", Status: "RESOURCE_EXHAUSTED"}, want: true},
		{name: "genai 404", give: sdkGenaiError{Code: 404, Message: "models/gemini-9 is not found for API version v1beta.", Status: "NOT_FOUND"}, want: true},
		{name: "genai 503", give: sdkGenaiError{Code: 503, Message: "The model is overloaded.", Status: "UNAVAILABLE"}, want: true},
		{name: "genai 400 bad api key", give: sdkGenaiError{Code: 400, Message: "API key not valid. Please pass a valid API key.", Status: "INVALID_ARGUMENT"}, want: true},
		{name: "genai 400 bad value", give: sdkGenaiError{Code: 400, Message: "Invalid value at 'generation_config.temperature'", Status: "INVALID_ARGUMENT"}, want: false},
		{name: "genai 400 too many tokens", give: sdkGenaiError{Code: 400, Message: "The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).", Status: "INVALID_ARGUMENT"}, want: false},
	}
	forms := []struct {
		name string
		wrap func(error) error
	}{
		{name: "as returned", wrap: func(err error) error { return err }},
		{name: "wrapped", wrap: func(err error) error { return fmt.Errorf("provider: %w", err) }},
		{name: "joined", wrap: func(err error) error { return errors.Join(errors.New("attempt"), err) }},
		{name: "message only", wrap: func(err error) error { return errors.New(err.Error()) }},
		{name: "failed start", wrap: func(err error) error { return &StartError{Model: Model{Provider: "p", ID: "m"}, Err: err} }},
		{name: "failed start wrapped", wrap: func(err error) error {
			return fmt.Errorf("launch: %w", &StartError{Model: Model{Provider: "p", ID: "m"}, Err: fmt.Errorf("sdk: %w", err)})
		}},
		{name: "failed start message only", wrap: func(err error) error {
			return &StartError{Model: Model{Provider: "p", ID: "m"}, Err: errors.New(err.Error())}
		}},
	}
	for _, tt := range tests {
		for _, f := range forms {
			t.Run(tt.name+"/"+f.name, func(t *testing.T) {
				assert.Equal(t, tt.want, DefaultRetryable(f.wrap(tt.give)))
			})
		}
	}
}

func TestAProviderSDK404FromTheSessionMovesToTheNextModel(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("openai/gpt-9", "anthropic/claude-haiku-4.5")
	h.settle()
	err := openaiErr(404, "invalid_request_error", "model_not_found", "The model `gpt-9` does not exist or you do not have access to it.")
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: err}))
	h.settle()
	assert.Len(t, h.task(task.ID).Attempts, 2, "a missing model moves to the next")
}

func TestAProviderSDKStartFailureIsClassifiedByItsStatusField(t *testing.T) {
	tests := []struct {
		name         string
		give         error
		wantAttempts int
	}{
		{name: "401 invalid_api_key moves on", give: openaiErr(401, "invalid_request_error", "invalid_api_key", "Incorrect API key provided"), wantAttempts: 2},
		{name: "404 not_found_error moves on", give: anthropicErr(404, "not_found_error", "model: claude-9"), wantAttempts: 2},
		{name: "400 bad param ends", give: openaiErr(400, "invalid_request_error", "", "max_tokens must be at most 4096"), wantAttempts: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
				if req.AttemptNumber == 1 {
					return "", tt.give
				}
				return sid, nil
			}})
			task := h.launch("a/one", "b/two")
			h.settle()
			assert.Len(t, h.task(task.ID).Attempts, tt.wantAttempts)
			if tt.wantAttempts == 1 {
				assert.Equal(t, StatusError, h.wait(task.ID).Status)
			}
		})
	}
}
