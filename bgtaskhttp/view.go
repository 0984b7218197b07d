package bgtaskhttp

import (
	"cmp"
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/statusarg"
)

// The live view: the page is rendered here, on the server, so a plain
// load of it shows the tasks; its script only adds what a page needs a
// script for (live refresh, loading a collapsed subtree, a confirmation
// before an action).

//go:embed view.tmpl view.js view.css
var viewFiles embed.FS

// Bounds of one rendered page, so that it costs the same at 10,000 tasks
// as at 10: a page of roots, each with a bounded number of children shown
// (a link to the rest), and levels past the second loaded when opened.
const (
	rootsPerPage = 30
	kidsShown    = 12  // children shown under a row at most…
	rowsPerPage  = 240 // … fewer when the roots shown would make more rows than this

	matchesShown  = 100
	errorShown    = 200
	detailPrompt  = 8 << 10
	openLevels    = 2 // levels shown open: the roots and their children
	maxPageNumber = 1 << 20
)

// viewCSP is the page's content security policy: its script and style
// come from this server only, and nothing else may load or frame it.
const viewCSP = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; " +
	"base-uri 'none'; form-action 'self'; frame-ancestors 'none'"

var viewTemplates = template.Must(template.New("view").Funcs(template.FuncMap{
	"since":    since,
	"at":       at,
	"when":     whenOf,
	"bound":    bound,
	"statuses": func() []bgtask.Status { return allStatuses },
	"has":      func(set []bgtask.Status, s bgtask.Status) bool { return slices.Contains(set, s) },
	"cost":     costText,
	"took":     durationText,
	"statusesOf": func(v url.Values) []bgtask.Status {
		out := make([]bgtask.Status, 0, len(v["status"]))
		for _, s := range v["status"] {
			out = append(out, bgtask.Status(s))
		}
		return out
	},
}).ParseFS(viewFiles, "view.tmpl"))

// allStatuses are the statuses the page filters by: those a URL may name
// (statusarg, which GET /tasks and cmd/bgtask read them with too).
var allStatuses = statusarg.All

// View serves the live view of m at "/", with the task detail pages under
// "/view/": the tasks as a tree (each nested under the task whose session
// launched it), running first, with filters by status and parent, a
// search by id, id prefix, description and metadata, each task's usage
// and the budget it spends from (a spent budget as a warning), what a top
// row's whole tree used, times in UTC with how long ago (or for how long),
// and a detail page per task (attempts, usage per attempt, budget,
// timeline, its history (Manager.History), outcome, envelope). The
// page is rendered on the server and refreshed from /events (its header
// says whether it follows them); its actions (unless o.ReadOnly) ask for
// confirmation and post to the Handler's action routes — extend only on a
// task that runs. Handler serves it unless Options.Page is
// set; View alone serves no API, so its page's live refresh and actions
// need the Handler's routes beside it.
func View(src Source, o Options) http.Handler {
	if nilSource(src) {
		panic("bgtaskhttp: View of a nil Source")
	}
	m := src
	return newGuard(viewMux(m, o), o)
}

// viewMux serves the view's routes, unguarded: Handler guards it with
// the API, View alone.
func viewMux(m Source, o Options) *http.ServeMux {
	v := &view{m: m, o: o}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", v.page)
	mux.HandleFunc("GET /view/task", v.detail) // ?id=: any id, even "..", is a query value
	mux.HandleFunc("GET /view/children", v.children)
	mux.HandleFunc("GET /view/table", v.table)
	mux.HandleFunc("GET /view/charts", v.charts)
	for _, name := range []string{"view.js", "view.css"} {
		b, _ := viewFiles.ReadFile(name)
		ctype := "text/javascript; charset=utf-8"
		if strings.HasSuffix(name, ".css") {
			ctype = "text/css; charset=utf-8"
		}
		mux.HandleFunc("GET /view/"+name, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", ctype)
			w.Header().Set("Cache-Control", "no-cache")
			_, _ = w.Write(b)
		})
	}
	return mux
}

type view struct {
	m Source
	o Options
}

// node is a task in the tree.
type node struct {
	t    *bgtask.Task
	up   *node
	kids []*node
	size int  // tasks below it
	live bool // it or a task below it is pending or running
	// tree is what it and every task below it used; used says whether any
	// of them reported usage.
	tree bgtask.Usage
	used bool
}

