package bgtask

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/bgtask/bgtask/internal/codec"
	"github.com/bgtask/bgtask/internal/wal"
)

// recordKind says what a record did.
type recordKind uint8

const (
	recTaskLaunched       recordKind = iota + 1 // a task and its spec
	recAttemptCreated                           // a new attempt, pending; it becomes current
	recAttemptPending                           // a pending attempt's reason changed
	recSessionBound                             // a pending attempt got its session and runs
	recAttemptFinal                             // an attempt reached a terminal status
	recRetryScheduled                           // the current attempt failed and the next was chosen
	recSessionOrphan                            // a session was created for an attempt no longer current
	recBranchClosed                             // a branch closure ended (manager-wide, not per task)
	recStopRequested                            // a stop of the task was asked for (which, and by whom); no retry follows
	recStopWithdrawn                            // the abort a stop asked for failed: the run goes on
	recNotifyProduced                           // a notification was produced for a parent
	recNotifyDelivered                          // the Notifier accepted a notification, or it was given up (note says why)
	recStartRequested                           // a StartSession call for the attempt is about to be made
	recAbortRequested                           // an AbortSession call for the run is about to be made
	recEpoch                                    // a process life began on this ledger (manager-wide)
	recClosureOpened                            // a branch closure began: its fence is up until it ends
	recClosureDropped                           // a closure ended with nothing to record (its root was no one's)
	recInvocationAdmitted                       // a supplemental prompt was handed to the task's child session (Extend)
	recAnswerFiled                              // a turn end answered an invocation, released in invocation order
	recModelSkipped                             // the pending attempt's model was cooling: it moves to the chain's next (WithHealth)
	recHealthReset                              // a harness reset a model's or provider's health by hand (manager-wide)
	recCooldownBegan                            // a model's or provider's cooldown began here, or its end moved (manager-wide, WithHealth)
	recUsage                                    // an attempt reported usage (format 6): counted for it, its task and its budgets
)

var recordKindNames = [...]string{
	recTaskLaunched:       "task_launched",
	recAttemptCreated:     "attempt_created",
	recAttemptPending:     "attempt_pending",
	recSessionBound:       "session_bound",
	recAttemptFinal:       "attempt_finalized",
	recRetryScheduled:     "retry_scheduled",
	recSessionOrphan:      "session_orphaned",
	recBranchClosed:       "branch_closed",
	recStopRequested:      "stop_requested",
	recStopWithdrawn:      "stop_withdrawn",
	recNotifyProduced:     "notification_produced",
	recNotifyDelivered:    "notification_delivered",
	recStartRequested:     "start_requested",
	recAbortRequested:     "abort_requested",
	recEpoch:              "epoch",
	recClosureOpened:      "closure_opened",
	recClosureDropped:     "closure_dropped",
	recInvocationAdmitted: "invocation_admitted",
	recAnswerFiled:        "answer_filed",
	recModelSkipped:       "model_skipped",
	recHealthReset:        "health_reset",
	recCooldownBegan:      "cooldown_began",
	recUsage:              "usage",
}

func (k recordKind) String() string {
	if int(k) < len(recordKindNames) && recordKindNames[k] != "" {
		return recordKindNames[k]
	}
	return fmt.Sprintf("record(%d)", k)
}

// record is one immutable ledger entry: a value that stands alone. It
// carries its task's id ("" for a manager-wide record: a closure, an
// all-complete notification), a sequence number strictly increasing across
// the Manager, its kind and what its kind needs — no pointer to a live
// structure (what it points to is immutable and its own). Attempt records
// carry the whole new version of the attempt, so applying one is a
// replacement, checked against the state machine.
type record struct {
	seq     uint64
	kind    recordKind
	task    string
	at      time.Time
	attempt Attempt // attempt records, stops: the attempt (run) it concerns
	// evidence (recAttemptFinal) is what the run reported that decides its
	// outcome: inline, as most final records carry some.
	evidence evidence
	// inv (recInvocationAdmitted: the invocation, with no answer;
	// recAnswerFiled: with its answer) is inline: a round trip of Extend
	// writes two such records, and they need nothing else.
	inv *Invocation
	// usage (recUsage: the attempt and what it used) is inline too: a
	// usage report writes that record alone.
	usage *usageRec
	// *recordExt holds what only some kinds carry; attempt records, by far
	// the most, carry none.
	*recordExt
}

