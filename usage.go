package bgtask

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// Usage is what a child's model calls used: reported by the host with an
// event (Event.Usage, SessionUsage) or by an in-process function
// (Run.Usage), as a delta — what was used since the previous report, not
// a running total. It is a ledger record (journaled: a restart keeps it),
// counted for the attempt the report resolves to, and summed per task
// (Task.Usage), per tree (Manager.TreeUsage) and per budget (Budget).
// Every figure is an integer: no floats in the ledger.
type Usage struct {
	// InputTokens are the tokens the model read, cached ones included;
	// OutputTokens those it wrote. Budget.Tokens counts both.
	InputTokens  int64 `json:"inputTokens,omitempty"`
	OutputTokens int64 `json:"outputTokens,omitempty"`
	// CachedTokens are those of InputTokens served from a prompt cache:
	// shown, not counted again.
	CachedTokens int64 `json:"cachedTokens,omitempty"`
	// Requests are the model requests made.
	Requests int64 `json:"requests,omitempty"`
	// Cost is what they cost, in fixed point (see Cost).
	Cost Cost `json:"cost,omitempty"`
}

// Cost is an amount of money in millionths of the unit the harness prices
// in (a dollar, a euro, a credit: bgtask never converts): CostUnit is one
// unit. An integer, so that sums are exact.
type Cost int64

// CostUnit is one unit of the harness's currency, as a Cost.
const CostUnit Cost = 1_000_000

// String is c in units, with the decimals it needs (at least two):
// "1.50", "0.000125".
func (c Cost) String() string { return string(appendCost(make([]byte, 0, 24), c)) }

// appendCost appends c as String says it to b.
func appendCost(b []byte, c Cost) []byte {
	u := uint64(c)
	if c < 0 {
		b = append(b, '-')
		u = uint64(-c) // -MinInt64 wraps to itself: its uint64 is right
	}
	b = strconv.AppendUint(b, u/uint64(CostUnit), 10)
	b = append(b, '.')
	frac := u % uint64(CostUnit)
	digits := 6
	for digits > 2 && frac%10 == 0 {
		frac /= 10
		digits--
	}
	var d [6]byte
	for i := digits - 1; i >= 0; i-- {
		d[i] = byte('0' + frac%10)
		frac /= 10
	}
	return append(b, d[:digits]...)
}

// Tokens is what Budget.Tokens counts of u: its input and output tokens.
func (u Usage) Tokens() int64 { return satAdd(u.InputTokens, u.OutputTokens) }

// IsZero reports whether u reports nothing.
func (u Usage) IsZero() bool { return u == Usage{} }

// Add is u and v summed (each figure saturates at the largest int64
// rather than wrap).
func (u Usage) Add(v Usage) Usage {
	return Usage{
		InputTokens:  satAdd(u.InputTokens, v.InputTokens),
		OutputTokens: satAdd(u.OutputTokens, v.OutputTokens),
		CachedTokens: satAdd(u.CachedTokens, v.CachedTokens),
		Requests:     satAdd(u.Requests, v.Requests),
		Cost:         Cost(satAdd(int64(u.Cost), int64(v.Cost))),
	}
}

// String is u in one line: "1200 tokens (1000 in, 200 cached, 200 out),
// 3 requests, cost 0.0042".
func (u Usage) String() string {
	var b strings.Builder
	b.WriteString(strconv.FormatInt(u.Tokens(), 10) + " tokens (" + strconv.FormatInt(u.InputTokens, 10) + " in, ")
	if u.CachedTokens > 0 {
		b.WriteString(strconv.FormatInt(u.CachedTokens, 10) + " cached, ")
	}
	b.WriteString(strconv.FormatInt(u.OutputTokens, 10) + " out), " + strconv.FormatInt(u.Requests, 10) + " request" + plural(int(min(u.Requests, 2))))
	b.WriteString(", cost " + u.Cost.String())
	return b.String()
}

// validate refuses a report no host makes: a negative figure.
func (u Usage) validate() error {
	if u.InputTokens < 0 || u.OutputTokens < 0 || u.CachedTokens < 0 || u.Requests < 0 || u.Cost < 0 {
		return fmt.Errorf("%w: usage with a negative figure (%+v)", ErrInvalidArgument, u)
	}
	return nil
}