// forest is a snapshot as a tree.
type forest struct {
	snap   bgtask.Snapshot
	byID   map[string]*node
	roots  []*node
	counts map[bgtask.Status]int
}

// grow builds the tree of snap: a task's parent is the task one of whose
// attempts' sessions launched it; a task launched from a session no task
// owns is a root. Each level is sorted live first, then newest first.
func grow(snap bgtask.Snapshot) *forest {
	f := &forest{snap: snap, byID: make(map[string]*node, len(snap.Tasks)), counts: map[bgtask.Status]int{}}
	owners := make(map[string][]claim, len(snap.Tasks))
	for i := range snap.Tasks {
		t := &snap.Tasks[i]
		n := &node{t: t, live: !t.Status.Terminal()}
		f.byID[t.ID] = n
		f.counts[t.Status]++
		for _, a := range t.Attempts {
			if a.SessionID != "" {
				at := a.StartedAt
				if at.IsZero() {
					at = t.LaunchedAt
				}
				owners[a.SessionID] = append(owners[a.SessionID], claim{n, at})
			}
		}
	}
	for _, cs := range owners {
		slices.SortStableFunc(cs, func(a, b claim) int { return a.at.Compare(b.at) })
	}
	for i := range snap.Tasks {
		n := f.byID[snap.Tasks[i].ID]
		if up := ownerAt(owners[n.t.ParentSessionID], n.t.LaunchedAt); up != n {
			n.up = up
		}
	}
	uncycle(snap.Tasks, f.byID)
	for i := range snap.Tasks {
		n := f.byID[snap.Tasks[i].ID]
		if n.up != nil {
			n.up.kids = append(n.up.kids, n)
		} else {
			f.roots = append(f.roots, n)
		}
	}
	for _, r := range f.roots {
		settle(r)
	}
	order(f.roots)
	return f
}

// claim is a task's hold on a session, from a time: a session a
// continuation (ContinueFrom) took over has two.
type claim struct {
	n  *node
	at time.Time
}

// ownerAt is the task that held the session when a task was launched
// from it: the last claim made by then (the first, if none was).
func ownerAt(cs []claim, at time.Time) *node {
	if len(cs) == 0 {
		return nil
	}
	best := cs[0].n
	for _, c := range cs[1:] {
		if c.at.After(at) {
			break
		}
		best = c.n
	}
	return best
}

// uncycle cuts any loop of parent links (a journal from another writer
// could say anything) in one pass: each walk up stops at a task already
// placed, and a walk that meets itself makes the task that closes the
// loop a root.
func uncycle(tasks []bgtask.Task, byID map[string]*node) {
	const (
		unseen = iota
		onPath
		placed
	)
	state := make(map[*node]uint8, len(tasks))
	var path []*node
	for i := range tasks {
		path = path[:0]
		for n := byID[tasks[i].ID]; n != nil && state[n] == unseen; n = n.up {
			state[n] = onPath
			path = append(path, n)
			if n.up != nil && state[n.up] == onPath {
				n.up = nil // n closes a loop: it becomes a root
			}
		}
		for _, n := range path {
			state[n] = placed
		}
	}
}

// settle counts n's subtree, marks it live if anything in it is, sums
// what it used, and orders each level. It walks with a stack: a tree may
// be deep.
func settle(root *node) {
	var post []*node
	stack := []*node{root}
	for len(stack) > 0 {
		n := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		post = append(post, n)
		stack = append(stack, n.kids...)
	}
	for i := len(post) - 1; i >= 0; i-- {
		n := post[i]
		if u := n.t.Usage; u != nil {
			n.tree, n.used = u.Total, true
		}
		for _, k := range n.kids {
			n.size += 1 + k.size
			n.live = n.live || k.live
			if k.used {
				n.tree, n.used = n.tree.Add(k.tree), true
			}
		}
		order(n.kids)
	}
}

// order sorts a level: live first, then the newest launch, then by id.
func order(ns []*node) {
	slices.SortFunc(ns, func(a, b *node) int {
		if a.live != b.live {
			if a.live {
				return -1
			}
			return 1
		}
		if c := b.t.LaunchedAt.Compare(a.t.LaunchedAt); c != 0 {
			return c
		}
		return strings.Compare(a.t.ID, b.t.ID)
	})
}