// recordExt is the part of a record only some kinds carry. Everything it
// points to is immutable once the record is made.
type recordExt struct {
	spec    *taskInfo      // recTaskLaunched: the whole spec
	session string         // recSessionOrphan
	note    string         // recStopRequested: who asked; recStopWithdrawn: the abort's error
	stop    Status         // recStopRequested: the status the stop gives
	closure *ClosureReport // recBranchClosed, by value
	notice  *notice        // recNotifyProduced, recNotifyDelivered
	epoch   uint64         // recEpoch: the process life's number
	opened  uint64         // recBranchClosed, recClosureDropped: the sequence of the closure's opening record
	skip    *Skip          // recModelSkipped: the model skipped, why, until when (format 5)
	cool    *coolRec       // recCooldownBegan: the cooldown (format 5)
}

// noExt is the extension of a record that has none, for encoding one whose
// only extended field is inline (record.inv). Never written to.
var noExt recordExt

// evidence is what a run reported that decides its outcome, kept in its
// final record: its last output, how its turn ended, and the reason of the
// failure that ended it (worked out outside the lock).
type evidence struct {
	output string
	finish string
	noText bool
	reason Reason
	notice string // a fact that rides the answer (the children gate released it degraded)
	budget string // the budget's figures when the attempt ended (format 6): the envelope's notice
}

// notice is a notification as the ledger records it: what was produced for
// whom (the text as rendered), or, delivered, only its sequence.
type notice struct {
	id         string // Notification.ID: stable across restarts
	seq        uint64 // Notification.Seq
	kind       NotificationKind
	parent     string
	text       string
	attempt    string   // retry notifications: the attempt the task had just made current
	tasks      []string // NotifyAllComplete: the round's tasks, in the order given
	invocation int      // NotifyAnswer: the invocation answered
	closure    uint64   // NotifyBranchClosed: the sequence of its closure record
	// full is the notification itself, when it is delivered with its
	// commit (an AtCommit notifier, fleet.NoteOf): never encoded, never
	// replayed.
	full *Notification
}

// taskInfo is what a task was launched with; it never changes.
type taskInfo struct {
	id          string
	parent      string
	description string
	agent       string
	prompt      string
	models      []Model
	maxAttempts int // resolved: > 0
	metadata    map[string]string
	launchedAt  time.Time
	// x is what only some specs set (read it with opt, write it with
	// extra): nil when the spec set none of it, which most do not.
	x *taskExtra
	// Worked out as the launch is applied, then recorded with it: the
	// session at the top of the task's tree, and its depth in it (1:
	// launched from a session no task owns).
	root  string
	depth int
	// inProcess: the task runs its own function (Spec.Run), on the
	// Manager's in-process host. Process-local, never recorded.
	inProcess bool
	// sessions is what this process's host can do with the task's session
	// once it ended (the envelope's notice): process-local, never recorded,
	// set by the Manager that launched or replayed the task.
	sessions sessionKind
}

// taskExtra is the part of a task's spec that only some specs set.
type taskExtra struct {
	key       string // Spec.Key: one live task per key
	continues string // Spec.ContinueFrom: the ended task whose session it resumes
	resume    string // that task's session, resumed by the first attempt
	prior     string // that task's output, reported once as prior output
	// Spec.Timeout, Spec.AttemptTimeout, Spec.RetryOnTimeout: the task's
	// and each run's wall-clock deadline (0: none).
	timeout, attemptTimeout time.Duration
	retryOnTimeout          bool
	// budget is the task's own budget as granted (Spec.Budget, clamped
	// at its launch); budgetUp the task holding the budget it spends from
	// (its own aside), spawnUp the one its spawn counts in, as its launch
	// resolved them ("": none). Recorded (format 6), so that a replay
	// links it as the launch did, whatever order the records come in.
	budget            *Budget
	budgetUp, spawnUp string
	// Spec.Detached and Spec.Attach (its JSON). Recorded (format 7).
	detached bool
	attach   json.RawMessage
}

// noExtra is the taskExtra of a spec that set none of it. Never written.
var noExtra taskExtra

