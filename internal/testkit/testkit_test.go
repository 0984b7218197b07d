package testkit_test

import (
	"errors"
	"testing"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/testkit"
	"github.com/stretchr/testify/assert"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestMustOpenPanicsOnOptionsThatDoNotFit(t *testing.T) {
	assert.Panics(t, func() { testkit.MustOpen(nil, bgtask.WithJournal(nil)) })
	boom := errors.New("boom")
	assert.Equal(t, boom, testkit.StopErr(bgtask.ClosureReport{}, boom))
}
