package jwire

import (
	"errors"
	"net"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// mem is a Backend in memory; appends whose first record has Kind "bad"
// fail.
type mem struct {
	mu     sync.Mutex
	recs   []Rec
	closed bool
}

func (b *mem) Append(recs []Rec) func() error {
	if len(recs) > 0 && recs[0].Kind == "bad" {
		return func() error { return errors.New("refused") }
	}
	b.mu.Lock()
	b.recs = append(b.recs, recs...)
	b.mu.Unlock()
	return func() error { return nil }
}

func (b *mem) Replay(fn func(Rec) error) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, r := range b.recs {
		if err := fn(r); err != nil {
			return err
		}
	}
	return nil
}

func (b *mem) Compact(keep []Rec) error {
	b.mu.Lock()
	b.recs = append([]Rec(nil), keep...)
	b.mu.Unlock()
	return nil
}

func (b *mem) Close() error { b.mu.Lock(); b.closed = true; b.mu.Unlock(); return nil }

func serve(t *testing.T, b Backend) (*Client, chan error) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "s")
	l, err := net.Listen("unix", sock)
	require.NoError(t, err)
	served := make(chan error, 1)
	go func() {
		conn, err := l.Accept()
		_ = l.Close()
		if err != nil {
			served <- err
			return
		}
		served <- Serve(conn, b)
	}()
	c, err := Dial("unix", sock)
	require.NoError(t, err)
	return c, served
}

func TestRequestsAreAnsweredInOrder(t *testing.T) {
	b := &mem{}
	c, served := serve(t, b)
	var waits []<-chan response
	for i := range 100 {
		waits = append(waits, c.Send(OpAppend, []Rec{{Seq: uint64(i + 1), Kind: "k", Data: []byte{byte(i)}}}))
	}
	bad := c.Send(OpAppend, []Rec{{Kind: "bad"}})
	for _, w := range waits {
		_, err := Result(w)
		require.NoError(t, err)
	}
	_, err := Result(bad)
	assert.EqualError(t, err, "refused", "an error crosses as its text")
	recs, err := Result(c.Send(OpReplay, nil))
	require.NoError(t, err)
	require.Len(t, recs, 100)
	for i, r := range recs {
		assert.Equal(t, uint64(i+1), r.Seq)
	}
	_, err = Result(c.Send(OpCompact, recs[90:]))
	require.NoError(t, err)
	recs, err = Result(c.Send(OpReplay, nil))
	require.NoError(t, err)
	assert.Len(t, recs, 10)
	require.NoError(t, c.Close())
	require.NoError(t, c.Close(), "a second Close is its first's answer")
	require.NoError(t, <-served)
	assert.True(t, b.closed, "the backend is closed with the connection")
}

func TestAConnectionThatEndsFailsWhatIsPending(t *testing.T) {
	b := &mem{}
	c, served := serve(t, b)
	_ = c.conn.Close() // the server sees EOF, and the client its end
	<-served
	_, err := Result(c.Send(OpAppend, []Rec{{Kind: "k"}}))
	require.Error(t, err)
	assert.Error(t, c.Close())
	assert.True(t, b.closed)
}