// opt is ti's optional part, to read (zero values when the spec set none).
func (ti *taskInfo) opt() *taskExtra {
	if ti.x == nil {
		return &noExtra
	}
	return ti.x
}

// extra is ti's optional part, to write while the task is being made.
func (ti *taskInfo) extra() *taskExtra {
	if ti.x == nil {
		ti.x = new(taskExtra)
	}
	return ti.x
}

// roomFor is the room to make, at once, for the attempts of a task that
// may make n of them: n, up to a few.
func roomFor(n int) int { return min(n, 8) }

// check refuses a spec no launch makes (a journal bgtask did not write):
// a task needs a model and at least one attempt, and its place in its
// tree and its deadlines are not negative.
func (ti *taskInfo) check() error {
	switch {
	case len(ti.models) == 0:
		return errors.New("ledger: a task launched with no model")
	case ti.maxAttempts < 1:
		return fmt.Errorf("ledger: a task launched with %d attempts at most", ti.maxAttempts)
	case ti.depth < 0:
		return fmt.Errorf("ledger: a task launched at depth %d", ti.depth)
	case ti.opt().timeout < 0 || ti.opt().attemptTimeout < 0:
		return errors.New("ledger: a task launched with a negative timeout")
	}
	return nil
}

// modelFor returns the model of attempt number n (1-based): the chain in
// order, the last model reused past its end.
func (ti *taskInfo) modelFor(n int) Model {
	return ti.models[min(n, len(ti.models))-1]
}

// recordFormat is the version byte that starts every encoded record.
// Format 2 added evidence's notice, an invocation, and a spec's key;
// format 3 a spec's deadlines and its place in its tree; format 4 that a
// task runs its own function (Spec.Run). Records of older formats are
// still read. A record is written in format 3 unless it needs 4 (only the
// launch of a task with its own function does), so a journal without such
// tasks is read by the releases before format 4. Format 5 adds a skipped
// model (recModelSkipped) and a cooldown (recCooldownBegan), and only
// such records are written in it. Format 6 adds usage (recUsage), a
// launch's budget and a final record's budget figures, likewise; format 7
// a launch's Spec.Detached and Spec.Attach, likewise.
const recordFormat = 7

// encodeRecord is rec as a Journal stores it (internal/codec: uvarints,
// length-prefixed strings, times with their zone offset).
func encodeRecord(rec *record) (Record, error) {
	r, _, err := encodeInto(make([]byte, 0, 160), rec)
	return r, err
}

// encodeInto appends rec, encoded, to b: the Record's Data is what it
// appended (capped, so that appending to it never writes into b), and b
// is returned grown, for the next record of a batch.
func encodeInto(b []byte, rec *record) (Record, []byte, error) {
	start := len(b)
	w := codec.Writer{B: b}
	format := byte(3) // 4 to 6 only when a record needs it (see recordFormat)
	if rec.recordExt != nil && rec.spec != nil && rec.spec.inProcess {
		format = 4
	}
	if rec.recordExt != nil && (rec.skip != nil || rec.cool != nil) {
		format = 5
	}
	if rec.evidence.budget != "" || rec.usage != nil || (rec.recordExt != nil && rec.spec != nil && rec.spec.opt().inBudget()) {
		format = 6
	}
	if rec.recordExt != nil && rec.spec != nil && (rec.spec.opt().detached || rec.spec.opt().attach != nil) {
		format = 7
	}
	w.B = append(w.B, format)
	w.Uint(rec.seq)
	w.Uint(uint64(rec.kind))
	w.String(rec.task)
	w.Time(rec.at)
	a := &rec.attempt
	w.Bool(a.ID != "")
	if a.ID != "" {
		for _, f := range [...]string{a.ID, a.Token, a.SessionID, a.Model.Provider, a.Model.ID, a.Model.Variant, string(a.Status), string(a.Pending), a.Error, a.Result} {
			w.String(f)
		}
		w.Uint(uint64(a.Number))
		w.Time(a.StartedAt)
		w.Time(a.CompletedAt)
	}
	ev := rec.evidence
	w.Bool(ev != (evidence{}))
	if ev != (evidence{}) {
		w.String(ev.output)
		w.String(ev.finish)
		w.Bool(ev.noText)
		w.String(string(ev.reason))
		w.String(ev.notice)
		if format >= 6 {
			w.String(ev.budget)
		}
	}
	w.Bool(rec.recordExt != nil || rec.inv != nil || rec.usage != nil)
	if x := rec.recordExt; x != nil || rec.inv != nil || rec.usage != nil {
		if x == nil {
			x = &noExt
		}
		if err := encodeExt(&w, x, rec.inv, rec.usage, format); err != nil {
			return Record{}, b, fmt.Errorf("encoding record %d (%s): %w", rec.seq, rec.kind, err)
		}
	}
	return recordOf(rec, w.B[start:len(w.B):len(w.B)]), w.B, nil
}

