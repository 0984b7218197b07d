package bgtaskhttp

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/bgtask/bgtask"
)

// Bulk actions: a stop of every task a table's filters select (table.go).
//
//	POST /tasks/cancel?<filters>&expect=N   cancel every live task they select
//	POST /tasks/close?<filters>&expect=N    close the branch of every task they select
//
// expect is the count the caller confirmed (the page's dialog states it):
// if the filters now select another number of tasks, nothing is stopped
// and the answer is 409 selection_changed, with the count now. Each stop
// is recorded and set off (Target.NoWait) before the answer, with the
// actor Authorize named; the answer (BulkReport) lists what was asked and
// what was refused.

// errSelectionChanged: a bulk action's filters select another count of
// tasks than the caller confirmed.
var errSelectionChanged = errors.New("bgtaskhttp: the selection changed")

// BulkReport is a bulk action's answer.
type BulkReport struct {
	// Asked are the tasks a stop was recorded for, in the table's order.
	Asked []string `json:"asked"`
	// Refused are those the Manager refused (an ended task, a stop pending, …), with why.
	Refused []BulkRefusal `json:"refused,omitempty"`
}

// BulkRefusal is a task a bulk action could not stop, and why.
type BulkRefusal struct {
	TaskID string `json:"taskID"`
	Error  string `json:"error"`
	Code   string `json:"code"`
}

// bulkTargets are the tasks a bulk action (tree: a close) on the
// filters of vals selects now: for a cancel, the live ones.
func bulkTargets(snap bgtask.Snapshot, vals url.Values, tree bool, now time.Time) ([]string, error) {
	q, err := tableQueryOf(vals, now)
	if err != nil {
		return nil, err
	}
	q.offset, q.limit = 0, max(len(snap.Tasks), 1)
	rows, _ := tableOf(snap.Tasks, q, now)
	ids := make([]string, 0, len(rows))
	for _, r := range rows {
		if tree || !r.Task.Status.Terminal() {
			ids = append(ids, r.Task.ID)
		}
	}
	return ids, nil
}

// bulkQuery is vals without what does not select (the page, the order,
// the format, expect): the filters a bulk action names.
func bulkQuery(vals url.Values) url.Values {
	out := url.Values{}
	for k, vs := range vals {
		switch k {
		case "offset", "limit", "sort", "order", "format", "expect":
			continue
		}
		out[k] = vs
	}
	return out
}

// bulk serves POST /tasks/cancel (tree false) and /tasks/close (true).
func bulk(m Source, tree bool) func(ctx context.Context, w http.ResponseWriter, r *http.Request) {
	return func(ctx context.Context, w http.ResponseWriter, r *http.Request) {
		vals := r.URL.Query()
		expect, err := strconv.Atoi(vals.Get("expect"))
		if err != nil || expect < 0 {
			writeError(w, fmt.Errorf("%w: expect %q: want the count of tasks the action was confirmed for (a whole number)", bgtask.ErrInvalidArgument, vals.Get("expect")))
			return
		}
		ids, err := bulkTargets(m.Snapshot(), bulkQuery(vals), tree, time.Now())
		if err != nil {
			writeError(w, err)
			return
		}
		if len(ids) != expect {
			writeJSON(w, http.StatusConflict, errorBody{Code: "selection_changed",
				Error: fmt.Sprintf("%v: the filters select %d tasks now, not the %d confirmed: nothing was stopped; look again", errSelectionChanged, len(ids), expect)})
			return
		}
		rep := BulkReport{Asked: []string{}}
		actor := actorOf(r)
		for _, id := range ids {
			if ctx.Err() != nil {
				rep.Refused = append(rep.Refused, BulkRefusal{TaskID: id, Error: "not asked: " + ctx.Err().Error(), Code: "deadline_exceeded"})
				continue
			}
			_, err := m.Stop(ctx, bgtask.Target{Task: id, Tree: tree, NoWait: true, Actor: actor})
			if err != nil {
				_, code := statusOf(err)
				rep.Refused = append(rep.Refused, BulkRefusal{TaskID: id, Error: strings.TrimPrefix(err.Error(), "bgtask: "), Code: code})
				continue
			}
			rep.Asked = append(rep.Asked, id)
		}
		writeJSON(w, http.StatusOK, rep)
	}
}