// filter is what the page was asked to show.
type filter struct {
	Statuses []bgtask.Status
	Parent   string // a task id or a session id: what it launched
	Q        string // matched against id (and prefix), description, metadata
	Page     int
}

func (f filter) active() bool { return len(f.Statuses) > 0 || f.Q != "" }

// query is the URL query that asks for f (at page p).
func (f filter) query(p int) string {
	v := url.Values{}
	for _, s := range f.Statuses {
		v.Add("status", string(s))
	}
	if f.Parent != "" {
		v.Set("parent", f.Parent)
	}
	if f.Q != "" {
		v.Set("q", f.Q)
	}
	if p > 0 {
		v.Set("page", strconv.Itoa(p))
	}
	if len(v) == 0 {
		return "/"
	}
	return "/?" + v.Encode()
}

// readFilter reads the page's query; an unknown status is an error.
func readFilter(r *http.Request) (filter, error) {
	v := r.URL.Query()
	f := filter{Parent: strings.TrimSpace(v.Get("parent")), Q: strings.TrimSpace(v.Get("q"))}
	for _, s := range v["status"] {
		if s == "" {
			continue
		}
		st, err := statusarg.Parse(s)
		if err != nil {
			return f, fmt.Errorf("%w: %v", bgtask.ErrInvalidArgument, err)
		}
		if !slices.Contains(f.Statuses, st) {
			f.Statuses = append(f.Statuses, st)
		}
	}
	if p := v.Get("page"); p != "" {
		n, err := strconv.Atoi(p)
		if err != nil || n < 0 || n > maxPageNumber {
			return f, fmt.Errorf("%w: page %q", bgtask.ErrInvalidArgument, p)
		}
		f.Page = n
	}
	return f, nil
}

// matches says whether t is one the filter asks for.
func (f filter) matches(t *bgtask.Task) bool {
	if len(f.Statuses) > 0 && !slices.Contains(f.Statuses, t.Status) {
		return false
	}
	if f.Q == "" {
		return true
	}
	q := strings.ToLower(f.Q)
	if strings.HasPrefix(strings.ToLower(t.ID), q) || strings.Contains(strings.ToLower(t.Description), q) ||
		strings.Contains(strings.ToLower(t.Agent), q) {
		return true
	}
	for k, val := range t.Metadata {
		if strings.Contains(strings.ToLower(k), q) || strings.Contains(strings.ToLower(val), q) ||
			strings.ToLower(k+"="+val) == q {
			return true
		}
	}
	return false
}

// row is a task as the page shows it.
type row struct {
	T        *bgtask.Task
	Depth    int
	Path     []*bgtask.Task // its ancestors, root first (in a flat list)
	Kids     []row
	More     int // children not shown
	Closed   int // tasks below it, collapsed (loaded when opened)
	LiveKids bool
	Live     bool
	Stop     string
	Now      time.Time
	Acts     bool        // the page offers actions (not ReadOnly)
	Extend   bool        // … and extend is one (Source.Extendable)
	From     bool        // no task launched it: name the session that did
	Usage    *usageView  // what its attempts used; nil if none reported any
	Tree     *treeView   // what its tree used, on a top row with tasks below it; nil otherwise
	Budget   *budgetView // the budget it spends from; nil if none
}

// pageData is what the page template renders.
type pageData struct {
	Title  string
	Now    time.Time // when the page was rendered: what its relative times count from
	Epoch  uint64
	Seq    uint64
	Total  int
	Counts []statusCount
	Filter filter
	Rows   []row
	Shown  string // "roots 1–30 of 812"
	Prev   string
	Next   string
	Parent *bgtask.Task // the task whose children are shown
	// ParentSessions are its sessions, space-separated: what its children
	// name as their parent (the script reads them).
	ParentSessions string
	Session        string // the session whose children are shown
	ReadOnly       bool
	Error          string
	Detail         *detailData
	Health         []healthRow // model and provider health, on the first page of all tasks
	// Processes are a Fleet's, on the first page of all tasks;
	// ProcessErr says why they could not be read.
	Processes  []Process
	ProcessErr string
	Mode       string          // the page's view: "" (the tree), "table" or "charts"
	Table      *tableData      // the table page's
	Charts     []template.HTML // the chart page's (SVG, drawn on the server)
}

