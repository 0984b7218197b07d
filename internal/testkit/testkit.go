// Package testkit holds what the external test packages of this repository
// share to drive a Manager; only tests import it.
package testkit

import (
	"context"

	"github.com/bgtask/bgtask"
)

// MustOpen is bgtask.Open for a test whose options are fine: it panics on
// an error, which fails the test at once.
func MustOpen(host bgtask.Host, opts ...bgtask.Option) *bgtask.Manager {
	m, err := bgtask.Open(context.Background(), host, opts...)
	if err != nil {
		panic(err)
	}
	return m
}

// StopErr is the error of a Stop, for a check that wants only that.
func StopErr(_ bgtask.ClosureReport, err error) error { return err }
