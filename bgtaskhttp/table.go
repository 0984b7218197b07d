package bgtaskhttp

import (
	"cmp"
	"fmt"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/statusarg"
)

// The table mode of the live view: one row a task, its columns sortable,
// filtered by status, model or provider, agent, time range and error
// class, and the rows a filter selects exported as JSON. It reads a
// snapshot (a Manager's, or a fleet's), so it costs the same wherever the
// tasks live.

// tableSorts are the columns a table sorts by, in the order the page
// shows them.
var tableSorts = []string{"status", "agent", "model", "started", "duration", "tokens", "cost", "class"}

// tableQuery is what a table shows: the filters, the sort, and the page.
type tableQuery struct {
	statuses []bgtask.Status
	model    string // "provider/id", or "provider": every model of it
	agent    string
	from, to time.Time // launched at or after from, before to (zero: no bound)
	class    string    // error class (errorClass)
	sort     string    // one of tableSorts; "": started
	asc      bool      // ascending; the default is descending
	offset   int
	limit    int
}

// tableLimit bounds a page of the table (and the default one).
const (
	tableLimit   = 100
	tableMaxPage = 1000
)

// tableQueryOf reads a tableQuery from a URL's query: status
// (repeatable), model, agent, from and to (RFC 3339, or a duration before
// now such as "15m"), class, sort, order ("asc" or "desc"), offset and
// limit. A bad value is an invalid_argument error that names it.
func tableQueryOf(v url.Values, now time.Time) (tableQuery, error) {
	q := tableQuery{model: strings.TrimSpace(v.Get("model")), agent: strings.TrimSpace(v.Get("agent")),
		class: strings.TrimSpace(v.Get("class")), sort: v.Get("sort"), limit: tableLimit}
	bad := func(name, value, want string) (tableQuery, error) {
		return tableQuery{}, fmt.Errorf("%w: %s %q: %s", bgtask.ErrInvalidArgument, name, value, want)
	}
	for _, s := range v["status"] {
		st, err := statusarg.Parse(s)
		if err != nil {
			return tableQuery{}, fmt.Errorf("%w: %v", bgtask.ErrInvalidArgument, err)
		}
		q.statuses = append(q.statuses, st)
	}
	if q.sort != "" && !slices.Contains(tableSorts, q.sort) {
		return bad("sort", q.sort, "want one of "+strings.Join(tableSorts, ", "))
	}
	switch o := v.Get("order"); o {
	case "", "desc":
	case "asc":
		q.asc = true
	default:
		return bad("order", o, `want "asc" or "desc"`)
	}
	for _, b := range []struct {
		name string
		at   *time.Time
	}{{"from", &q.from}, {"to", &q.to}} {
		s := strings.TrimSpace(v.Get(b.name))
		if s == "" {
			continue
		}
		if d, err := time.ParseDuration(s); err == nil && d >= 0 {
			*b.at = now.Add(-d)
			continue
		}
		at, err := time.Parse(time.RFC3339, s)
		if err != nil {
			return bad(b.name, s, `want a time (RFC 3339, "2026-12-07T12:00:00Z") or a duration before now ("15m")`)
		}
		*b.at = at
	}
	if !q.from.IsZero() && !q.to.IsZero() && !q.from.Before(q.to) {
		return bad("from", v.Get("from"), "want a time before to")
	}
	for _, n := range []struct {
		name string
		to   *int
		max  int
	}{{"offset", &q.offset, maxPageNumber * tableMaxPage}, {"limit", &q.limit, tableMaxPage}} {
		s := v.Get(n.name)
		if s == "" {
			continue
		}
		i, err := strconv.Atoi(s)
		if err != nil || i < 0 || i > n.max || (n.name == "limit" && i == 0) {
			return bad(n.name, s, fmt.Sprintf("want a whole number from %d to %d", map[bool]int{true: 1, false: 0}[n.name == "limit"], n.max))
		}
		*n.to = i
	}
	return q, nil
}