// healthRow is one line of the page's model health.
type healthRow struct {
	bgtask.Health
	Key  string
	Left string // how long its cooldown still lasts ("" when over)
	Acts bool   // the page offers a reset
}

// healthRows are m's model and provider health for the page: those that
// cool or wait for their probe first, at most healthShown.
func healthRows(m Source, now time.Time, acts bool) []healthRow {
	var rows []healthRow
	for _, h := range m.Health() {
		r := healthRow{Health: h, Key: h.Key(), Acts: acts && h.State != bgtask.HealthHealthy}
		if h.State == bgtask.HealthCooling && h.Until.After(now) {
			r.Left = h.Until.Sub(now).Round(time.Second).String()
		}
		rows = append(rows, r)
	}
	slices.SortStableFunc(rows, func(a, b healthRow) int {
		return cmp.Compare(healthRank(a.State), healthRank(b.State))
	})
	return rows[:min(len(rows), healthShown)]
}

// processes are the Fleet's processes, gone ones first, if v serves a
// Fleet, or why they could not be read.
func (v *view) processes(ctx context.Context) ([]Process, string) {
	f, ok := v.m.(Fleet)
	if !ok {
		return nil, ""
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	ps, err := f.Processes(ctx)
	if err != nil {
		return nil, err.Error()
	}
	slices.SortStableFunc(ps, func(a, b Process) int { return cmp.Compare(processRank(a), processRank(b)) })
	return ps, ""
}

// processRank orders processes: gone, live, idle.
func processRank(p Process) int {
	switch {
	case !p.Live && !p.Idle:
		return 0
	case p.Live:
		return 1
	}
	return 2
}

// healthShown bounds the health rows on the page (GET /health has all).
const healthShown = 50

func healthRank(s bgtask.HealthState) int {
	switch s {
	case bgtask.HealthCooling:
		return 0
	case bgtask.HealthProbing:
		return 1
	}
	return 2
}

type statusCount struct {
	Status bgtask.Status
	N      int
}

func (v *view) header(f *forest, title string) pageData {
	d := pageData{Title: title, Now: time.Now(), Epoch: f.snap.Epoch, Seq: f.snap.Seq, Total: len(f.snap.Tasks), ReadOnly: v.o.ReadOnly}
	for _, s := range allStatuses {
		d.Counts = append(d.Counts, statusCount{s, f.counts[s]})
	}
	return d
}

// paint is how rows are rendered on one page.
type paint struct {
	now  time.Time
	acts bool
	src  Source // whether it offers extend (Extendable)
	kids int    // children shown under a row (0: kidsShown)
}

// flat renders n alone, its children collapsed, as a top row.
func (p paint) flat(n *node) row {
	r := row{T: n.t, Live: !n.t.Status.Terminal(), LiveKids: n.live, Now: p.now, Acts: p.acts, Closed: n.size, From: n.up == nil}
	if n.t.Stop != nil {
		r.Stop = n.t.Stop.String()
	}
	r.Extend = p.acts && p.src.Extendable(n.t.ID)
	r.Usage, r.Budget = usageOf(n.t), budgetOf(n.t)
	r.Tree = treeOf(n)
	return r
}

// rowOf renders n, its children to openLevels, and the rest collapsed.
func (p paint) rowOf(n *node, depth int) row {
	r := p.flat(n)
	r.Depth, r.Closed = depth, 0
	if depth > 0 { // the tree's usage is its top row's
		r.Tree = nil
	}
	if depth+1 >= openLevels {
		r.Closed = n.size
		return r
	}
	shown := p.kids
	if shown <= 0 {
		shown = kidsShown
	}
	for i, k := range n.kids {
		if i == shown {
			r.More = len(n.kids) - i
			break
		}
		r.Kids = append(r.Kids, p.rowOf(k, depth+1))
	}
	return r
}

func (v *view) page(w http.ResponseWriter, r *http.Request) {
	f, err := readFilter(r)
	if err != nil {
		v.fail(w, http.StatusBadRequest, err)
		return
	}
	tree := grow(v.m.Snapshot())
	d := v.header(tree, "bgtask")
	d.Filter = f
	pt := paint{now: d.Now, acts: !v.o.ReadOnly, src: v.m}
	var list []*node
	switch {
	case f.Parent != "":
		if n := tree.byID[f.Parent]; n != nil {
			d.Parent, list = n.t, n.kids
			d.ParentSessions = sessionsOf(n.t)
		} else {
			d.Session = f.Parent
			for _, n := range tree.byID {
				if n.t.ParentSessionID == f.Parent {
					list = append(list, n)
				}
			}
			order(list)
		}
	default:
		list = tree.roots
	}
	per := rootsPerPage
	if f.active() { // a flat list of what matches, each with its path
		per = matchesShown
		from := list
		if f.Parent == "" {
			from = tree.roots
		}
		list = matching(from, f)
	}
	from := min(f.Page*per, len(list))
	to := min(from+per, len(list))
	if f.Page > 0 && from == len(list) {
		v.fail(w, http.StatusNotFound, fmt.Errorf("%w: there is no page %d (%d on it)", bgtask.ErrInvalidArgument, f.Page, len(list)))
		return
	}
	if n := to - from; n > 0 { // the page's rows stay within rowsPerPage
		pt.kids = max(1, min(kidsShown, (rowsPerPage-n)/n))
	}
	for _, n := range list[from:to] {
		var rw row
		if f.active() {
			rw = pt.flat(n)
			rw.Path = path(n)
		} else {
			rw = pt.rowOf(n, 0)
		}
		d.Rows = append(d.Rows, rw)
	}
	what := "roots"
	if f.active() {
		what = "matches"
	} else if f.Parent != "" {
		what = "children"
	}
	if len(list) == 0 {
		d.Shown = "no " + what
	} else {
		d.Shown = fmt.Sprintf("%s %d–%d of %d", what, from+1, to, len(list))
	}
	if f.Page > 0 {
		d.Prev = f.query(f.Page - 1)
	}
	if to < len(list) {
		d.Next = f.query(f.Page + 1)
	}
	if !f.active() && f.Parent == "" && f.Page == 0 {
		d.Health = healthRows(v.m, pt.now, pt.acts)
		d.Processes, d.ProcessErr = v.processes(r.Context())
	}
	v.render(w, http.StatusOK, "page", d)
}

// matching are the tasks at and below ns that f matches, in the tree's
// order (a walk with a stack: a tree may be deep).
func matching(ns []*node, f filter) []*node {
	var hits []*node
	stack := slices.Clone(ns)
	slices.Reverse(stack)
	for len(stack) > 0 {
		n := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		if f.matches(n.t) {
			hits = append(hits, n)
		}
		for i := len(n.kids) - 1; i >= 0; i-- {
			stack = append(stack, n.kids[i])
		}
	}
	return hits
}

// children serves the rows below a collapsed task, as a fragment.
func (v *view) children(w http.ResponseWriter, r *http.Request) {
	tree := grow(v.m.Snapshot())
	n := tree.byID[r.URL.Query().Get("id")]
	if n == nil {
		v.fail(w, http.StatusNotFound, fmt.Errorf("%w: %q", bgtask.ErrUnknownTask, r.URL.Query().Get("id")))
		return
	}
	d := v.header(tree, "")
	pt := paint{now: d.Now, acts: !v.o.ReadOnly, src: v.m}
	for i, k := range n.kids {
		if i == kidsShown {
			d.Shown = fmt.Sprintf("%d more", len(n.kids)-i)
			d.Next = filter{Parent: n.t.ID}.query(0)
			break
		}
		d.Rows = append(d.Rows, pt.rowOf(k, openLevels-1)) // collapsed below: opened one level at a time
	}
	v.render(w, http.StatusOK, "kids", d)
}

// detailData is a task's detail page.
type detailData struct {
	Row       row
	Sessions  string // the task's sessions, space-separated: what its children name
	Kids      []row
	More      int
	Path      []*bgtask.Task
	Prompt    string
	Timeline  string
	Envelope  string
	Outcome   string
	Records   []recordRow
	RecordErr string
	Closures  []bgtask.ClosureReport
}

// recordRow is a ledger record on the detail page.
type recordRow struct {
	bgtask.RecordView
	Mark string // "restart", "compaction", "closure" or ""
}

func (v *view) detail(w http.ResponseWriter, r *http.Request) {
	id := r.URL.Query().Get("id")
	tree := grow(v.m.Snapshot())
	n := tree.byID[id]
	if n == nil {
		v.gone(w, r, tree, id)
		return
	}
	t := n.t
	d := v.header(tree, "bgtask · "+t.ID)
	pt := paint{now: d.Now, acts: !v.o.ReadOnly, src: v.m}
	dd := &detailData{Row: pt.rowOf(n, 0), Prompt: bound(t.Prompt, detailPrompt), Timeline: bgtask.Timeline(*t)}
	dd.Kids, dd.More = dd.Row.Kids, dd.Row.More
	dd.Row.Kids, dd.Row.More, dd.Row.Closed = nil, 0, 0
	dd.Path = path(n)
	if t.Status.Terminal() {
		dd.Envelope = bgtask.Envelope(*t)
	}
	if t.Outcome != nil {
		dd.Outcome = readableJSON(t.Outcome)
	}
	dd.Sessions = sessionsOf(t)
	sessions := map[string]bool{}
	for _, a := range t.Attempts {
		sessions[a.SessionID] = a.SessionID != ""
	}
	for _, c := range tree.snap.Closures {
		if c.TaskID == t.ID || sessions[c.SessionID] || c.SessionID == t.ParentSessionID || touches(c, t.ID) {
			dd.Closures = append(dd.Closures, c)
		}
	}
	v.records(r.Context(), dd, t.ID)
	d.Detail = dd
	v.render(w, http.StatusOK, "detail", d)
}

// sessionsOf is t's sessions, space-separated, each once, in order.
func sessionsOf(t *bgtask.Task) string {
	var out []string
	for _, a := range t.Attempts {
		if a.SessionID != "" && !slices.Contains(out, a.SessionID) {
			out = append(out, a.SessionID)
		}
	}
	return strings.Join(out, " ")
}

// records fills dd's history of task id (Manager.History: its journal's
// records, or what the Manager holds, with its lines of progress).
func (v *view) records(ctx context.Context, dd *detailData, id string) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	recs, err := v.m.History(ctx, id)
	if err != nil {
		dd.RecordErr = strings.TrimPrefix(err.Error(), "bgtask: ")
	}
	for _, rec := range recs {
		dd.Records = append(dd.Records, recordRow{RecordView: rec, Mark: markOf(rec)})
	}
}

