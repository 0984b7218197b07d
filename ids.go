package bgtask

import (
	"encoding/hex"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
)

// The kinds of id an IDGenerator makes.
const (
	idTask         = "task"         // a task (Task.ID), unless Spec.ID gives one
	idAttempt      = "attempt"      // an attempt (Attempt.ID): one per model tried
	idToken        = "run"          // a run (Attempt.Token): never reused, also not across Managers and restarts
	idNotification = "notification" // a notification (Notification.ID)
)

// IDGenerator makes ids. It must be safe for concurrent use, must not call
// into the Manager, and must never return the same id twice for a kind.
// kind is what the id is for: "task" (Task.ID, unless Spec.ID gives one),
// "attempt" (Attempt.ID: one per model tried), "run" (Attempt.Token: the
// exact run a stop or an event means; never reused, also not across
// Managers and restarts) or "notification" (Notification.ID).
type IDGenerator interface {
	NewID(kind string) string
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
	if err := osEntropy(seed[:]); err != nil {
		panic("reading the system's entropy: " + err.Error())
	}
	return &uuidIDs{src: rand.NewChaCha8(seed)}
}

func (g *uuidIDs) NewID(kind string) string {
	var buf [len(tokenPrefix) + 36]byte
	return string(g.render(buf[:0], kind))
}

// attemptIDs makes an attempt id and its run token in one allocation: the
// two strings share one backing array, which lives as long as the attempt.
func (g *uuidIDs) attemptIDs() (id, token string) {
	var buf [36 + len(tokenPrefix) + 36]byte
	s := string(g.render(g.render(buf[:0], idAttempt), idToken))
	return s[:36], s[36:]
}

// tokenPrefix begins every run token the default generator makes.
const tokenPrefix = "run_"

// render appends one fresh id of kind to b.
func (g *uuidIDs) render(b []byte, kind string) []byte {
	var u [16]byte
	g.mu.Lock()
	_, _ = g.src.Read(u[:])
	g.mu.Unlock()
	u[6] = u[6]&0x0f | 0x40 // version 4
	u[8] = u[8]&0x3f | 0x80 // RFC 9562 variant
	if kind == idToken {
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

// SequentialIDs returns an IDGenerator making "task-1", "attempt-1",
// "run-1", … with a counter per kind: deterministic ids for tests and
// examples. Tokens from two such generators are not distinct; use it only
// where one Manager lives.
func SequentialIDs() IDGenerator { return &seqIDs{} }

type seqIDs struct{ task, attempt, run, note atomic.Uint64 }

func (s *seqIDs) NewID(kind string) string {
	var n uint64
	switch kind {
	case idTask:
		n = s.task.Add(1)
	case idAttempt:
		n = s.attempt.Add(1)
	case idNotification:
		n = s.note.Add(1)
	default:
		n = s.run.Add(1)
	}
	return kind + "-" + strconv.FormatUint(n, 10)
}