// recordOf is rec as a Journal sees it, with data its encoding.
func recordOf(rec *record, data []byte) Record {
	a := &rec.attempt
	out := Record{Seq: rec.seq, Kind: rec.kind.String(), TaskID: rec.task, AttemptID: a.ID, Token: a.Token, SessionID: a.SessionID, Data: data}
	if rec.recordExt != nil && rec.spec != nil {
		out.ParentSessionID = rec.spec.parent
	}
	if u := rec.usage; u != nil {
		out.Usage, out.AttemptID = &u.u, u.attempt
	}
	if rec.recordExt != nil && rec.notice != nil {
		out.note = rec.notice.full
	}
	return out
}

// encodeExt writes the part of a record only some kinds carry.
func encodeExt(w *codec.Writer, x *recordExt, inv *Invocation, use *usageRec, format byte) error {
	w.Bool(x.spec != nil)
	if ti := x.spec; ti != nil {
		for _, f := range [...]string{ti.id, ti.parent, ti.description, ti.agent, ti.prompt} {
			w.String(f)
		}
		w.Uint(uint64(len(ti.models)))
		for _, m := range ti.models {
			w.String(m.Provider)
			w.String(m.ID)
			w.String(m.Variant)
		}
		w.Uint(uint64(ti.maxAttempts))
		w.Uint(uint64(len(ti.metadata)))
		for k, v := range ti.metadata {
			w.String(k)
			w.String(v)
		}
		w.Time(ti.launchedAt)
	}
	w.String(x.session)
	w.String(x.note)
	w.String(string(x.stop))
	if err := writeJSON(w, x.closure != nil, x.closure); err != nil { // rare, and a public type: its JSON shape
		return err
	}
	w.Bool(x.notice != nil)
	if n := x.notice; n != nil {
		w.String(n.id)
		w.Uint(n.seq)
		for _, f := range [...]string{string(n.kind), n.parent, n.text, n.attempt} {
			w.String(f)
		}
		w.Uint(uint64(len(n.tasks)))
		for _, t := range n.tasks {
			w.String(t)
		}
		w.Uint(n.closure)
	}
	w.Uint(x.epoch)
	w.Uint(x.opened)
	// Format 2 on: the invocation, then the spec's key.
	if err := writeJSON(w, inv != nil, inv); err != nil {
		return err
	}
	key := ""
	if x.spec != nil {
		key = x.spec.opt().key
	}
	w.String(key)
	noteInv := 0
	if x.notice != nil {
		noteInv = x.notice.invocation
	}
	w.Uint(uint64(noteInv))
	var cont [3]string
	if ti := x.spec; ti != nil {
		cont = [3]string{ti.opt().continues, ti.opt().resume, ti.opt().prior}
	}
	for _, f := range cont {
		w.String(f)
	}
	// Format 3 on: the spec's deadlines.
	var timeouts [2]time.Duration
	retry := false
	if ti := x.spec; ti != nil {
		timeouts, retry = [2]time.Duration{ti.opt().timeout, ti.opt().attemptTimeout}, ti.opt().retryOnTimeout
	}
	for _, d := range timeouts {
		w.Uint(uint64(d))
	}
	w.Bool(retry)
	root, depth := "", 0
	if ti := x.spec; ti != nil {
		root, depth = ti.root, ti.depth
	}
	w.String(root)
	w.Uint(uint64(depth))
	switch {
	case format >= 5:
		encodeExt5(w, x)
	case x.spec != nil && x.spec.inProcess: // format 4 (encodeInto marks it)
		w.Bool(true)
	}
	if format >= 6 {
		encodeExt6(w, x, use)
	}
	if format >= 7 {
		var detached bool
		var attach []byte
		if x.spec != nil {
			detached, attach = x.spec.opt().detached, x.spec.opt().attach
		}
		w.Bool(detached)
		w.String(string(attach))
	}
	return nil
}

