package bgtask

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// FuzzEventSequences drives a Manager with a random sequence of launches,
// events (current, superseded, unknown, by attempt id, with stale tokens),
// failing starts and aborts, and cancels, and checks the ledger invariants
// after every step: at most one non-terminal attempt and it is current;
// terminal attempts never change; task fields equal the current attempt's;
// revisions only grow; a terminal task has exactly one final summary, last.
func FuzzEventSequences(f *testing.F) {
	f.Add([]byte{0, 2, 1, 0, 2, 1, 1, 0})
	f.Add([]byte{0, 3, 1, 2, 1, 2, 1, 0, 3, 0})
	f.Add([]byte{0, 1, 4, 1, 1, 5, 3, 0, 1, 1})
	f.Add([]byte{0, 2, 2, 1, 1, 1, 1, 4, 1, 2, 3, 1})
	f.Fuzz(func(t *testing.T, script []byte) {
		if len(script) > 200 {
			return
		}
		runScript(t, script)
	})
}

func runScript(t *testing.T, script []byte) {
	var failStarts, failAborts atomic.Bool // read by the host's calls, on the Manager's goroutines
	host := &testHost{
		start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
			if failStarts.Load() {
				return "", errRateLimited
			}
			return sid, nil
		},
		abort: func(ctx context.Context, sid string) error {
			if failAborts.Load() {
				return errors.New("abort refused")
			}
			return nil
		},
	}
	h := newHarness(t, host, WithHoldLimit(8))
	m := h.m
	m.recordAll() // replay is exact: checked after every step
	frozen := map[string]Attempt{}
	revs := map[string]uint64{}
	var ids []string
	next := func() byte {
		if len(script) == 0 {
			return 0
		}
		b := script[0]
		script = script[1:]
		return b
	}
	kinds := []EventKind{SessionBusy, SessionIdle, SessionError, SessionInterrupted, SessionDeleted, SessionCompacted}
	errs := []error{errRateLimited, errForbidden, Permanent(errRateLimited), errors.New("context_length_exceeded")}
	for len(script) > 0 {
		op := next() % 7
		switch op {
		case 0: // launch with 1..3 models, under the root or a task's session
			n := int(next()%3) + 1
			models := []string{"a/1", "b/2", "c/3"}[:n]
			parent := "p"
			if sessions := allSessions(m); len(sessions) > 0 && next()%2 == 0 {
				parent = sessions[int(next())%len(sessions)]
			}
			task, err := m.Launch(context.Background(), Spec{ParentSessionID: parent, Models: mustModels(t, models...), MaxAttempts: int(next() % 4)})
			if err != nil {
				t.Fatalf("launch: %v", err)
			}
			ids = append(ids, task.ID)
		case 6: // close a branch; when it succeeds nothing in it runs
			root := "p"
			if sessions := allSessions(m); len(sessions) > 0 && next()%2 == 0 {
				root = sessions[int(next())%len(sessions)]
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			_, err := m.Stop(ctx, Target{Session: root})
			cancel()
			if errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("Stop of a session hung")
			}
			if err == nil {
				assertBranchStopped(t, m, root)
			}
		case 1, 2: // an event for some attempt of some task
			if len(ids) == 0 {
				continue
			}
			task := h.task(ids[int(next())%len(ids)])
			a := task.Attempts[int(next())%len(task.Attempts)]
			ev := Event{Kind: kinds[int(next())%len(kinds)], Err: errs[int(next())%len(errs)], Text: "t"}
			switch next() % 4 {
			case 0:
				ev.SessionID = a.SessionID
			case 1:
				ev.AttemptID = a.ID
			case 2:
				ev.SessionID, ev.Token = a.SessionID, "run-stale"
			case 3:
				ev.SessionID = fmt.Sprintf("ses-unknown-%d", next())
			}
			if ev.SessionID == "" && ev.AttemptID == "" {
				continue
			}
			before := task
			err := m.Observe(ev)
			if err != nil {
				if after := h.task(task.ID); after.Revision != before.Revision {
					t.Fatalf("rejected event %+v changed revision %d → %d", ev, before.Revision, after.Revision)
				}
			}
		case 3: // cancel
			if len(ids) == 0 {
				continue
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			if _, err := m.Stop(ctx, Target{Task: ids[int(next())%len(ids)]}); errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("Stop of a task hung: %v", err)
			}
			cancel()
		case 4:
			failStarts.Store(!failStarts.Load())
		case 5:
			failAborts.Store(!failAborts.Load())
		}
		settleThroughGates(h)
		checkInvariants(t, m)
		if err := m.checkReplay(); err != nil {
			t.Fatal(err)
		}
		for _, task := range m.Snapshot().Tasks {
			if task.Revision < revs[task.ID] {
				t.Fatalf("task %s revision went back %d → %d", task.ID, revs[task.ID], task.Revision)
			}
			revs[task.ID] = task.Revision
			for _, a := range task.Attempts {
				if old, ok := frozen[a.ID]; ok && old != a {
					t.Fatalf("terminal attempt changed:\n%+v\n%+v", old, a)
				}
				if a.Status.Terminal() {
					frozen[a.ID] = a
				}
			}
		}
	}
	for _, task := range m.Snapshot().Tasks {
		var kinds []NotificationKind
		for _, k := range h.rec.Kinds(task.ID) {
			if k != NotifyBranchClosed { // about the branch below the task, not the task
				kinds = append(kinds, k)
			}
		}
		finals := 0
		for _, k := range kinds {
			if k == NotifyFinalSummary {
				finals++
			}
		}
		want := 0
		if task.Status.Terminal() {
			want = 1
		}
		if finals != want || (finals == 1 && kinds[len(kinds)-1] != NotifyFinalSummary) {
			t.Fatalf("task %s (%s): notifications %v", task.ID, task.Status, kinds)
		}
	}
}

