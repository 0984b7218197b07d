package sdkerrs

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestNewOpenAI(t *testing.T) {
	e := NewOpenAI(404, "invalid_request_error", "model_not_found", "no gpt-9")
	assert.Equal(t, `POST "https://api.openai.com/v1/chat/completions": 404 Not Found {"code":"model_not_found","message":"no gpt-9","param":null,"type":"invalid_request_error"}`, e.Error())
	assert.Equal(t, 404, e.StatusCode)
	assert.Equal(t, 404, e.Response.StatusCode)
	assert.Equal(t, "model_not_found", e.Code)
	assert.Equal(t, "invalid_request_error", e.Type)
	assert.Equal(t, "no gpt-9", e.Message)
	assert.Same(t, e.Request, e.Response.Request)
	assert.Equal(t, http.Header{}, e.Response.Header)

	assert.Contains(t, NewOpenAI(500, "server_error", "", "x").Error(), `"code":null`, "an empty code is null")
}

func TestNewAnthropic(t *testing.T) {
	e := NewAnthropic(529, "overloaded_error", "Overloaded")
	assert.Equal(t, `POST "https://api.anthropic.com/v1/messages": 529  {"error":{"message":"Overloaded","type":"overloaded_error"},"type":"error"}`, e.Error())
	assert.Equal(t, 529, e.StatusCode)
	assert.Equal(t, 529, e.Response.StatusCode)
	assert.Equal(t, http.MethodPost, e.Request.Method)
}

func TestGenaiError(t *testing.T) {
	e := GenaiError{Code: 429, Message: "quota", Status: "RESOURCE_EXHAUSTED"}
	assert.Equal(t, "Error 429, Message: quota, Status: RESOURCE_EXHAUSTED, Details: []", e.Error())
	assert.Equal(t, e.Error(), (&e).Error(), "the pointer reads the same")
}
