package bgtask

import (
	crand "crypto/rand"
	"encoding/hex"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/google/uuid"
)

// IDKind says what an id is for.
type IDKind string

const (
	// IDTask names a task (Task.ID), unless Spec.ID gives one.
	IDTask IDKind = "task"
	// IDAttempt names an attempt (Attempt.ID): one per model tried.
	IDAttempt IDKind = "attempt"
	// IDToken names a run (Attempt.Token): the exact run a stop or an
	// event means; never reused, also not across Managers and restarts.
	IDToken IDKind = "run"
	// IDNotification names a notification (Notification.ID).
	IDNotification IDKind = "notification"
)

// IDGenerator makes ids. It must be safe for concurrent use, must not call
// into the Manager, and must never return the same id twice for a kind.
type IDGenerator interface {
	NewID(kind IDKind) string
}

// uuidIDs makes random (version 4) UUIDs from a ChaCha8 stream seeded from
// crypto/rand: as unpredictable as reading crypto/rand for each id, without
// a system call per id.
type uuidIDs struct {
	mu  sync.Mutex
	src *rand.ChaCha8
}

func newUUIDs() *uuidIDs {
	var seed [32]byte
	if _, err := crand.Read(seed[:]); err != nil {
		panic("crypto/rand: " + err.Error())
	}
	return &uuidIDs{src: rand.NewChaCha8(seed)}
}

func (g *uuidIDs) NewID(kind IDKind) string {
	var buf [len(tokenPrefix) + 36]byte
	return string(g.render(buf[:0], kind))
}

// attemptIDs makes an attempt id and its run token in one allocation: the
// two strings share one backing array, which lives as long as the attempt.
func (g *uuidIDs) attemptIDs() (id, token string) {
	var buf [36 + len(tokenPrefix) + 36]byte
	s := string(g.render(g.render(buf[:0], IDAttempt), IDToken))
	return s[:36], s[36:]
}

// tokenPrefix begins every run token the default generator makes.
const tokenPrefix = "run_"

// render appends one fresh id of kind to b.
func (g *uuidIDs) render(b []byte, kind IDKind) []byte {
	var u uuid.UUID
	g.mu.Lock()
	_, _ = g.src.Read(u[:])
	g.mu.Unlock()
	u[6] = u[6]&0x0f | 0x40 // version 4
	u[8] = u[8]&0x3f | 0x80 // RFC 9562 variant
	if kind == IDToken {
		b = append(b, tokenPrefix...)
	}
	n := len(b)
	b = b[:n+36]
	hex.Encode(b[n:], u[0:4])
	b[n+8] = '-'
	hex.Encode(b[n+9:], u[4:6])
	b[n+13] = '-'
	hex.Encode(b[n+14:], u[6:8])
	b[n+18] = '-'
	hex.Encode(b[n+19:], u[8:10])
	b[n+23] = '-'
	hex.Encode(b[n+24:], u[10:])
	return b
}

// UUIDs returns the default IDGenerator: random (version 4) UUIDs, with
// run tokens prefixed "run_". Each call returns a new generator, safe for
// concurrent use.
func UUIDs() IDGenerator { return newUUIDs() }

// SequentialIDs returns an IDGenerator making "task-1", "attempt-1",
// "run-1", … with a counter per kind: deterministic ids for tests and
// examples. Tokens from two such generators are not distinct; use it only
// where one Manager lives.
func SequentialIDs() IDGenerator { return &seqIDs{} }

type seqIDs struct{ task, attempt, run, note atomic.Uint64 }

func (s *seqIDs) NewID(kind IDKind) string {
	var n uint64
	switch kind {
	case IDTask:
		n = s.task.Add(1)
	case IDAttempt:
		n = s.attempt.Add(1)
	case IDNotification:
		n = s.note.Add(1)
	default:
		n = s.run.Add(1)
	}
	return string(kind) + "-" + strconv.FormatUint(n, 10)
}