// allSessions lists every session any task's attempt was bound to.
func allSessions(m *Manager) []string {
	var out []string
	for _, task := range m.Snapshot().Tasks {
		for _, a := range task.Attempts {
			if a.SessionID != "" {
				out = append(out, a.SessionID)
			}
		}
	}
	return out
}

// assertBranchStopped checks that no task below root (through every
// session of every task found) is live, nor root's own live run.
func assertBranchStopped(t *testing.T, m *Manager, root string) {
	t.Helper()
	tasks := m.Snapshot().Tasks
	inScope := map[string]bool{root: true}
	for changed := true; changed; {
		changed = false
		for _, task := range tasks {
			if !inScope[task.ParentSessionID] {
				continue
			}
			for _, a := range task.Attempts {
				if a.SessionID != "" && !inScope[a.SessionID] {
					inScope[a.SessionID] = true
					changed = true
				}
			}
		}
	}
	for _, task := range tasks {
		if (inScope[task.ParentSessionID] || task.SessionID == root) && !task.Status.Terminal() {
			t.Fatalf("after closing %s, task %s (parent %s) is %s", root, task.ID, task.ParentSessionID, task.Status)
		}
	}
}

// settleThroughGates waits until no goroutine of the Manager runs. A turn
// end the children gate holds once the children settled waits
// defaultGateTimeout on the test's clock for a further turn (kidSettled),
// which in a script never comes: the clock is moved past it, and the gate
// releases the turn as it does when none comes. (Found by FuzzEventSequences:
// an idle of a session whose child was then cancelled.)
func settleThroughGates(h *harness) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	idle := make(chan error, 1)
	go func() { idle <- h.m.life.group.Wait(ctx) }()
	for {
		_, made := h.clock.Created()
		if h.clock.Pending() > 0 {
			h.clock.Advance(defaultGateTimeout)
			continue
		}
		select {
		case err := <-idle:
			require.NoError(h.t, err, "manager goroutines did not finish")
			return
		case <-made:
		}
	}
}
