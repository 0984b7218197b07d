// Package riverbench compares pgledger with River on one PostgreSQL
// server, in one run: the floor (a one-row INSERT committed, from 32
// connections), River with its defaults and tuned, and pgledger's Node
// with a Notifier, from one node and from three.
//
// It is a module of its own so that River is never a dependency of
// pgledger or of bgtask: only this module requires it. Everything is in
// its tests: BenchmarkCompare measures, TestEverySystemEndsEveryLifecycle
// checks the harness on a few lifecycles. README.md says how to run it
// and what each figure means.
package riverbench
