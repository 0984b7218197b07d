package bgtask

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
)

// Budget is what a tree of subagents may spend: set on a root launch
// (Spec.Budget, or WithBudget for every root launch that sets none), it
// covers the task launched with it and every task beneath it (launched
// from any of their sessions, recursively); set on a child's launch, it
// narrows what that child's branch may spend, clamped by what every
// budget above it has left at that launch (the grant, recorded with the
// launch: a restart, a re-adoption or a resumed session keeps it, never
// what was left). Usage anywhere in the branch counts against every
// budget above it, so grants never add up to more than their parent has.
//
// A limit of 0 is no limit (a Budget of zeros keeps the figures only).
//
//   - Tokens, Cost and Requests are hard limits on Usage: the report that
//     brings a figure to its limit stops the branch — new launches in it
//     are refused at once (*BudgetError, ErrBudget), and its live runs
//     are stopped by a branch closure whose stop cause is the budget
//     (StopBudget). The tasks read running until their children really
//     stopped, and what they report after the stop still counts.
//   - Spawns limits the tasks launched beneath the budget's task: a
//     launch reserves one, a task whose sessions never ran (every start
//     failed, or it was stopped first) gives it back when it ends. A
//     Launch past it is refused; nothing is stopped.
//   - SoftPercent is the soft threshold: when a figure first reaches that
//     share of its limit, the parent of the budget's task hears it once
//     (NotifyBudget). 0 means defaultSoftPercent; 100 or more, none (the
//     hard limit is told all the same).
type Budget struct {
	// Tokens limits input and output tokens (Usage.Tokens).
	Tokens int64 `json:"tokens,omitempty"`
	// Cost limits Usage.Cost.
	Cost Cost `json:"cost,omitempty"`
	// Requests limits Usage.Requests.
	Requests int64 `json:"requests,omitempty"`
	// Spawns limits the tasks launched beneath the budget's task.
	Spawns int64 `json:"spawns,omitempty"`
	// SoftPercent: see Budget.
	SoftPercent int `json:"softPercent,omitempty"`
}

// defaultSoftPercent is the soft threshold of a Budget that sets none.
const defaultSoftPercent = 80

// The limits a Budget has, as BudgetError.Limit and StopCause.Limit name
// them.
const (
	LimitTokens   = "tokens"
	LimitCost     = "cost"
	LimitRequests = "requests"
	LimitSpawns   = "spawns"
)

// ErrBudget: Launch was refused because a budget of the tree it would
// join is spent (or has no spawn left); the error is a *BudgetError.
var ErrBudget = errors.New("budget exhausted")

// BudgetError is ErrBudget with the budget, the limit and the figures.
type BudgetError struct {
	// TaskID is the task that holds the budget.
	TaskID string
	// Limit is the limit reached: LimitTokens, LimitCost, LimitRequests
	// or LimitSpawns.
	Limit string
	// Max is the limit; Spent what was spent of it (Cost in millionths,
	// as Cost is); Reserved, for spawns, the launches not yet started.
	Max, Spent, Reserved int64
}

// Error names the budget, the limit and the figures.
func (e *BudgetError) Error() string {
	s := "budget of task " + e.TaskID + " exhausted: " + e.Limit + " " + figureOf(e.Limit, e.Spent) + " of " + figureOf(e.Limit, e.Max)
	if e.Reserved > 0 {
		s += " (" + strconv.FormatInt(e.Reserved, 10) + " reserved)"
	}
	return s
}

// Is makes errors.Is(err, ErrBudget) true.
func (e *BudgetError) Is(target error) bool { return target == ErrBudget }

// figureOf is n as limit counts it: a Cost for LimitCost.
func figureOf(limit string, n int64) string {
	f := figure{name: limit}
	return string(f.append(nil, n))
}