// gone answers the detail page of a task the snapshot lacks: unknown, or
// forgotten (retention) — whose records the journal may still hold.
func (v *view) gone(w http.ResponseWriter, r *http.Request, tree *forest, id string) {
	_, err := v.m.Task(id)
	if err == nil { // launched since the snapshot: the next load shows it
		err = fmt.Errorf("%w: %s", bgtask.ErrUnknownTask, id)
	}
	d := v.header(tree, "bgtask · "+id)
	d.Error = strings.TrimPrefix(err.Error(), "bgtask: ")
	if errors.Is(err, bgtask.ErrForgotten) {
		dd := &detailData{}
		v.records(r.Context(), dd, id)
		d.Detail = dd
	}
	v.render(w, http.StatusNotFound, "page", d)
}

// path is n's ancestors, root first.
func path(n *node) []*bgtask.Task {
	var p []*bgtask.Task
	for up := n.up; up != nil; up = up.up {
		p = append(p, up.t)
	}
	slices.Reverse(p)
	return p
}

// touches says whether closure c stopped a run of task id.
func touches(c bgtask.ClosureReport, id string) bool {
	for _, s := range c.Stopped {
		if s.TaskID == id {
			return true
		}
	}
	for _, s := range c.Stopping {
		if s.TaskID == id {
			return true
		}
	}
	for _, s := range c.Failed {
		if s.TaskID == id {
			return true
		}
	}
	return false
}