// satAdd is a+b for non-negative figures, saturating at math.MaxInt64.
func satAdd(a, b int64) int64 {
	if b > 0 && a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// TaskUsage is what a task's attempts used (Task.Usage): the sum, and
// each attempt's, by attempt number (ByAttempt[0] is attempt 1's). It
// keeps growing after the task ended when late reports come in: usage a
// stopped child reported still counts.
type TaskUsage struct {
	// Total is the task's.
	Total Usage `json:"total"`
	// ByAttempt is each attempt's, by attempt number.
	ByAttempt []Usage `json:"byAttempt"`
}

// usageBox is a snapshot's TaskUsage with room for a few attempts'.
type usageBox struct {
	TaskUsage
	room [3]Usage
}

// usageRec is a usage record's own part (recUsage): the attempt that did
// the work, and what it reported.
type usageRec struct {
	attempt string
	u       Usage
	// spawned is, in a record of no attempt (a compaction's carry of a
	// budget), the spawns of forgotten tasks.
	spawned int64
}

// acct is a task's accounting: its usage, and the budgets it spends
// from. nil for a task that reported no usage and is in no budget.
type acct struct {
	total     Usage
	byAttempt []Usage // by attempt index: on first while it fits
	first     [3]Usage
	// bud is the innermost budget the task spends from: its own
	// (Spec.Budget), or the one above it (its parent's, or that of the
	// task it continues); nil if none.
	bud *budget
	// spawnUp is the budget its spawn counts in (with those above it):
	// its parent task's. reserved: it holds its reservation there (it is
	// live, and no session of it has run yet); started: a session of it
	// has run (it counts as spawned).
	spawnUp           *budget
	reserved, started bool
}

// accountOf is e's accounting, made on first use.
func (e *entry) accountOf() *acct {
	if e.acct == nil {
		e.acct = new(acct)
	}
	return e.acct
}

// usage is e's usage as Task.Usage shows it; nil if it reported none.
func (e *entry) usage() *TaskUsage {
	if e.acct == nil || e.acct.byAttempt == nil {
		return nil
	}
	n := e.count()
	if n <= len(usageBox{}.room) { // one allocation for the snapshot's usage
		b := &usageBox{TaskUsage: TaskUsage{Total: e.acct.total}}
		b.ByAttempt = b.room[:n:n]
		copy(b.ByAttempt, e.acct.byAttempt)
		return &b.TaskUsage
	}
	u := &TaskUsage{Total: e.acct.total, ByAttempt: make([]Usage, n)}
	copy(u.ByAttempt, e.acct.byAttempt)
	return u
}

// countUsage applies a usage record to e: the attempt's, the task's and
// every budget above it. m.mu (or the replay) holds the ledger.
func (l *ledger) countUsage(e *entry, rec *record) {
	if rec.usage.attempt == "" {
		l.carry(e, rec.usage)
		return
	}
	a := e.accountOf()
	i := e.current // the usual case: the current run's
	if e.cold != "" || e.attempts[i].ID != rec.usage.attempt {
		e.eachAttempt(func(j int, at *Attempt) {
			if at.ID == rec.usage.attempt {
				i = j
			}
		})
	}
	if a.byAttempt == nil {
		a.byAttempt = a.first[:0]
	}
	if len(a.byAttempt) <= i {
		if cap(a.byAttempt) <= i { // room for every attempt the task may make, once (a few)
			grown := make([]Usage, len(a.byAttempt), max(i+1, roomFor(e.info.maxAttempts)))
			copy(grown, a.byAttempt)
			a.byAttempt = grown
		}
		a.byAttempt = a.byAttempt[:i+1]
	}
	u := rec.usage.u
	a.byAttempt[i] = a.byAttempt[i].Add(u)
	a.total = a.total.Add(u)
	for b := a.bud; b != nil; b = b.up {
		b.spent = b.spent.Add(u)
		l.crossed(b)
	}
	e.revision++
}

// checkUsage refuses a usage record that names no attempt of e, or
// reports a negative figure.
func checkUsage(l *ledger, e *entry, rec *record) error {
	if rec.usage == nil {
		return errors.New("ledger: a usage record must carry its usage")
	}
	if rec.usage.attempt == "" { // a budget's carry: its task holds one
		if e.acct == nil || e.acct.bud == nil || e.acct.bud.owner != e || rec.usage.spawned < 0 {
			return fmt.Errorf("ledger: a budget's carry for task %s, which holds none", e.id)
		}
		return rec.usage.u.validate()
	}
	if owner := l.byAttempt[rec.usage.attempt]; owner != e {
		return fmt.Errorf("ledger: usage for attempt %q, which is not task %s's", rec.usage.attempt, e.id)
	}
	return rec.usage.u.validate()
}

// spend records usage u reported (at, or now) for the attempt ref names, whatever
// became of it (superseded, ended, stopped: the work was done). m.mu is
// held.
func (m *Manager) spend(ref attemptRef, u Usage, at time.Time) {
	if u.IsZero() {
		return
	}
	e := ref.e
	if at.IsZero() && m.led.recording() { // a record no journal keeps needs no time (the clock is slow)
		at = m.now()
	}
	var use *usageRec
	if m.led.recording() {
		use = &usageRec{attempt: ref.attempt().ID, u: u}
	} else { // applied and dropped in this locked section: no allocation
		use = &m.calls.usage
		*use = usageRec{attempt: ref.attempt().ID, u: u}
	}
	rec := record{kind: recUsage, task: e.id, at: at, usage: use}
	if !m.commit(e, rec) {
		return
	}
	if m.cfg.metrics != nil {
		model := ref.attempt().Model
		m.measure(func(mt Metrics) { mt.UsageReported(e.id, model, u) })
	}
}

// Usage reports what this run's model calls used since its previous
// report (a delta; see Usage). It is counted for this attempt even when
// the run was stopped or replaced meanwhile. It returns ErrInvalidArgument
// for a negative figure, ErrJournal when the record could not be made
// durable, and nil otherwise.
func (r Run) Usage(u Usage) error {
	if r.m == nil {
		return errors.New("Run.Usage on a Run no FuncHost made")
	}
	return r.m.Observe(Event{AttemptID: r.AttemptID, Token: r.Token, Kind: SessionUsage, Usage: u})
}

// TreeUsage is what task id and every task beneath it (launched from any
// of its sessions, recursively) used, as far as this Manager still holds
// them (ended tasks are forgotten under WithRetention; a budget's figures,
// Task.Budget, never forget). ErrUnknownTask (or ErrForgotten) for an id
// it does not hold.
func (m *Manager) TreeUsage(id string) (Usage, error) {
	m.mu.Lock()
	defer m.unlock()
	e := m.led.tasks[id]
	if e == nil {
		return Usage{}, m.missing(id)
	}
	var sum Usage
	seen := map[*entry]bool{e: true}
	queue := []*entry{e}
	for len(queue) > 0 {
		x := queue[0]
		queue = queue[1:]
		if x.acct != nil {
			sum = sum.Add(x.acct.total)
		}
		for _, k := range x.kids {
			if !seen[k] {
				seen[k] = true
				queue = append(queue, k)
			}
		}
	}
	return sum, nil
}

// usageLine is the Timeline's usage line for t, or "" if it reported none.
func usageLine(t Task) string {
	if t.Usage == nil {
		return ""
	}
	return "\nUsage: " + t.Usage.Total.String()
}

// isUsageLine reports whether l is a Timeline's usage line (Usage.String),
// indented or not: not a line of a child's output that happens to begin
// so. It matches what the regexp
//
//	^ *Usage: \d+ tokens \(\d+ in, (\d+ cached, )?\d+ out\), \d+ requests?, cost -?\d+\.\d+$
//
// matches, in plain string code: the package compiles no regexp (and
// links no regexp package) for it.
func isUsageLine(l string) bool {
	s, ok := strings.TrimLeft(l, " "), true
	lit := func(p string) {
		if ok {
			s, ok = strings.CutPrefix(s, p)
		}
	}
	num := func() {
		if ok {
			n := 0
			for n < len(s) && s[n] >= '0' && s[n] <= '9' {
				n++
			}
			s, ok = s[n:], n > 0
		}
	}
	lit("Usage: ")
	num()
	lit(" tokens (")
	num()
	lit(" in, ")
	num()
	if ok && strings.HasPrefix(s, " cached, ") {
		lit(" cached, ")
		num()
	}
	lit(" out), ")
	num()
	lit(" request")
	if ok {
		s = strings.TrimPrefix(s, "s")
	}
	lit(", cost ")
	if ok {
		s = strings.TrimPrefix(s, "-")
	}
	num()
	lit(".")
	num()
	return ok && s == ""
}

// withoutUsage is text less its Timeline's usage line: what a check of a
// notification made again from a later ledger compares (late reports
// move the line).
func withoutUsage(text string) string {
	lines := strings.Split(text, "\n")
	kept := lines[:0]
	for _, l := range lines {
		if !isUsageLine(l) {
			kept = append(kept, l)
		}
	}
	return strings.Join(kept, "\n")
}
