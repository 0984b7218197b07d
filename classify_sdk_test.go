package bgtask

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/bgtask/bgtask/internal/errclass/sdkerrs"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestDefaultRetryableOnProviderSDKErrors(t *testing.T) {
	tests := []struct {
		name string
		give error
		want bool
	}{
		{name: "openai 404 model_not_found", give: sdkerrs.NewOpenAI(404, "invalid_request_error", "model_not_found", "The model `gpt-9` does not exist or you do not have access to it."), want: true},
		{name: "openai 401 invalid_api_key", give: sdkerrs.NewOpenAI(401, "invalid_request_error", "invalid_api_key", "Incorrect API key provided: sk-abc."), want: true},
		{name: "openai 403", give: sdkerrs.NewOpenAI(403, "request_forbidden", "unsupported_country_region_territory", "Country, region, or territory not supported"), want: true},
		{name: "openai 429", give: sdkerrs.NewOpenAI(429, "requests", "rate_limit_exceeded", "Rate limit reached"), want: true},
		{name: "openai 500", give: sdkerrs.NewOpenAI(500, "server_error", "", "The server had an error while processing your request."), want: true},
		{name: "openai 400 max_tokens", give: sdkerrs.NewOpenAI(400, "invalid_request_error", "", "max_tokens is too large: 100000. This model supports at most 16384 completion tokens."), want: false},
		{name: "openai 400 bad param", give: sdkerrs.NewOpenAI(400, "invalid_request_error", "unknown_parameter", "Unrecognized request argument supplied: foo"), want: false},
		{name: "openai 400 context length", give: sdkerrs.NewOpenAI(400, "invalid_request_error", "context_length_exceeded", "This model's maximum context length is 128000 tokens."), want: false},
		{name: "anthropic 404 not_found_error", give: sdkerrs.NewAnthropic(404, "not_found_error", "model: claude-9"), want: true},
		{name: "anthropic 401 authentication_error", give: sdkerrs.NewAnthropic(401, "authentication_error", "invalid x-api-key"), want: true},
		{name: "anthropic 403 permission_error", give: sdkerrs.NewAnthropic(403, "permission_error", "Your API key does not have permission to use the specified resource."), want: true},
		{name: "anthropic 429 rate_limit_error", give: sdkerrs.NewAnthropic(429, "rate_limit_error", "Number of request tokens has exceeded your per-minute rate limit"), want: true},
		{name: "anthropic 500 api_error", give: sdkerrs.NewAnthropic(500, "api_error", "Internal server error"), want: true},
		{name: "anthropic 529 overloaded_error", give: sdkerrs.NewAnthropic(529, "overloaded_error", "Overloaded"), want: true},
		{name: "anthropic 400 max_tokens", give: sdkerrs.NewAnthropic(400, "invalid_request_error", "max_tokens: 100000 > 64000, which is the maximum allowed number of output tokens"), want: false},
		{name: "anthropic 400 prompt too long", give: sdkerrs.NewAnthropic(400, "invalid_request_error", "prompt is too long: 210000 tokens > 200000 maximum"), want: false},
		{name: "genai 429", give: sdkerrs.GenaiError{Code: 429, Message: "Resource has been exhausted (e.g. check quota).", Status: "RESOURCE_EXHAUSTED"}, want: true},
		{name: "genai 404", give: sdkerrs.GenaiError{Code: 404, Message: "models/gemini-9 is not found for API version v1beta.", Status: "NOT_FOUND"}, want: true},
		{name: "genai 503", give: sdkerrs.GenaiError{Code: 503, Message: "The model is overloaded.", Status: "UNAVAILABLE"}, want: true},
		{name: "genai 400 bad api key", give: sdkerrs.GenaiError{Code: 400, Message: "API key not valid. Please pass a valid API key.", Status: "INVALID_ARGUMENT"}, want: true},
		{name: "genai 400 bad value", give: sdkerrs.GenaiError{Code: 400, Message: "Invalid value at 'generation_config.temperature'", Status: "INVALID_ARGUMENT"}, want: false},
		{name: "genai 400 too many tokens", give: sdkerrs.GenaiError{Code: 400, Message: "The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).", Status: "INVALID_ARGUMENT"}, want: false},
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
	err := sdkerrs.NewOpenAI(404, "invalid_request_error", "model_not_found", "The model `gpt-9` does not exist or you do not have access to it.")
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
		{name: "401 invalid_api_key moves on", give: sdkerrs.NewOpenAI(401, "invalid_request_error", "invalid_api_key", "Incorrect API key provided"), wantAttempts: 2},
		{name: "404 not_found_error moves on", give: sdkerrs.NewAnthropic(404, "not_found_error", "model: claude-9"), wantAttempts: 2},
		{name: "400 bad param ends", give: sdkerrs.NewOpenAI(400, "invalid_request_error", "", "max_tokens must be at most 4096"), wantAttempts: 1},
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
