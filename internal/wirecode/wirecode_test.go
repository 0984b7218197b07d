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
