// Package sdkerrs holds look-alikes of the errors the official provider SDKs
// return (openai-go's *openai.Error, anthropic-sdk-go's *anthropic.Error and
// google.golang.org/genai's APIError), for tests only: no non-test code
// imports it. They have the SDKs' shapes without depending on the SDKs: the
// status is a field, not a method, and Error() reads like the SDK's own.
package sdkerrs

import (
	"encoding/json"
	"fmt"
	"net/http"
)

// OpenAIError is shaped like openai-go's *openai.Error.
type OpenAIError struct {
	Code       string
	Type       string
	Message    string
	StatusCode int
	Request    *http.Request
	Response   *http.Response
	raw        string
}

func (e *OpenAIError) Error() string { return httpText(e.Request, e.Response, e.raw) }

// NewOpenAI returns the error openai-go reports for a chat completion that
// answered status with the given error type, code and message; an empty
// code is sent as null, as the API does.
func NewOpenAI(status int, typ, code, msg string) *OpenAIError {
	body := map[string]any{"message": msg, "type": typ, "param": nil, "code": nil}
	if code != "" {
		body["code"] = code
	}
	req, resp, raw := exchange("https://api.openai.com/v1/chat/completions", status, body)
	return &OpenAIError{
		Code:       code,
		Type:       typ,
		Message:    msg,
		StatusCode: status,
		Request:    req,
		Response:   resp,
		raw:        raw,
	}
}

// AnthropicError is shaped like anthropic-sdk-go's *anthropic.Error.
type AnthropicError struct {
	StatusCode int
	Request    *http.Request
	Response   *http.Response
	raw        string
}

func (e *AnthropicError) Error() string { return httpText(e.Request, e.Response, e.raw) }

// NewAnthropic returns the error anthropic-sdk-go reports for a messages
// request that answered status with the given error type and message.
func NewAnthropic(status int, typ, msg string) *AnthropicError {
	body := map[string]any{"type": "error", "error": map[string]string{"type": typ, "message": msg}}
	req, resp, raw := exchange("https://api.anthropic.com/v1/messages", status, body)
	return &AnthropicError{StatusCode: status, Request: req, Response: resp, raw: raw}
}

// GenaiError is shaped like google.golang.org/genai's APIError, a value type.
type GenaiError struct {
	Code    int
	Message string
	Status  string
	Details []map[string]any
}

func (e GenaiError) Error() string {
	return fmt.Sprintf("Error %d, Message: %s, Status: %s, Details: %v", e.Code, e.Message, e.Status, e.Details)
}

// exchange builds the POST to url, its response with status and an empty
// header, and body as JSON.
func exchange(url string, status int, body any) (*http.Request, *http.Response, string) {
	raw, _ := json.Marshal(body)
	req, _ := http.NewRequest(http.MethodPost, url, nil)
	return req, &http.Response{StatusCode: status, Header: http.Header{}, Request: req}, string(raw)
}

// httpText is the message both HTTP SDKs give: method, URL, status and body.
func httpText(req *http.Request, resp *http.Response, raw string) string {
	return fmt.Sprintf("%s %q: %d %s %s", req.Method, req.URL, resp.StatusCode, http.StatusText(resp.StatusCode), raw)
}