// encodeExt5 writes what format 5 has after format 3's part: the bool of
// format 4 always, then the skip and the cooldown.
func encodeExt5(w *codec.Writer, x *recordExt) {
	w.Bool(x.spec != nil && x.spec.inProcess)
	w.Bool(x.skip != nil)
	if sk := x.skip; sk != nil {
		w.Uint(uint64(sk.Attempt))
		w.String(sk.Model.Provider)
		w.String(sk.Model.ID)
		w.String(sk.Model.Variant)
		w.String(sk.Why)
		w.Time(sk.Until)
	}
	w.Bool(x.cool != nil)
	if c := x.cool; c != nil {
		w.String(c.Key)
		w.Time(c.Since)
		w.Time(c.Until)
		w.String(c.Why)
		w.Uint(uint64(c.inARow))
	}
}

// encodeExt6 writes what format 6 added: a launch's budget, a usage.
func encodeExt6(w *codec.Writer, x *recordExt, use *usageRec) {
	var b *Budget
	if x.spec != nil {
		b = x.spec.opt().budget
	}
	w.Bool(b != nil)
	if b != nil {
		for _, n := range [...]int64{b.Tokens, int64(b.Cost), b.Requests, b.Spawns, int64(b.SoftPercent)} {
			w.Uint(uint64(n))
		}
	}
	var up, spawn string
	if x.spec != nil {
		up, spawn = x.spec.opt().budgetUp, x.spec.opt().spawnUp
	}
	w.String(up)
	w.String(spawn)
	w.Bool(use != nil)
	if u := use; u != nil {
		w.String(u.attempt)
		for _, n := range [...]int64{u.u.InputTokens, u.u.OutputTokens, u.u.CachedTokens, u.u.Requests, int64(u.u.Cost), u.spawned} {
			w.Uint(uint64(n))
		}
	}
}

// decodeExt6 reads what encodeExt6 wrote into x, and the usage.
func decodeExt6(d *codec.Reader, x *recordExt) (*usageRec, error) {
	figures := func(n int) ([]int64, error) {
		out := make([]int64, n)
		for i := range out {
			v := d.Uint()
			if v > math.MaxInt64 {
				return nil, errors.New("a figure out of range")
			}
			out[i] = int64(v)
		}
		return out, nil
	}
	if d.Bool() {
		f, err := figures(5)
		if err != nil {
			return nil, fmt.Errorf("budget: %w", err)
		}
		if f[4] > math.MaxInt32 {
			return nil, errors.New("budget: a soft threshold out of range")
		}
		if b := (&Budget{Tokens: f[0], Cost: Cost(f[1]), Requests: f[2], Spawns: f[3], SoftPercent: int(f[4])}); x.spec != nil {
			x.spec.extra().budget = b
		}
	}
	if up, spawn := d.String(), d.String(); x.spec != nil && up+spawn != "" {
		x.spec.extra().budgetUp, x.spec.extra().spawnUp = up, spawn
	}
	if d.Bool() {
		u := &usageRec{attempt: d.String()}
		f, err := figures(6)
		if err != nil {
			return nil, fmt.Errorf("usage: %w", err)
		}
		u.u, u.spawned = Usage{InputTokens: f[0], OutputTokens: f[1], CachedTokens: f[2], Requests: f[3], Cost: Cost(f[4])}, f[5]
		return u, nil
	}
	return nil, nil
}

// writeJSON writes whether v is present and, if it is, its JSON.
func writeJSON(w *codec.Writer, present bool, v any) error {
	w.Bool(present)
	if !present {
		return nil
	}
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	w.String(string(b))
	return nil
}

// readJSON reads what writeJSON wrote into v, and reports whether it was
// present.
func readJSON(d *codec.Reader, v any) (bool, error) {
	if !d.Bool() {
		return false, nil
	}
	return true, json.Unmarshal([]byte(d.String()), v)
}

