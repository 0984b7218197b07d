// Package bgtask supervises background tasks for AI agent harnesses.
//
// A parent chat session launches a background task; the task runs as a
// child session on a provider's model. When that attempt fails — a
// forbidden provider, a rate limit, an overload, a session that could not
// be started — the task retries on the next model of a fallback chain, as a
// new child session. bgtask keeps the truth about every attempt, tells the
// parent what happened, and never reports a task stopped while its child
// still runs.
//
// # Start here
//
// The entry points a harness author starts from (most with an Example):
//
//   - Open makes a Manager over a Host: your session service, NewFuncHost
//     for subagents written as Go functions, or nil for tasks that each
//     bring their own function (Spec.Run). With WithJournal it is durable.
//     A Launch with the context of a run makes a tree of them.
//   - Manager.Launch starts a task, and Manager.Run starts one and waits
//     for its end; Manager.Observe feeds it what the child session does;
//     Manager.Wait, Manager.Task and Manager.Subscribe read it.
//   - Manager.Stop stops what a Target names — one task, a task with
//     everything beneath it (Tree), everything a session started, at every
//     depth, or one run — and says what it stopped (a ClosureReport).
//   - Manager.Extend sends a further prompt; Manager.WaitAnswer returns
//     each answer, in order.
//   - OpenFileJournal (or pgledger, for a fleet sharing PostgreSQL) makes
//     it survive a restart.
//   - Event.Usage (Run.Usage in-process) reports what a run spent;
//     Spec.Budget (or WithBudget) limits what a tree may spend, and stops
//     it when it has (ErrBudget, StopBudget).
//   - bgtasktest drives it from your tests without sleeping; bgtaskhttp
//     serves it over HTTP.
//
// # Tasks
//
// A Manager owns the tasks. Launch validates a Spec, records the task with
// its first attempt pending, and returns at once; the child session is
// started through the Host on a goroutine the Manager owns. Task, Tasks (a
// page of a Query) and Snapshot return snapshots (copies), Wait blocks until a task is terminal, and
// Shutdown stops everything and returns once no goroutine of the Manager is
// left. A task's Status, SessionID, Model, StartedAt, CompletedAt, Error and
// Result are always those of its current attempt.
//
// # Attempts and fallback
//
// Every run of a task is an Attempt with an immutable ID and a run Token
// that is never reused. Attempts live in an append-only ledger: each change
// is a record checked against the attempt state machine, and a terminal
// attempt is never written again. A retryable failure finalizes the current
// attempt as error, creates the next attempt pending on the next model,
// makes it current, aborts the failed session, then starts the new one,
// bound to exactly that attempt. DefaultRetryable decides what is
// retryable (from a status method or field, or a provider's message);
// WithRetryable sees its answer and decides; Permanent marks an error
// that must not be retried; WithRetryDelay (Backoff makes one) spaces
// retries out and sees the failure (RetryAfter reads what a provider
// asked for).
//
// # Events
//
// The harness reports what child sessions do with Observe. Each event is
// first resolved to an attempt — by Event.AttemptID, or through the
// sessionID→attemptID index — and only the current, live attempt moves. An
// event for a superseded or terminal attempt returns ErrStaleEvent, one for
// a session nobody knows ErrUnknownSession; neither changes anything. A
// child may talk before StartSession has returned: such events are held,
// bounded, and applied in order once the session is bound; at the bound,
// liveness is dropped but the event that ends a run is always kept.
// SessionBusy and SessionCompacted never end a run.
//
// # Cancellation
//
// Stop of a task (Target.Task) returns once the child has stopped: the host
// confirmed the abort, or no child existed yet. If the abort fails, the task
// stays in its live state and Stop returns the error. A child that finishes
// before the abort lands keeps its outcome: an answer completes it, and its
// own failure ends it in error (a stop only forbids a retry; the status says
// what ended the run). A session that arrives after a stop was asked is
// bound — it exists, so the attempt runs — and aborted; it is cancelled when
// the host confirms. Stop acts on the run it observed, by token (Target.Run
// names one run by its token, and does nothing if that run was replaced);
// with Target.NoWait it returns once the stop is recorded, and the task ends
// cancelled when its child stops. Concurrent stops of one run share one
// abort. Contexts given to Host and Notifier calls carry the run they serve
// (RunFromContext), so a stop made from inside a callback that would wait on
// itself returns ErrStopPending instead of deadlocking.
//
// # Branch closure
//
// Stop with Target.Session stops a whole branch of work and proves it
// stopped: the session, and every task launched — recursively — from any
// session of any task in the branch, historical attempts included, as the
// ledger recorded them. A task is the unit: closing any of its sessions
// closes the task's live run and what all its sessions launched; Target.Task
// with Tree does the same by task id. From its first instant a fence refuses
// new work in the branch (ErrBranchClosing) and suppresses retries; every
// live run is aborted by token, while one walk of the ledger's edges goes
// on; the branch is rescanned until nothing runnable is left (a rescan needs
// no walk when the ledger recorded nothing since that could add a run). It
// returns nil only when everything stopped, and otherwise a *ClosureError
// naming what did not; with Target.NoWait it returns once the fence is up,
// with the first pass's report, and the closure finishes in the background.
// Each closure is recorded (a ClosureReport, in Snapshot.Closures) and
// announced to the root's parent (NotifyBranchClosed). A SessionDeleted
// event for a task's current session closes the branch beneath it.
//
// # Outcomes and the envelope
//
// Every terminal task carries an Outcome, computed once from what the task
// ended with (at its first read, so a task nobody reads costs nothing) and
// handed out by both Wait (Task.Outcome) and the final summary
// notification: a state, and — when the parent is not getting a clean
// answer — a Reason from a closed set (context overflow, output limit,
// content filter, provider error, no final text, unconsumed tool call,
// unknown), with the child's last output kept as bounded evidence. Facts the
// host did not report are marked unknown, never guessed. The Outcome's
// Envelope is the <task> block a parent model reads: <task_result> for an
// answer (verbatim), <task_error> for a failure, <task_status> for a
// cancelled or still-running task, and one-line <task_notice> facts. No
// content can break it (fuzzed): the answer inside is exact.
//
// # Notifications
//
// With WithNotifier, the parent session hears NotifyRetryScheduled when an
// attempt failed and the next model was chosen, NotifyRetrySessionReady when
// the retry's session exists, and exactly one NotifyFinalSummary, last, for
// every terminal outcome — completed, error, cancelled or interrupt —
// carrying the Timeline of all attempts. Notifications for one parent are
// delivered one at a time in the order they were produced, never under the
// Manager's lock, so a Notifier (like a Host) may call back into the
// Manager. A refused notification is retried (WithNotifyRetry), then kept
// (Dropped().Undelivered). The queues and what is kept are bounded
// (WithNotifyLimits), so a stuck Notifier costs bounded memory. When the
// last live task of a parent ends, the parent gets exactly one
// NotifyAllComplete.
//
// # Invocations and the children gate
//
// Every prompt sent into a task's child conversation is an invocation: the
// launch prompt is 1, and Extend admits the next ones to a running task
// through a Host that implements Prompter (FuncHost does: Run.Prompts,
// Run.Answer). A turn end (Event.Invocation) answers every open invocation
// up to the one it had seen; answers are released in invocation order,
// each once, to WaitAnswer and as a NotifyAnswer (the last one is the final
// summary), and the task ends only when its last invocation is answered. A
// stop or a failure answers every open invocation.
//
// A turn end while tasks the child's session launched still run, or their
// results are not yet delivered to it, is held (ActivityAwaitingChildren);
// the first turn after they settled is the answer, and without one the held
// turn is released degraded after WithGateTimeout. A Notifier that hands a
// result to an in-process session calls Delivered first. TaskProtocol is
// the text that tells a model so. Spec.Key makes one start owner per key,
// Spec.ContinueFrom resumes an ended task's session (Resumer), and Fence
// lets a tool refuse the side effect of a superseded run.
//
// # Subagent trees
//
// A FuncHost function is told its task (Run: description, metadata, root and
// depth) and can spawn beneath its own session: a Launch (or Run) with the
// function's context, run.Manager().Launch(ctx, spec), goes beneath it and,
// unless Spec.Detached, holds the run's end until it has ended (the children
// gate). Returning lets it return a value of the harness's type, kept beside
// the task (Task.Value) while Task.Result stays its text, and Task.Cause
// keeps the original error value. Spec.Attach keeps a value of the harness's
// own with the task, journaled, read back typed with Attached. Spec.OnDone
// tells the launching caller once, after the final summary.
// Spec.InheritValues passes the Launch context's values (never its
// cancellation) to the host calls, and Spec.CancelWithCaller stops the
// task's branch when that context ends. WithTreeLimits bounds depth, live
// tasks per parent session (a Launch past it waits its turn, bounded) and
// per tree; Spec.Timeout and Spec.AttemptTimeout end a run at a wall-clock
// deadline (reason deadline). Tasks looks tasks up by parent, root, metadata
// and status through indexes. A Model may be a bare alias (no provider),
// Spec.ID may set a task's id, and WithRetryable extends DefaultRetryable,
// which also hears an error's own IsRetryable, Temporary and Timeout
// methods.
//
// # Bad input and user code
//
// A nil context is treated as context.Background() by every method that
// takes one. Blank ids and blank Spec fields are refused with an error that
// says which, before anything changes. User code that runs on the Manager's
// goroutines — a Host, a Notifier, a FuncHost function, a classifier, a
// retry delay, a logger, an error's own Error or StatusCode method — is
// guarded: a panic fails the attempt it served with a non-retryable error
// that names it (a logger's panic is swallowed and counted,
// Dropped().LoggerPanics), and the Manager goes on. Shutdown returns when
// its context ends (after a short grace, shutdownGrace) and names what a
// Host or Notifier that ignores its context left running.
//
// # How it is built: a core and a shell
//
// Everything that can change a task enters the Manager as one of a closed
// set of inputs (a launch, an event, a session start or abort that
// returned, a retry ready to go, a timer that fired, a stop, Shutdown),
// decided under the Manager's one lock by code that does no I/O. Deciding
// writes ledger records through a single commit, which derives everything
// that follows from what was written — waiters woken, the change
// published, a concurrency slot handed on, the notifications a retry or an
// ended task produces, the end of a parent's round — and queues effects as
// values: a session to start, a session to abort, a retry to prepare, a
// timer to watch. Once the lock is released, the shell runs them on
// goroutines the Manager owns (the next start or retry a host call's
// answer sets off runs on the goroutine that made the call), and what they
// learn comes back as the next input. User
// code that must run before a decision (an error's own methods, the retry
// classifier, the retry delay) runs in the shell, and its answer is part of
// the input.
//
// The ledger's records stand alone: each carries its task, a sequence
// number, and what its kind needs, with no pointer into live state. Memory
// keeps only their projection (the tasks and their attempts); a tap sees
// every record as it is committed, which is where a journal attaches, and
// replaying the records into an empty ledger reproduces every task,
// outcome, envelope, timeline, closure record and notification text.
// Activity and the time of a run's last event are process-local on
// purpose and not recorded.
//
// # Durability and restart
//
// Without a journal a Manager is memory-only. With WithJournal (the file
// journal: OpenFileJournal) every committed record is appended and made
// durable — group commit: concurrent commits share one sync, an
// fdatasync into preallocated segment space on Linux — before
// anything it describes happens: a session start, an abort, a
// notification. A record of intent (start requested, abort requested,
// notification produced) precedes each such call, so after a crash the
// replay knows which calls may have happened. Open replays the journal and
// reconciles what was live through the host (StatusHost): an alive child
// is re-adopted, an ended one finishes with its evidence, a gone one (or
// one no host can report on) ends interrupt; a run that never asked for a
// child starts; undelivered notifications are delivered again with their
// stable Notification.ID; a closure the crash interrupted is finished. A
// journal that fails stops the Manager (ErrJournal). Ended tasks leave
// memory under WithRetention (ErrForgotten answers for them), and the
// journal is compacted as they go; while retention keeps one that has
// settled (ended, its notifications out), it is kept frozen: its attempts
// in one compact string, read back exactly (about 1.5 KB for a task of
// three attempts).
//
// # Following state
//
// Subscribe streams a Change for every applied mutation, with a
// manager-wide sequence number; Snapshot returns every task at a sequence.
// The mirror package keeps a client's copy consistent from both; an epoch
// names a Manager's process life, and a snapshot from a different epoch
// replaces what an older one said, whatever the clocks say. Task.Activity
// (generating, waiting) is process-local and never persisted.
//
// # Where things are
//
// Every change is an input decided under one lock by decide (core.go),
// which sends it to the file of its kind: a launch to launch.go, an event
// to observe.go, a start's answer to start.go, a retry's delay to
// retry.go, a stop to stop.go, a deadline to deadline.go, queue and stall
// timers to limits.go, Extend and the children gate to invocation.go, a
// restart's answers to recovery.go, Shutdown to manager.go. The effects a
// decision queues (start, retry, abort, watch a timer) run after the lock
// is released, from effects.go, in the same files. The ledger (ledger.go,
// entry.go, builders.go) records every change through one commit
// (commit.go); record.go encodes them, journal.go keeps them, and
// retention.go freezes and forgets what settled. The README's "Layout"
// has the full map.
package bgtask
