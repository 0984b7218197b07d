// Command quickstart is the README's Quick start, whole: one task across a
// fallback chain of three models, run by a Go function.
package main

import (
	"context"
	"errors"
	"fmt"
	"log"

	"github.com/bgtask/bgtask"
)

func main() {
	ctx := context.Background()

	// A Host runs each attempt as a child session. NewFuncHost runs a Go
	// function; a session service implements Host itself and reports
	// what its children do with m.Observe.
	host := bgtask.NewFuncHost(func(ctx context.Context, run bgtask.Run) (string, error) {
		switch run.Model.Provider { // call the model here
		case "openai":
			return "", errors.New("403 Forbidden: Selected provider is forbidden")
		case "anthropic":
			return "", errors.New("429 Too Many Requests")
		}
		return "six times seven is 42", nil
	})
	m, err := bgtask.Open(ctx, host, bgtask.WithNotifier(bgtask.NotifierFunc(
		func(ctx context.Context, n bgtask.Notification) error {
			fmt.Println("parent:", n.Kind) // what your harness tells the parent chat
			return nil
		})))
	if err != nil {
		log.Fatal(err) // options that do not fit, each named
	}

	task, err := m.Launch(ctx, bgtask.Spec{
		ParentSessionID: "ses_parent",
		Prompt:          "What is six times seven?",
		Models: []bgtask.Model{
			{Provider: "openai", ID: "gpt-5.4-mini"},        // tried first
			{Provider: "anthropic", ID: "claude-haiku-4.5"}, // then the chain, in order
			{Provider: "google", ID: "gemini-2.5-flash-lite"},
		},
	})
	if err != nil {
		log.Fatal(err) // a *bgtask.SpecError names the bad field
	}
	done, err := m.Wait(ctx, task.ID) // until completed, error, cancelled or interrupt
	if err != nil {
		log.Fatal(err)
	}
	// Shutdown delivers what is still queued for the parent, stops what
	// still runs, and returns once no goroutine of the Manager is left.
	if err := m.Shutdown(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Println(done.Status, "|", done.Result)
	fmt.Println(bgtask.Timeline(done))
}