// tableRow is a task as a row of the table.
type tableRow struct {
	Task     *bgtask.Task
	Model    string
	Duration time.Duration // launch to end; to now while live
	Tokens   int64         // input and output
	Cost     bgtask.Cost
	Class    string // errorClass
}

// rowOf is t's row at now.
func rowOf(t *bgtask.Task, now time.Time) tableRow {
	r := tableRow{Task: t, Model: t.Model.String(), Class: errorClass(t)}
	if !t.LaunchedAt.IsZero() {
		end := now
		if t.Status.Terminal() && !t.CompletedAt.IsZero() {
			end = t.CompletedAt
		}
		r.Duration = max(end.Sub(t.LaunchedAt), 0)
	}
	if t.Usage != nil {
		r.Tokens = t.Usage.Total.InputTokens + t.Usage.Total.OutputTokens
		r.Cost = t.Usage.Total.Cost
	}
	return r
}

// match reports whether r passes q's filters.
func (q *tableQuery) match(r *tableRow) bool {
	t := r.Task
	switch {
	case len(q.statuses) > 0 && !slices.Contains(q.statuses, t.Status),
		q.agent != "" && t.Agent != q.agent,
		q.class != "" && r.Class != q.class,
		!q.from.IsZero() && t.LaunchedAt.Before(q.from),
		!q.to.IsZero() && !t.LaunchedAt.Before(q.to):
		return false
	case q.model == "":
		return true
	case strings.Contains(q.model, "/"):
		return r.Model == q.model
	}
	return t.Model.Provider == q.model
}

// tableOf is q's page of tasks at now, and how many rows q's filters
// select in all (the page is a part of them).
func tableOf(tasks []bgtask.Task, q tableQuery, now time.Time) (page []tableRow, total int) {
	rows := make([]tableRow, 0, min(len(tasks), 1024))
	for i := range tasks {
		if r := rowOf(&tasks[i], now); q.match(&r) {
			rows = append(rows, r)
		}
	}
	by := rowOrder(q.sort)
	slices.SortStableFunc(rows, func(a, b tableRow) int {
		c := by(&a, &b)
		if c == 0 { // newest first, then by id: a stable order across loads
			c = b.Task.LaunchedAt.Compare(a.Task.LaunchedAt)
			if c == 0 {
				c = strings.Compare(a.Task.ID, b.Task.ID)
			}
			return c
		}
		if !q.asc {
			c = -c
		}
		return c
	})
	total = len(rows)
	if q.offset >= total {
		return nil, total
	}
	return rows[q.offset:min(q.offset+q.limit, total)], total
}

// rowOrder compares two rows by a column (ascending).
func rowOrder(column string) func(a, b *tableRow) int {
	switch column {
	case "status":
		return func(a, b *tableRow) int { return cmp.Compare(a.Task.Status, b.Task.Status) }
	case "agent":
		return func(a, b *tableRow) int { return strings.Compare(a.Task.Agent, b.Task.Agent) }
	case "model":
		return func(a, b *tableRow) int { return strings.Compare(a.Model, b.Model) }
	case "duration":
		return func(a, b *tableRow) int { return cmp.Compare(a.Duration, b.Duration) }
	case "tokens":
		return func(a, b *tableRow) int { return cmp.Compare(a.Tokens, b.Tokens) }
	case "cost":
		return func(a, b *tableRow) int { return cmp.Compare(a.Cost, b.Cost) }
	case "class":
		return func(a, b *tableRow) int { return strings.Compare(a.Class, b.Class) }
	}
	return func(a, b *tableRow) int { return a.Task.LaunchedAt.Compare(b.Task.LaunchedAt) }
}

// tableExport is the JSON export of a table: every row its filters
// select (not only a page), in its order, each task whole.
type tableExport struct {
	Total int           `json:"total"`
	Tasks []bgtask.Task `json:"tasks"`
}