// decodeRecord is the record a Journal returned.
func decodeRecord(r Record) (record, error) { return decodeData(r.Data, r.Seq, nil) }

// recordError is why a replay refused a record: the record, as far as it
// could be read (its sequence and kind), where the journal keeps it (a
// file journal's segment and offset, once located), and the cause.
type recordError struct {
	seq  uint64
	kind recordKind // 0: not known
	// decoding: the record could not be decoded (else it was refused).
	decoding bool
	at       wal.Location // the zero Location: not located
	err      error
}

func (e *recordError) Error() string {
	var b strings.Builder
	b.WriteString("journal")
	if e.at != (wal.Location{}) {
		b.WriteString(" " + e.at.String())
	}
	b.WriteString(": ")
	if e.decoding {
		b.WriteString("decoding ")
	}
	kind := "kind unknown"
	if e.kind != 0 {
		kind = e.kind.String()
	}
	fmt.Fprintf(&b, "record %d (%s): %v", e.seq, kind, e.err)
	return b.String()
}

func (e *recordError) Unwrap() error { return e.err }

// decodeData is the record data encodes; seq names it in an error if the
// record's own cannot be read.
func decodeData(data []byte, seq uint64, words *codec.Words) (record, error) {
	if len(data) == 0 || data[0] == 0 || data[0] > recordFormat {
		return record{}, &recordError{seq: seq, decoding: true, err: fmt.Errorf("not a record of format 1 to %d", recordFormat)}
	}
	format, d := data[0], codec.Reader{B: data[1:], Words: words}
	rec := record{seq: d.Uint(), kind: recordKind(d.Uint()), task: d.String(), at: d.Time()}
	bad := func(err error) (record, error) {
		re := &recordError{seq: rec.seq, kind: rec.kind, decoding: true, err: err}
		if re.seq == 0 {
			re.seq = seq
		}
		if int(re.kind) >= len(recordKindNames) {
			re.kind = 0
		}
		return record{}, re
	}
	if d.Bool() {
		var f [10]string
		for i := range f {
			if i >= 3 && i < 8 { // the model and the statuses: words a replay reads again and again
				f[i] = d.Word()
			} else {
				f[i] = d.String()
			}
		}
		rec.attempt = Attempt{ID: f[0], Token: f[1], SessionID: f[2], Model: Model{Provider: f[3], ID: f[4], Variant: f[5]},
			Status: Status(f[6]), Pending: PendingReason(f[7]), Error: f[8], Result: f[9], Number: int(d.Uint())}
		rec.attempt.StartedAt, rec.attempt.CompletedAt = d.Time(), d.Time()
	}
	if d.Bool() {
		rec.evidence = evidence{output: d.String(), finish: d.Word(), noText: d.Bool(), reason: Reason(d.Word())}
		if format >= 2 {
			rec.evidence.notice = d.String()
		}
		if format >= 6 {
			rec.evidence.budget = d.String()
		}
	}
	if d.Bool() {
		x, inv, use, err := decodeExt(&d, format)
		if err != nil {
			return bad(err)
		}
		rec.usage = use
		if rec.inv = inv; *x != noExt {
			rec.recordExt = x
		}
		if x.spec != nil && x.spec.id == rec.task {
			x.spec.id = rec.task // one string for the task's id, as a live launch has
		}
	}
	if err := d.Err(); err != nil {
		return bad(err)
	}
	if int(rec.kind) >= len(recordKindNames) || recordKindNames[rec.kind] == "" {
		return bad(fmt.Errorf("unknown kind %d", rec.kind))
	}
	return rec, nil
}