// markOf marks the records an operator looks for: a restart (an epoch
// that began a process life; one a compaction wrote is marked so) and a
// closure's records.
func markOf(rec bgtask.RecordView) string {
	switch rec.Kind {
	case "epoch":
		if strings.Contains(rec.Change, "compacted") {
			return "compaction"
		}
		return "restart"
	case "closure_opened", "branch_closed", "closure_dropped":
		return "closure"
	}
	return ""
}

// fail renders an error page with status.
func (v *view) fail(w http.ResponseWriter, status int, err error) {
	d := pageData{Title: "bgtask", Now: time.Now(), Error: strings.TrimPrefix(err.Error(), "bgtask: "), ReadOnly: v.o.ReadOnly}
	v.render(w, status, "page", d)
}

// render writes template name with d, under the page's headers.
func (v *view) render(w http.ResponseWriter, status int, name string, d pageData) {
	var b strings.Builder
	if err := viewTemplates.ExecuteTemplate(&b, name, d); err != nil {
		http.Error(w, "bgtaskhttp: the view failed to render: "+err.Error(), http.StatusInternalServerError)
		return
	}
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	h.Set("Content-Security-Policy", viewCSP)
	w.WriteHeader(status)
	_, _ = w.Write([]byte(b.String()))
}

// readableJSON is v as indented JSON for a person to read: "<" stays
// "<" (not \u003c), for the page's template escapes it as HTML.
func readableJSON(v any) string {
	var b strings.Builder
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return "(" + err.Error() + ")"
	}
	return strings.TrimSuffix(b.String(), "\n")
}

