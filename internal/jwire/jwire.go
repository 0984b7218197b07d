// Package jwire carries a journal over a stream connection, so that a
// test can run a Manager on a journal that lives in another process (or
// another module: the root package's scenario tests run on pgledger this
// way, without the root module depending on it).
//
// The protocol is gob: the client sends requests in order and the server
// answers each, in the same order, once it is done (an append once its
// batch is durable). Rec mirrors bgtask.Record field for field; this
// package does not import bgtask, so that bgtask's own tests can use it.
package jwire

import (
	"encoding/gob"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
)

// Rec is one ledger record (bgtask.Record's fields).
type Rec struct {
	Seq                                       uint64
	Kind, TaskID, AttemptID, Token, SessionID string
	ParentSessionID                           string
	Data                                      []byte
}

// Op is what a request asks.
type Op uint8

const (
	OpAppend Op = iota + 1
	OpReplay
	OpCompact
	OpClose
)

type request struct {
	Op   Op
	Recs []Rec
}

type response struct {
	Recs []Rec // OpReplay
	Err  string
}

// Backend is the journal a server serves (one per connection).
type Backend interface {
	// Append queues recs and returns a wait for their durability.
	Append(recs []Rec) func() error
	Replay(fn func(Rec) error) error
	Compact(keep []Rec) error
	Close() error
}

// Serve serves one connection on b until the client closes it or asks
// OpClose, then closes b and conn. Answers go out in request order.
func Serve(conn net.Conn, b Backend) error {
	defer conn.Close()
	dec, enc := gob.NewDecoder(conn), gob.NewEncoder(conn)
	answers := make(chan func() response, 1024)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // the answers, in order
		defer wg.Done()
		failed := false
		for next := range answers {
			r := next()
			if !failed && enc.Encode(r) != nil {
				failed = true // the client went away: drain the rest
			}
		}
	}()
	defer func() {
		close(answers)
		wg.Wait()
		_ = b.Close()
	}()
	for {
		var req request
		if err := dec.Decode(&req); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		switch req.Op {
		case OpAppend:
			wait := b.Append(req.Recs)
			answers <- func() response { return answer(nil, wait()) }
		case OpReplay:
			var recs []Rec
			err := b.Replay(func(r Rec) error { recs = append(recs, r); return nil })
			answers <- func() response { return answer(recs, err) }
		case OpCompact:
			err := b.Compact(req.Recs)
			answers <- func() response { return answer(nil, err) }
		case OpClose:
			err := b.Close()
			answers <- func() response { return answer(nil, err) }
			return nil
		default:
			return fmt.Errorf("jwire: unknown op %d", req.Op)
		}
	}
}

func answer(recs []Rec, err error) response {
	r := response{Recs: recs}
	if err != nil {
		r.Err = err.Error()
		if r.Err == "" {
			r.Err = "error"
		}
	}
	return r
}

// Client is the other end: a journal in another process.
type Client struct {
	conn net.Conn
	enc  *gob.Encoder
	wmu  sync.Mutex // one request written at a time, in the order queued

	mu      sync.Mutex // pending and broken
	pending []chan response
	broken  error
	done    chan struct{}

	closeOnce sync.Once
	closeErr  error
}

// Dial connects to a server at network, address.
func Dial(network, address string) (*Client, error) {
	conn, err := net.Dial(network, address)
	if err != nil {
		return nil, err
	}
	c := &Client{conn: conn, enc: gob.NewEncoder(conn), done: make(chan struct{})}
	go c.read(gob.NewDecoder(conn))
	return c, nil
}

// read completes the pending requests in order, until the connection ends.
func (c *Client) read(dec *gob.Decoder) {
	defer close(c.done)
	for {
		var r response
		err := dec.Decode(&r)
		c.mu.Lock()
		if err != nil {
			c.broken = fmt.Errorf("jwire: the journal's connection ended: %w", err)
			for _, p := range c.pending {
				p <- response{Err: c.broken.Error()}
			}
			c.pending = nil
			c.mu.Unlock()
			return
		}
		p := c.pending[0]
		c.pending = c.pending[1:]
		c.mu.Unlock()
		p <- r
	}
}

// Send sends a request and returns where its answer arrives.
func (c *Client) Send(op Op, recs []Rec) <-chan response {
	p := make(chan response, 1)
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.mu.Lock()
	if c.broken != nil {
		c.mu.Unlock()
		p <- response{Err: c.broken.Error()}
		return p
	}
	c.pending = append(c.pending, p)
	c.mu.Unlock()
	// Not under mu: the reader must be free to take answers meanwhile.
	if err := c.enc.Encode(request{Op: op, Recs: recs}); err != nil {
		_ = c.conn.Close() // the reader fails what is pending
	}
	return p
}

// Result waits for an answer and returns its records and error.
func Result(p <-chan response) ([]Rec, error) {
	r := <-p
	if r.Err != "" {
		return r.Recs, errors.New(r.Err)
	}
	return r.Recs, nil
}

// Close asks the server to close the journal, and closes the connection.
// Calls after the first return its answer.
func (c *Client) Close() error {
	c.closeOnce.Do(func() {
		_, c.closeErr = Result(c.Send(OpClose, nil))
		_ = c.conn.Close()
		<-c.done
	})
	return c.closeErr
}