// BudgetState is a budget as it stands (Task.Budget, Manager.Budget).
type BudgetState struct {
	// TaskID is the task that holds it.
	TaskID string `json:"taskID"`
	// Limit is what it was granted.
	Limit Budget `json:"limit"`
	// Spent is what its branch used; Spawned the tasks launched beneath
	// it whose sessions ran, Reserved those not yet started.
	Spent    Usage `json:"spent"`
	Spawned  int64 `json:"spawned"`
	Reserved int64 `json:"reserved,omitempty"`
	// Left is what may still be spent, the budgets above it counted: a
	// figure no budget limits is -1 (null in JSON; see MarshalJSON).
	Left Budget `json:"left"`
	// Exceeded names the hard limit reached ("" while none is): the
	// branch was stopped.
	Exceeded string `json:"exceeded,omitempty"`
	// SoftReached: a figure reached the soft threshold (the parent was
	// told).
	SoftReached bool `json:"softReached,omitempty"`
}

// MarshalJSON writes s with each figure of Left as a number, or null when
// no budget limits it (-1 in Left): "left": {"tokens": 0, "cost": null,
// "requests": 3, "spawns": null}. All four are always written, so that 0
// (nothing left) and null (no limit) are never confused with an absent
// figure, which is how earlier versions wrote 0.
func (s BudgetState) MarshalJSON() ([]byte, error) {
	type plain BudgetState // no methods: no recursion
	limited := func(n int64) *int64 {
		if n < 0 {
			return nil
		}
		return &n
	}
	return json.Marshal(struct {
		plain
		Left budgetLeftJSON `json:"left"`
	}{plain(s), budgetLeftJSON{Tokens: limited(s.Left.Tokens), Cost: limited(int64(s.Left.Cost)),
		Requests: limited(s.Left.Requests), Spawns: limited(s.Left.Spawns)}})
}

// budgetLeftJSON is BudgetState.Left on the wire: nil (null) for a figure
// no budget limits.
type budgetLeftJSON struct {
	Tokens   *int64 `json:"tokens"`
	Cost     *int64 `json:"cost"`
	Requests *int64 `json:"requests"`
	Spawns   *int64 `json:"spawns"`
}

// UnmarshalJSON reads a BudgetState as MarshalJSON writes it, and as
// earlier versions did (what a pgledger ledger may still hold): Left's
// figures as numbers with -1 for no limit, and a figure left out for 0.
func (s *BudgetState) UnmarshalJSON(data []byte) error {
	type plain BudgetState
	var j struct {
		plain
		Left map[string]json.RawMessage `json:"left"`
	}
	if err := json.Unmarshal(data, &j); err != nil {
		return err
	}
	*s = BudgetState(j.plain)
	s.Left = Budget{}
	for name, to := range map[string]*int64{LimitTokens: &s.Left.Tokens, LimitCost: (*int64)(&s.Left.Cost),
		LimitRequests: &s.Left.Requests, LimitSpawns: &s.Left.Spawns} {
		raw, ok := j.Left[name]
		switch {
		case !ok: // an earlier version's 0
		case string(raw) == "null":
			*to = -1
		default:
			if err := json.Unmarshal(raw, to); err != nil {
				return fmt.Errorf("budget: left: %s: %w", name, err)
			}
			if *to < 0 {
				*to = -1
			}
		}
	}
	return nil
}

func (b Budget) validate(field string) error {
	switch {
	case b.Tokens < 0, b.Cost < 0, b.Requests < 0, b.Spawns < 0:
		return &SpecError{Field: field, Reason: fmt.Sprintf("has a negative limit (%+v)", b)}
	case b.SoftPercent < 0:
		return &SpecError{Field: field + ".SoftPercent", Reason: "is negative (" + strconv.Itoa(b.SoftPercent) + ")"}
	}
	return nil
}

// soft is b's soft threshold in percent; 0: none.
func (b Budget) soft() int {
	switch {
	case b.SoftPercent == 0:
		return defaultSoftPercent
	case b.SoftPercent >= 100:
		return 0
	}
	return b.SoftPercent
}

// WithBudget gives every root launch (one from a session no task of this
// Manager owns) that sets no Spec.Budget the budget b. Default: none.
func WithBudget(b Budget) Option {
	return optionFunc(func(c *config) {
		if err := b.validate("WithBudget"); err != nil && c.err == nil {
			c.err = err
		}
		c.budget = &b
	})
}