// when is a time as the page shows it: absolute, the same wherever it is
// read (UTC, to the second), machine-readable (a <time datetime>), and
// relative to the page's render (a script moves it on): "3 min ago", and
// for how long since, "3 min".
type when struct {
	At  string // RFC 3339, UTC, to the millisecond (HTML's datetime); "" for none
	Abs string // "2026-12-07 10:00:05 UTC"
	Ago string // "3 min ago", "just now", "in 40 s"
	For string // the span since it, "3 min" ("0 s" for a time to come)
}

// at is t without a relative part; zero for none.
func at(t time.Time) when {
	if t.IsZero() {
		return when{}
	}
	u := t.UTC()
	return when{At: u.Format("2006-01-02T15:04:05.000Z"), Abs: u.Format("2006-01-02 15:04:05") + " UTC"}
}

// whenOf is t, relative to now too.
func whenOf(t, now time.Time) when {
	w := at(t)
	if w.At == "" {
		return w
	}
	d := now.Sub(t)
	switch {
	case d <= -time.Second:
		w.Ago = "in " + span(-d)
	case d < time.Second:
		w.Ago = "just now"
	default:
		w.Ago = span(d) + " ago"
	}
	w.For = span(max(d, 0))
	return w
}

// span is d to the unit that reads at a glance, cut, not rounded: "45 s",
// "3 min", "2 h 5 min", "3 d 4 h". view.js says it the same way.
func span(d time.Duration) string {
	unit := func(n time.Duration, name string) string { return strconv.FormatInt(int64(n), 10) + " " + name }
	two := func(a time.Duration, an string, b time.Duration, bn string) string {
		if b == 0 {
			return unit(a, an)
		}
		return unit(a, an) + " " + unit(b, bn)
	}
	switch {
	case d < time.Minute:
		return unit(d/time.Second, "s")
	case d < time.Hour:
		return unit(d/time.Minute, "min")
	case d < 24*time.Hour:
		return two(d/time.Hour, "h", d%time.Hour/time.Minute, "min")
	}
	return two(d/(24*time.Hour), "d", d%(24*time.Hour)/time.Hour, "h")
}

// since is the time from a to b (b zero: to now), rounded for reading.
func since(a, b, now time.Time) string {
	if a.IsZero() {
		return ""
	}
	if b.IsZero() {
		b = now
	}
	d := b.Sub(a)
	switch {
	case d < 0:
		return ""
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Hour:
		return d.Round(time.Second).String()
	}
	return d.Round(time.Minute).String()
}

// bound cuts s to at most n bytes (on a rune boundary), saying how much
// was cut.
func bound(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := n
	for cut > 0 && cut < len(s) && s[cut]&0xC0 == 0x80 {
		cut--
	}
	return s[:cut] + fmt.Sprintf("… (%d more bytes)", len(s)-cut)
}