// decodeExt reads what encodeExt wrote, in a record of format.
func decodeExt(d *codec.Reader, format byte) (_ *recordExt, inv *Invocation, use *usageRec, _ error) {
	x := &recordExt{}
	if d.Bool() {
		ti := &taskInfo{id: d.String(), parent: d.Word(), description: d.String(), agent: d.Word(), prompt: d.String()}
		for n := d.Uint(); n > 0 && d.Err() == nil; n-- {
			ti.models = append(ti.models, Model{Provider: d.Word(), ID: d.Word(), Variant: d.Word()})
		}
		ti.maxAttempts = int(d.Uint())
		for n := d.Uint(); n > 0 && d.Err() == nil; n-- {
			if ti.metadata == nil {
				ti.metadata = make(map[string]string)
			}
			k := d.String()
			ti.metadata[k] = d.String()
		}
		ti.launchedAt = d.Time()
		x.spec = ti
	}
	x.session, x.note, x.stop = d.String(), d.String(), Status(d.String())
	var cr ClosureReport
	if ok, err := readJSON(d, &cr); err != nil {
		return nil, nil, nil, fmt.Errorf("closure: %w", err)
	} else if ok {
		x.closure = &cr
	}
	if d.Bool() {
		n := &notice{id: d.String(), seq: d.Uint(), kind: NotificationKind(d.String()), parent: d.String(), text: d.String(), attempt: d.String()}
		for k := d.Uint(); k > 0 && d.Err() == nil; k-- {
			n.tasks = append(n.tasks, d.String())
		}
		n.closure = d.Uint()
		x.notice = n
	}
	x.epoch, x.opened = d.Uint(), d.Uint()
	if format >= 2 {
		var in Invocation
		if ok, err := readJSON(d, &in); err != nil {
			return nil, nil, nil, fmt.Errorf("invocation: %w", err)
		} else if ok {
			inv = &in
		}
		if key := d.String(); x.spec != nil && key != "" {
			x.spec.extra().key = key
		}
		if inv := int(d.Uint()); x.notice != nil {
			x.notice.invocation = inv
		}
		if c, r, p := d.String(), d.String(), d.String(); x.spec != nil && c+r+p != "" {
			o := x.spec.extra()
			o.continues, o.resume, o.prior = c, r, p
		}
	}
	if format >= 3 {
		if t, at, retry := time.Duration(d.Uint()), time.Duration(d.Uint()), d.Bool(); x.spec != nil && (t != 0 || at != 0 || retry) {
			o := x.spec.extra()
			o.timeout, o.attemptTimeout, o.retryOnTimeout = t, at, retry
		}
		if root, depth := d.String(), int(d.Uint()); x.spec != nil {
			x.spec.root, x.spec.depth = root, depth
		}
	}
	if format >= 4 {
		if own := d.Bool(); x.spec != nil {
			x.spec.inProcess = own
		}
	}
	if format >= 5 {
		if d.Bool() {
			x.skip = &Skip{Attempt: int(d.Uint()), Model: Model{Provider: d.Word(), ID: d.Word(), Variant: d.Word()}, Why: d.String(), Until: d.Time()}
		}
		if d.Bool() {
			x.cool = &coolRec{Cooldown: Cooldown{Key: d.String(), Since: d.Time(), Until: d.Time(), Why: d.String()}, inARow: int(d.Uint())}
		}
	}
	if format >= 6 {
		var err error
		if use, err = decodeExt6(d, x); err != nil {
			return nil, nil, nil, err
		}
	}
	if format >= 7 {
		detached, attach := d.Bool(), d.String()
		if attach != "" && !json.Valid([]byte(attach)) {
			return nil, nil, nil, errors.New("an attached value that is not JSON")
		}
		if x.spec != nil && (detached || attach != "") {
			x.spec.extra().detached = detached
			if attach != "" {
				x.spec.extra().attach = json.RawMessage(attach)
			}
		}
	}
	return x, inv, use, nil
}

// encodeAll encodes recs, in order.
func encodeAll(recs []record) ([]Record, error) {
	batch := make([]Record, 0, len(recs))
	buf := make([]byte, 0, recordGuess*len(recs)) // one allocation for the batch's Data, mostly
	for i := range recs {
		r, b, err := encodeInto(buf, &recs[i])
		if err != nil {
			return nil, err
		}
		batch, buf = append(batch, r), b
	}
	return batch, nil
}

// recordGuess is about what an encoded record takes (most are attempt
// records): what a batch's buffer is sized for.
const recordGuess = 192

// inBudget reports whether the spec's launch resolved a budget: its own,
// or one above it.
func (x *taskExtra) inBudget() bool {
	return x.budget != nil || x.budgetUp != "" || x.spawnUp != ""
}