// budget is one Budget in force: the task that holds it, what it was
// granted, what its branch spent, and the budget above it.
type budget struct {
	owner *entry
	lim   Budget
	up    *budget
	spent Usage
	// spawned: tasks beneath it whose sessions ran; reserved: those
	// launched and not yet started. live: the live tasks it covers, its
	// own included. refs: the tasks in memory whose launch names it (the
	// budget they spend from, or their spawn counts in): while either is
	// above 0, retention keeps the task that holds it.
	spawned, reserved, live, refs int64
	// forgot and forgotSpawned are what tasks retention forgot had added
	// to spent and spawned: a compaction carries them (a usage record of
	// the holder with no attempt), so a restart refunds nothing.
	forgot        Usage
	forgotSpawned int64
	over          string // the hard limit reached, once
	soft          bool   // the soft threshold was reached, once
}

// crossing is a threshold a budget just reached, for the live Manager
// to act on (a replay's were acted on in their own life).
type crossing struct {
	b     *budget
	hard  bool
	limit string // the soft threshold's: the figure that reached it
}

// softAt is pct percent of limit, rounded up, without overflow.
func softAt(limit int64, pct int) int64 {
	p := int64(pct)
	return limit/100*p + (limit%100*p+99)/100
}

// exceeded names the hard limit b's spending reached, or "".
func (b *budget) exceeded() string {
	switch {
	case b.lim.Tokens > 0 && b.spent.Tokens() >= b.lim.Tokens:
		return LimitTokens
	case b.lim.Cost > 0 && b.spent.Cost >= b.lim.Cost:
		return LimitCost
	case b.lim.Requests > 0 && b.spent.Requests >= b.lim.Requests:
		return LimitRequests
	}
	return ""
}

// softReached names the first figure of b that reached its soft
// threshold, or "".
func (b *budget) softReached() string {
	p := b.lim.soft()
	if p == 0 {
		return ""
	}
	at := func(spent, limit int64) bool { return limit > 0 && spent >= softAt(limit, p) }
	switch {
	case at(b.spent.Tokens(), b.lim.Tokens):
		return LimitTokens
	case at(int64(b.spent.Cost), int64(b.lim.Cost)):
		return LimitCost
	case at(b.spent.Requests, b.lim.Requests):
		return LimitRequests
	case at(b.spawned, b.lim.Spawns):
		return LimitSpawns
	}
	return ""
}

// crossed notes a threshold b just reached, once each.
func (l *ledger) crossed(b *budget) {
	if !b.soft {
		if limit := b.softReached(); limit != "" {
			b.soft = true
			l.crossings = append(l.crossings, crossing{b: b, limit: limit})
		}
	}
	if b.over == "" {
		if b.over = b.exceeded(); b.over != "" {
			l.crossings = append(l.crossings, crossing{b: b, hard: true})
		}
	}
}

// above works out, for a launch with info, the budget it spends from
// (its own aside) and the one its spawn counts in: its parent task's, or,
// for a task that continues another's session (ContinueFrom), that
// task's — which must then be the parent's or lie beneath it (a session
// carries its grant into no other tree). m.mu is held.
func (l *ledger) above(info *taskInfo) (spends, spawn *budget, err error) {
	if ref, ok := l.bySession[info.parent]; ok && ref.e.acct != nil {
		spawn = ref.e.acct.bud
	}
	spends = spawn
	if c := info.opt().continues; c != "" {
		if old := l.tasks[c]; old != nil && old.acct != nil && old.acct.bud != nil {
			if spawn != nil && !spendsFrom(old.acct.bud, spawn) {
				return nil, nil, &SpecError{Field: "ContinueFrom", Reason: "names task " + c + ", which spends from the budget of task " +
					old.acct.bud.owner.id + ", outside the budget of the parent session's task (" + spawn.owner.id + ")"}
			}
			spends = old.acct.bud
		}
	}
	return spends, spawn, nil
}

// budgetOf is the budget task id holds, or nil.
func (l *ledger) budgetOf(id string) *budget {
	if o := l.tasks[id]; id != "" && o != nil && o.acct != nil && o.acct.bud != nil && o.acct.bud.owner == o {
		return o.acct.bud
	}
	return nil
}

