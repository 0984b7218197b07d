package bgtaskhttp

import (
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/bgtask/bgtask"
)

// The table and chart pages of the live view (table.go and charts.go
// make what they show).

// tableData is what the table page shows.
type tableData struct {
	Rows    []tableRow
	Total   int
	Shown   string // "1–100 of 812"
	Prev    string
	Next    string
	Export  string // the JSON of every row the filters select
	Columns []column
	Values  url.Values // the filters, for the form
	Models  []string   // the values the filters offer (datalists)
	Agents  []string
	Classes []string
	// The bulk actions on what the filters select (unless read-only):
	// their filters, and how many tasks a cancel (the live ones) and a
	// close (all) would stop, which the confirmation states.
	Acts bool
	Bulk string
	Live int
}

// column is a sortable column's header.
type column struct {
	Name   string
	Href   string // sort by it (the other way if it is the sort)
	Sorted string // "asc", "desc", or "" when not the sort
}

// table serves the table page, or with ?format=json every row its
// filters select, as JSON (tableExport).
func (v *view) table(w http.ResponseWriter, r *http.Request) {
	snap := v.m.Snapshot()
	tree := grow(snap)
	now := time.Now()
	vals := r.URL.Query()
	d := v.header(tree, "bgtask · table")
	d.Mode = "table"
	q, err := tableQueryOf(vals, now)
	if err != nil {
		if vals.Get("format") == "json" {
			writeError(w, err)
			return
		}
		d.Error = strings.TrimPrefix(err.Error(), "bgtask: ")
		d.Table = &tableData{Values: vals}
		v.render(w, http.StatusBadRequest, "table", d)
		return
	}
	if vals.Get("format") == "json" {
		q.offset, q.limit = 0, len(snap.Tasks)
		rows, total := tableOf(snap.Tasks, q, now)
		out := tableExport{Total: total, Tasks: make([]bgtask.Task, len(rows))}
		for i, row := range rows {
			out.Tasks[i] = *row.Task
		}
		w.Header().Set("Content-Disposition", `attachment; filename="bgtask-tasks.json"`)
		writeBig(w, r, out)
		return
	}
	rows, total := tableOf(snap.Tasks, q, now)
	td := &tableData{Rows: rows, Total: total, Values: vals}
	if total > 0 && len(rows) > 0 {
		td.Shown = strconv.Itoa(q.offset+1) + "–" + strconv.Itoa(q.offset+len(rows)) + " of " + strconv.Itoa(total)
	}
	with := func(set map[string]string) string {
		u := url.Values{}
		for k, vs := range vals {
			u[k] = slices.Clone(vs)
		}
		for k, v := range set {
			if v == "" {
				u.Del(k)
			} else {
				u.Set(k, v)
			}
		}
		return "/view/table?" + u.Encode()
	}
	if q.offset > 0 {
		td.Prev = with(map[string]string{"offset": strconv.Itoa(max(q.offset-q.limit, 0))})
	}
	if q.offset+len(rows) < total {
		td.Next = with(map[string]string{"offset": strconv.Itoa(q.offset + q.limit)})
	}
	td.Export = with(map[string]string{"format": "json", "offset": "", "limit": ""})
	sortBy := q.sort
	if sortBy == "" {
		sortBy = "started"
	}
	for _, c := range tableSorts {
		col := column{Name: c}
		order := "desc"
		if c == sortBy {
			col.Sorted = map[bool]string{true: "asc", false: "desc"}[q.asc]
			if !q.asc {
				order = "asc"
			}
		}
		col.Href = with(map[string]string{"sort": c, "order": order, "offset": ""})
		td.Columns = append(td.Columns, col)
	}
	models, agents, classes := map[string]bool{}, map[string]bool{}, map[string]bool{}
	for i := range snap.Tasks {
		t := &snap.Tasks[i]
		if m := t.Model.String(); m != "" && len(models) < 200 {
			models[m], models[t.Model.Provider] = true, true
		}
		if t.Agent != "" && len(agents) < 200 {
			agents[t.Agent] = true
		}
		if c := errorClass(t); c != "" {
			classes[c] = true
		}
	}
	td.Models, td.Agents, td.Classes = sortedKeys(models), sortedKeys(agents), sortedKeys(classes)
	if !v.o.ReadOnly && total > 0 {
		td.Acts, td.Bulk = true, bulkQuery(vals).Encode()
		if live, err := bulkTargets(snap, bulkQuery(vals), false, now); err == nil {
			td.Live = len(live)
		}
	}
	d.Table = td
	v.render(w, http.StatusOK, "table", d)
}

// sortedKeys are m's keys, in order.
func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// charts serves the chart page: the charts of the snapshot's tasks over
// the last hour.
func (v *view) charts(w http.ResponseWriter, r *http.Request) {
	snap := v.m.Snapshot()
	d := v.header(grow(snap), "bgtask · charts")
	d.Mode = "charts"
	d.Charts = chartsOf(snap.Tasks, d.Now).draw()
	v.render(w, http.StatusOK, "charts", d)
}

// costText is a cost as the table shows it ("" for none).
func costText(c bgtask.Cost) string {
	if c == 0 {
		return ""
	}
	return c.String()
}

// durationText is d as the table shows it, to the second.
func durationText(d time.Duration) string {
	if d <= 0 {
		return ""
	}
	return d.Round(time.Second).String()
}
