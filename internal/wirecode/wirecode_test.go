package wirecode

import (
	"errors"
	"fmt"
	"net/http"
	"testing"

	"github.com/bgtask/bgtask"
	"github.com/stretchr/testify/assert"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type coded struct{}

func (coded) Error() string { return "gone" }
func (coded) Code() string  { return "owner_gone" }
func (coded) Status() int   { return http.StatusServiceUnavailable }

// Every sentinel crosses a wire and back as itself; a wrapped one is
// found; a Coded error names its own code; others have none.
func TestACodeReadsBackAsItsSentinel(t *testing.T) {
	seen := map[string]bool{}
	for _, s := range Sentinels {
		assert.False(t, seen[s.Code], "one code per sentinel: %s", s.Code)
		seen[s.Code] = true
		code, status, ok := Of(fmt.Errorf("context: %w", s.Err))
		assert.True(t, ok)
		assert.Equal(t, s.Code, code)
		assert.Equal(t, s.Status, status)
		back := &Error{Text: "said so", Code: code}
		assert.ErrorIs(t, back, s.Err)
		assert.Equal(t, "said so", back.Error())
	}
	code, status, ok := Of(fmt.Errorf("task t: %w", coded{}))
	assert.True(t, ok)
	assert.Equal(t, "owner_gone", code)
	assert.Equal(t, http.StatusServiceUnavailable, status)
	_, _, ok = Of(errors.New("plain"))
	assert.False(t, ok)
	assert.NotErrorIs(t, &Error{Text: "x", Code: "owner_gone"}, bgtask.ErrUnknownTask)
	assert.NotErrorIs(t, &Error{Text: "x"}, bgtask.ErrUnknownTask)
	// An error that wraps two sentinels is the more specific one's.
	code, _, _ = Of(fmt.Errorf("%w: cursor: %w", bgtask.ErrInvalidArgument, bgtask.ErrUnknownTask))
	assert.Equal(t, "unknown_task", code)
}

type panicky struct{}

func (panicky) Error() string { return "panicky" }
func (panicky) Is(error) bool { panic("Is") }
func (panicky) Code() string  { return "x" }
func (panicky) Status() int   { return 503 }

type odd struct{ status int }

func (odd) Error() string { return "odd" }
func (odd) Code() string  { return "odd" }
func (o odd) Status() int { return o.status }

// An error whose own methods panic, or that names no error status, has
// no code: the caller answers 500 internal, and nothing crashes.
func TestAHostileErrorHasNoCode(t *testing.T) {
	_, _, ok := Of(fmt.Errorf("wrapped: %w", panicky{}))
	assert.False(t, ok)
	for _, st := range []int{0, 99, 200, 302, 600, 1000} {
		_, _, ok := Of(odd{st})
		assert.False(t, ok, "status %d", st)
	}
	code, st, ok := Of(odd{409})
	assert.True(t, ok)
	assert.Equal(t, "odd", code)
	assert.Equal(t, 409, st)
}