// linkBudget puts new task e under the budgets its launch recorded (it
// spends from, its spawn counts in), with its own if it has one, and
// reserves its spawn. The ledger is held.
func (l *ledger) linkBudget(e *entry) {
	x := e.info.opt()
	up, spawn, own := l.budgetOf(x.budgetUp), l.budgetOf(x.spawnUp), x.budget
	if up == nil && spawn == nil && own == nil {
		return
	}
	a := e.accountOf()
	a.bud, a.spawnUp = up, spawn
	if up != nil {
		up.refs++
	}
	if spawn != nil {
		spawn.refs++
	}
	if own != nil {
		a.bud = &budget{owner: e, lim: *own, up: up}
	}
	for b := a.bud; b != nil; b = b.up {
		b.live++
	}
	l.reserve(e, a, true)
}

// reserve takes (take) or gives back a spawn reservation of live task e
// in the budgets above it.
func (l *ledger) reserve(e *entry, a *acct, take bool) {
	if a.reserved == take || (take && a.started) {
		return
	}
	a.reserved = take
	d := int64(1)
	if !take {
		d = -1
	}
	for b := a.spawnUp; b != nil; b = b.up {
		b.reserved += d
	}
}

// budgetRan notes that a session of e ran: its spawn is spent.
func (l *ledger) budgetRan(e *entry) {
	a := e.acct
	if a == nil || a.bud == nil || a.started {
		return
	}
	l.reserve(e, a, false)
	a.started = true
	for b := a.spawnUp; b != nil; b = b.up {
		b.spawned++
		l.crossed(b)
	}
}

// budgetLive notes that e ended (live false) or lives again (a retry).
func (l *ledger) budgetLive(e *entry, live bool) {
	a := e.acct
	if a == nil || a.bud == nil {
		return
	}
	d := int64(1)
	if !live {
		d = -1
	}
	for b := a.bud; b != nil; b = b.up {
		b.live += d
	}
	l.reserve(e, a, live)
}

// pinned reports whether retention must keep ended task e: a task of its
// tree (the outermost budget it spends from) is still live.
func (e *entry) pinned() bool {
	if e.acct == nil || e.acct.bud == nil || e.acct.bud.owner != e {
		return false
	}
	return e.acct.bud.live > 0 || e.acct.bud.refs > 0
}

// budgetForgot moves what task e, forgotten by retention, added to its
// budgets into what they carry. m.mu is held.
func (l *ledger) budgetForgot(e *entry) {
	a := e.acct
	if a == nil {
		return
	}
	for b := a.bud; b != nil; b = b.up {
		if b.owner != e {
			b.forgot = b.forgot.Add(a.total)
		}
	}
	if a.started {
		for b := a.spawnUp; b != nil; b = b.up {
			b.forgotSpawned++
		}
	}
	x := e.info.opt()
	for _, id := range [...]string{x.budgetUp, x.spawnUp} {
		if b := l.budgetOf(id); b != nil {
			b.refs--
		}
	}
}

// carry applies a usage record of no attempt to e, which holds a budget:
// what forgotten tasks had added to it (a compaction's).
func (l *ledger) carry(e *entry, u *usageRec) {
	b := e.acct.bud
	b.spent, b.forgot = b.spent.Add(u.u), b.forgot.Add(u.u)
	b.spawned += u.spawned
	b.forgotSpawned += u.spawned
	l.crossed(b)
}

// state is b as BudgetState shows it.
func (b *budget) state() BudgetState {
	s := BudgetState{TaskID: b.owner.id, Limit: b.lim, Spent: b.spent, Spawned: b.spawned, Reserved: b.reserved,
		Exceeded: b.over, SoftReached: b.soft, Left: Budget{Tokens: -1, Cost: -1, Requests: -1, Spawns: -1}}
	left := func(cur *int64, limit, spent int64) {
		if limit <= 0 {
			return
		}
		if n := max(limit-spent, 0); *cur < 0 || n < *cur {
			*cur = n
		}
	}
	for x := b; x != nil; x = x.up {
		left(&s.Left.Tokens, x.lim.Tokens, x.spent.Tokens())
		c := int64(s.Left.Cost)
		left(&c, int64(x.lim.Cost), int64(x.spent.Cost))
		s.Left.Cost = Cost(c)
		left(&s.Left.Requests, x.lim.Requests, x.spent.Requests)
		left(&s.Left.Spawns, x.lim.Spawns, x.spawned+x.reserved)
	}
	return s
}

// budgetState is Task.Budget of e: the innermost budget it spends from.
func (e *entry) budgetState() *BudgetState {
	if e.acct == nil || e.acct.bud == nil {
		return nil
	}
	s := e.acct.bud.state()
	return &s
}

// Budget returns the state of the budget task id spends from (its own,
// or the innermost above it), and false when it spends from none.
// ErrUnknownTask (or ErrForgotten) for an id the Manager does not hold.
func (m *Manager) Budget(id string) (BudgetState, bool, error) {
	m.mu.Lock()
	defer m.unlock()
	e := m.led.tasks[id]
	if e == nil {
		return BudgetState{}, false, m.missing(id)
	}
	if s := e.budgetState(); s != nil {
		return *s, true, nil
	}
	return BudgetState{}, false, nil
}

// budgetAdmit refuses a launch (info) into a branch whose budget is spent
// or has no spawn left, and works out the grant of one that brings a
// budget of its own (Spec.Budget, or WithBudget at a root): clamped by
// what the budgets above it have left. m.mu is held.
func (m *Manager) budgetAdmit(info *taskInfo) error {
	up, spawn, err := m.led.above(info)
	if err != nil {
		return err
	}
	for b := up; b != nil; b = b.up {
		if b.over != "" {
			return b.refusal(b.over)
		}
	}
	for b := spawn; b != nil; b = b.up {
		if b.over != "" {
			return b.refusal(b.over)
		}
		if b.lim.Spawns > 0 && b.spawned+b.reserved >= b.lim.Spawns {
			return b.refusal(LimitSpawns)
		}
	}
	own := info.opt().budget
	if own == nil && up == nil && m.cfg.budget != nil {
		if _, task := m.led.bySession[info.parent]; !task { // a root launch
			g := *m.cfg.budget
			own = &g
		}
	}
	if own == nil && up == nil && spawn == nil {
		return nil
	}
	x := *info.extra() // its own copy: a launch that waits (MaxPerParent) asks again with what it asked
	info.x = &x
	if up != nil {
		x.budgetUp = up.owner.id
	}
	if spawn != nil {
		x.spawnUp = spawn.owner.id
	}
	if own == nil {
		return nil
	}
	g := *own
	if up != nil {
		left := up.state().Left
		clamp := func(asked *int64, left int64) {
			if left >= 0 && (*asked == 0 || *asked > left) {
				*asked = left
			}
		}
		clamp(&g.Tokens, left.Tokens)
		c := int64(g.Cost)
		clamp(&c, int64(left.Cost))
		g.Cost = Cost(c)
		clamp(&g.Requests, left.Requests)
		if left.Spawns >= 0 {
			clamp(&g.Spawns, left.Spawns-1) // the launch itself takes one
		}
	}
	x.budget = &g
	return nil
}

// refusal is the error of a launch refused by limit of b.
func (b *budget) refusal(limit string) *BudgetError {
	e := &BudgetError{TaskID: b.owner.id, Limit: limit}
	switch limit {
	case LimitTokens:
		e.Max, e.Spent = b.lim.Tokens, b.spent.Tokens()
	case LimitCost:
		e.Max, e.Spent = int64(b.lim.Cost), int64(b.spent.Cost)
	case LimitRequests:
		e.Max, e.Spent = b.lim.Requests, b.spent.Requests
	case LimitSpawns:
		e.Max, e.Spent, e.Reserved = b.lim.Spawns, b.spawned, b.reserved
	}
	return e
}

// NotifyBudget tells the parent of a budget's task that its branch
// reached the budget's soft threshold, or a hard limit (then the branch
// is being stopped): once each, Task the budget's task, Text the figures.
const NotifyBudget NotificationKind = "budget"

// budgetCrossed acts on the thresholds budgets reached in the records
// just committed: the parent hears of each; a hard limit stops the
// budget's branch (a closure, stop cause the budget). m.mu is held.
func (m *Manager) budgetCrossed() {
	cs := m.led.crossings
	m.led.crossings = nil
	for _, c := range cs {
		b, holder := c.b, c.b.owner
		if m.cfg.metrics != nil {
			s, hard := b.state(), c.hard
			m.measure(func(mt Metrics) { mt.BudgetCrossed(s, hard) })
		}
		m.logLocked(slog.LevelWarn, "budget threshold reached", slog.String("task", holder.id), slog.Bool("hard", c.hard),
			slog.String("exceeded", b.over), slog.String("spent", b.spent.String()))
		if m.cfg.notifier != nil && m.led.tasks[holder.id] == holder {
			m.notify(holder, NotifyBudget, budgetText(b.state(), c.hard, c.limit))
		}
		if c.hard && b.live > 0 {
			m.stopBudget(b)
		}
	}
}

// stopBudget stops everything that spends from b, whose hard limit was
// reached: the branch of the task that holds it, closed as a unit, and
// any live task outside that branch that spends from it all the same (one
// that continues a session of the branch, ContinueFrom), closed likewise.
// The fences go up at once; the passes run on goroutines the Manager
// owns. m.mu is held.
func (m *Manager) stopBudget(b *budget) {
	cs := []*closure{m.openClosure(sessionOf(b.owner), b.owner, closedByBudget, "")}
	now := m.now()
	for _, e := range m.order {
		if e.terminal() || e.acct == nil || !spendsFrom(e.acct.bud, b) {
			continue
		}
		// Its stop is asked now, in the commit that reached the limit:
		// Fence fails for its run from here on, before any abort.
		m.wantStop(e, budgetNote(e), now)
		if !m.taskInBranch(e, cs[0]) {
			c := m.openClosure(sessionOf(e), e, closedByBudget, "")
			c.quiet = true
			cs = append(cs, c)
		}
	}
	for _, c := range cs {
		if !m.effect(effect{kind: fxCascade, closure: c, session: c.root}) {
			delete(m.closures.active, c) // after Shutdown nothing runs its passes
			m.signal()
			m.closureEnded(c, ClosureReport{SessionID: c.root, TaskID: c.task.id}, false, ErrShutdown)
		}
	}
}

// spendsFrom reports whether the chain of budgets from x up holds b.
func spendsFrom(x, b *budget) bool {
	for ; x != nil; x = x.up {
		if x == b {
			return true
		}
	}
	return false
}

// budgetNote is the stop a budget closure of task e asks: the budget it
// spends from that was spent (the innermost), and the limit reached.
func budgetNote(e *entry) *recordExt {
	holder, limit := e.id, ""
	if e.acct != nil {
		for b := e.acct.bud; b != nil; b = b.up {
			if b.over != "" {
				holder, limit = b.owner.id, b.over
				break
			}
		}
	}
	return &recordExt{stop: StatusCancelled, note: noteBudget + limit + noteBudgetOf + holder}
}

// budgetText is what the parent is told of a threshold s reached.
func budgetText(s BudgetState, hard bool, limit string) string {
	if hard {
		return "[Budget] Task " + s.TaskID + ": its budget is spent (" + s.Exceeded + "). Its tasks are being stopped and new ones are refused. " + budgetFigures(s)
	}
	return "[Budget] Task " + s.TaskID + ": its tree reached " + strconv.Itoa(s.Limit.soft()) + "% of its " + limit + " limit. " + budgetFigures(s)
}

// figure is one figure of a budget: its name (a Limit… constant), what
// was used of it, its limit (0: none) and what is left (-1: no limit).
type figure struct {
	name              string
	used, limit, rest int64
}

// append appends n as f counts it (a Cost for cost) to b.
func (f *figure) append(b []byte, n int64) []byte {
	if f.name == LimitCost {
		return appendCost(b, Cost(n))
	}
	return strconv.AppendInt(b, n, 10)
}

// figures are s's four figures, in order.
func (s BudgetState) figures() [4]figure {
	return [...]figure{
		{LimitTokens, s.Spent.Tokens(), s.Limit.Tokens, s.Left.Tokens},
		{LimitCost, int64(s.Spent.Cost), int64(s.Limit.Cost), int64(s.Left.Cost)},
		{LimitRequests, s.Spent.Requests, s.Limit.Requests, s.Left.Requests},
		{LimitSpawns, s.Spawned, s.Limit.Spawns, s.Left.Spawns},
	}
}

// Figures says what the budget's branch spent — each figure that has a
// limit or was used, "tokens 1050 of 1000, requests 2" ("nothing" if none)
// — and what it has left — each limited figure, the budgets above
// counted, "tokens 0" ("" if none is) — figures named as BudgetError
// names them: for a page or a command line.
func (s BudgetState) Figures() (spent, left string) {
	var sp, lf []byte
	figs := s.figures()
	for i := range figs {
		f := &figs[i]
		if f.limit > 0 || f.used > 0 {
			if len(sp) > 0 {
				sp = append(sp, ", "...)
			}
			sp = f.append(append(append(sp, f.name...), ' '), f.used)
			if f.limit > 0 {
				sp = f.append(append(sp, " of "...), f.limit)
			}
		}
		if f.rest >= 0 {
			if len(lf) > 0 {
				lf = append(lf, ", "...)
			}
			lf = f.append(append(append(lf, f.name...), ' '), f.rest)
		}
	}
	if len(sp) == 0 {
		return "nothing", string(lf)
	}
	return string(sp), string(lf)
}

// budgetFigures is s in one line: what was spent of each limit, and what
// is left.
func budgetFigures(s BudgetState) string {
	figs := s.figures()
	num := func(b []byte, f *figure, n int64) []byte { return f.append(b, n) }
	b := append(make([]byte, 0, 160), "Spent: "...)
	n := 0
	for i := range figs {
		f := &figs[i]
		if f.limit <= 0 && f.used <= 0 {
			continue
		}
		if n++; n > 1 {
			b = append(b, ", "...)
		}
		b = num(b, f, f.used)
		name := f.name
		if f.limit > 0 {
			b = append(b, " of "...)
			b = num(b, f, f.limit)
		} else if f.used == 1 && name != LimitCost {
			name = name[:len(name)-1] // "1 request"
		}
		b = append(append(b, ' '), name...)
	}
	if n == 0 {
		b = append(b, "nothing"...)
	}
	b = append(b, '.')
	n = 0
	for i := range figs {
		f := &figs[i]
		if f.rest < 0 {
			continue
		}
		if n++; n == 1 {
			b = append(b, " Left: "...)
		} else {
			b = append(b, ", "...)
		}
		b = append(append(num(b, f, f.rest), ' '), f.name...)
	}
	if n > 0 {
		b = append(b, '.')
	}
	return string(b)
}

// budgetNotice is the envelope's one line on s: what the tree spent and
// has left, for the parent model to pace itself by.
func budgetNotice(s *BudgetState) string {
	if s == nil {
		return ""
	}
	n := "budget: " + budgetFigures(*s)
	if s.Exceeded != "" {
		n += " The " + s.Exceeded + " limit was reached: new tasks in this tree are refused."
	}
	return n
}

// restartedBy is what finishes a closure of task id a crash interrupted:
// the budget's, when the task's own budget is spent, so that its runs
// are stopped by the budget still. m.mu is taken.
func (m *Manager) restartedBy(id string) string {
	m.mu.Lock()
	defer m.unlock()
	if e := m.led.tasks[id]; e != nil && e.acct != nil && e.acct.bud != nil && e.acct.bud.owner == e && e.acct.bud.over != "" {
		return closedByBudget
	}
	return closedByRestart
}

// restopBudgets closes again, after a restart, the branch of every spent
// budget that still has a live task in it (a run whose stop failed, or a
// crossing another process made). m.mu is held.
func (m *Manager) restopBudgets() {
	for _, e := range m.order {
		if a := e.acct; a != nil && a.bud != nil && a.bud.owner == e && a.bud.over != "" && a.bud.live > 0 && !m.closingTask(e) {
			m.stopBudget(a.bud)
		}
	}
}

// closingTask reports whether a closure of e as a unit is active. m.mu
// is held.
func (m *Manager) closingTask(e *entry) bool {
	for c := range m.closures.active {
		if c.task == e {
			return true
		}
	}
	return false
}
