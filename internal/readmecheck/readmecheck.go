// Package readmecheck compiles the ```go blocks of the repository's
// READMEs and fails on an error a block leaves unchecked. The readme_test.go
// of the root module, of pgledger and of otelmetrics each call Check with
// their Config; only test files import this package.
//
// How a README's Go is checked:
//
//   - Every ```go fenced block is checked, unless the line right before its
//     fence is <!-- not compiled: reason -->.
//   - A block that starts with `package` is a file of its own, compiled as
//     written (its imports included).
//   - Any other block is a snippet. It becomes the body of
//     `func _() error { … ; return nil }` (so it may `return err`) or, if it
//     does not parse as statements, the package's top-level declarations.
//     Either way basePrelude (and Config.Prelude) comes first:
//     package-level variables for the names the prose introduces (m, ctx,
//     host, sid, …), which a snippet may use or shadow. The snippet's
//     imports are added from importTable, by the package names it uses.
//     A snippet's variable that is declared and not used is no compile
//     error (it shows a result's name), unless it holds an error.
//   - Each block is type-checked (go/types, against export data that
//     `go list -export` builds in the module) as its own package, and every
//     error is reported at its README line (a //line directive maps it).
//   - Errors must be checked: a call statement (plain, `defer` or `go`) that
//     drops an error result, an error assigned to `_`, an error variable
//     never read, and an error a call assigns to a variable that the next
//     mention of the variable overwrites — or that nothing reads before the
//     block of its declaration ends — all fail. ignorable lists the
//     calls whose error a README may drop.
//   - A block that imports pgledger (or pgx) is compiled in the pgledger
//     module, one that imports otelmetrics (or OpenTelemetry) in the
//     otelmetrics module, any other in its README's module; so each module's
//     test reads the root README too, and checks the blocks that are its.
package readmecheck

import (
	"bytes"
	"encoding/json"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
)

// RootModule is the root module's path.
const RootModule = "github.com/bgtask/bgtask"

// Config says what one module's test checks.
type Config struct {
	Module   string   // the module's path
	RepoRoot string   // the repository's root, from the test's directory
	READMEs  []string // the READMEs to read, from the repository's root
	Prelude  string   // declarations beyond basePrelude, of the module's own packages
}

// otherModules lists, for each module other than the root, the import
// path prefixes only it resolves. The root's packages and the standard
// library resolve in every module (pgledger and otelmetrics require the root).
var otherModules = map[string][]string{
	RootModule + "/pgledger":    {RootModule + "/pgledger", "github.com/jackc/pgx/"},
	RootModule + "/otelmetrics": {RootModule + "/otelmetrics", "go.opentelemetry.io/"},
}

// importTable maps the package names snippets use to their import paths
// (goimports' job, done by a fixed table). A name missing here is an
// "undefined" error naming it: add it.
var importTable = map[string]string{
	"bgtask":      RootModule,
	"bgtaskhttp":  RootModule + "/bgtaskhttp",
	"bgtasktest":  RootModule + "/bgtasktest",
	"mirror":      RootModule + "/mirror",
	"pgledger":    RootModule + "/pgledger",
	"fleetview":   RootModule + "/pgledger/fleetview",
	"otelmetrics": RootModule + "/otelmetrics",
	"pgx":         "github.com/jackc/pgx/v5",
	"pgxpool":     "github.com/jackc/pgx/v5/pgxpool",
	"otel":        "go.opentelemetry.io/otel",
	"require":     "github.com/stretchr/testify/require",
	"context":     "context",
	"errors":      "errors",
	"fmt":         "fmt",
	"io":          "io",
	"log":         "log",
	"os":          "os",
	"strings":     "strings",
	"sync":        "sync",
	"testing":     "testing",
	"time":        "time",
	"json":        "encoding/json",
	"slog":        "log/slog",
	"http":        "net/http",
	"subtle":      "crypto/subtle",
	"signal":      "os/signal",
	"synctest":    "testing/synctest",
}

// basePrelude declares the names README prose introduces and snippets use
// without declaring them. They are package-level variables of the snippet's
// package: a snippet may use one, or declare its own of the same name.
const basePrelude = `
var (
	ctx      context.Context
	m        *bgtask.Manager
	host     bgtask.Host
	n        bgtask.Notifier // also notifier
	notifier bgtask.Notifier
	spec     bgtask.Spec
	chain    []bgtask.Model // a fallback chain
	ev       bgtask.Event
	err      error      // an error a child session reported
	t        *testing.T // in a test

	sid, id, parent, prompt, answer string // a session id, a task id, a parent session, …

	researcher, coder func(topic string) bgtask.RunFunc
	provider          interface {
		Complete(ctx context.Context, model, prompt string) (string, error)
	}
)
`

// ignorable reports whether a README may drop the error call returns.
// Only the calls Go code conventionally leaves unchecked:
//   - fmt.Print, Printf and Println, and fmt.Fprint, Fprintf and Fprintln to
//     os.Stdout or os.Stderr: a program has nowhere better to report that
//     its own output failed;
//   - the Write methods of *strings.Builder and *bytes.Buffer, and Fprint*
//     into one: documented never to return an error.
func ignorable(info *types.Info, call *ast.CallExpr) bool {
	var obj types.Object
	switch fun := ast.Unparen(call.Fun).(type) {
	case *ast.Ident:
		obj = info.Uses[fun]
	case *ast.SelectorExpr:
		obj = info.Uses[fun.Sel]
	}
	fn, ok := obj.(*types.Func)
	if !ok {
		return false
	}
	inMemory := func(t types.Type) bool {
		s := types.TypeString(t, nil)
		return s == "*strings.Builder" || s == "*bytes.Buffer"
	}
	switch fn.FullName() {
	case "fmt.Print", "fmt.Printf", "fmt.Println":
		return true
	case "fmt.Fprint", "fmt.Fprintf", "fmt.Fprintln":
		w := ast.Unparen(call.Args[0])
		if sel, ok := w.(*ast.SelectorExpr); ok {
			if v, ok := info.Uses[sel.Sel].(*types.Var); ok && v.Pkg() != nil && v.Pkg().Path() == "os" &&
				(v.Name() == "Stdout" || v.Name() == "Stderr") {
				return true
			}
		}
		return inMemory(info.TypeOf(w))
	}
	if recv := fn.Type().(*types.Signature).Recv(); recv != nil {
		return inMemory(recv.Type()) && strings.HasPrefix(fn.Name(), "Write")
	}
	return false
}

// block is one ```go block.
type block struct {
	file  string // its README, from the repository's root
	fence int    // the line of its opening fence
	code  string
	skip  string // why it is not compiled (<!-- not compiled: … -->)
}

func (b block) String() string { return fmt.Sprintf("%s:%d", b.file, b.fence) }

var (
	fenceRE = regexp.MustCompile("^([ \t]*)```go[ \t]*$")
	skipRE  = regexp.MustCompile(`^\s*<!--\s*not compiled:\s*(\S.*?)\s*-->\s*$`)
)

// parseBlocks returns the ```go blocks of a README's text.
func parseBlocks(file, text string) ([]block, error) {
	lines := strings.Split(text, "\n")
	var blocks []block
	for i := 0; i < len(lines); i++ {
		open := fenceRE.FindStringSubmatch(lines[i])
		if open == nil {
			continue
		}
		b := block{file: file, fence: i + 1}
		if i > 0 {
			if s := skipRE.FindStringSubmatch(lines[i-1]); s != nil {
				b.skip = s[1]
			}
		}
		var code []string
		for i++; ; i++ {
			if i == len(lines) {
				return nil, fmt.Errorf("%s: its fence is never closed", b)
			}
			if strings.TrimSpace(lines[i]) == "```" {
				break
			}
			code = append(code, strings.TrimPrefix(lines[i], open[1]))
		}
		b.code = strings.Join(code, "\n") + "\n"
		blocks = append(blocks, b)
	}
	return blocks, nil
}

// unit is a block made into a package's one file.
type unit struct {
	block   block
	snippet bool
	src     string   // the file, with a //line directive before the block
	imports []string // its import paths
	needs   []string // those of them the block uses (not only the prelude)
	owner   string   // the module that compiles it
	err     error    // it cannot be parsed, or no module can compile it
}

// wrap makes a block into a file (see the comment at the top).
func wrap(b block, prelude string) unit {
	u := unit{block: b}
	line := fmt.Sprintf("//line %s:%d\n", b.file, b.fence+1)
	if strings.HasPrefix(strings.TrimSpace(b.code), "package ") {
		u.src = line + b.code
		f, err := parser.ParseFile(token.NewFileSet(), "readme.go", u.src, parser.ImportsOnly)
		if err != nil {
			u.err = err
			return u
		}
		for _, spec := range f.Imports {
			u.imports = append(u.imports, strings.Trim(spec.Path.Value, `"`))
		}
		u.needs = u.imports
		return u
	}
	u.snippet = true
	const imports = "// imports\n"
	head := "package readme\n\n" + imports + prelude + "\n"
	body := head + "func _() error {\n" + line + b.code + "\treturn nil\n}\n"
	decls := head + line + b.code
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "readme.go", body, 0)
	u.src = body
	if err != nil {
		f2, err2 := parser.ParseFile(fset, "readme.go", decls, 0)
		if err2 != nil {
			u.err = err // as statements: what most snippets are
			if regexp.MustCompile(`^\s*(func|type|var|const) `).MatchString(b.code) {
				u.err = err2
			}
			return u
		}
		f, u.src = f2, decls
	}
	// A package name used and declared nowhere in the file is imported.
	// (A name in no import table is left undefined: the type checker says so.)
	seen := map[string]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		if sel, ok := n.(*ast.SelectorExpr); ok {
			if x, ok := sel.X.(*ast.Ident); ok && x.Obj == nil {
				path, ok := importTable[x.Name]
				if ok && !seen[path] {
					seen[path] = true
					u.imports = append(u.imports, path)
				}
				if ok && fset.Position(x.Pos()).Filename == b.file && !slices.Contains(u.needs, path) {
					u.needs = append(u.needs, path)
				}
			}
		}
		return true
	})
	sort.Strings(u.imports)
	var decl strings.Builder
	for _, path := range u.imports {
		fmt.Fprintf(&decl, "import %q\n", path)
	}
	u.src = strings.Replace(u.src, imports, decl.String(), 1)
	return u
}

// ownerOf returns the module that compiles a block of a README of
// module readmeMod which uses the packages imports.
func ownerOf(readmeMod string, imports []string) (string, error) {
	needs := map[string]bool{}
	for _, path := range imports {
		for mod, prefixes := range otherModules {
			for _, p := range prefixes {
				if strings.HasPrefix(path, p) {
					needs[mod] = true
				}
			}
		}
	}
	switch {
	case len(needs) == 0:
		return readmeMod, nil
	case len(needs) == 1:
		for mod := range needs {
			if readmeMod == RootModule || readmeMod == mod {
				return mod, nil
			}
		}
	}
	var mods []string
	for mod := range needs {
		mods = append(mods, mod)
	}
	sort.Strings(mods)
	return "", fmt.Errorf("it needs %s, and no one module of %s and %s resolves them all", strings.Join(mods, " and "), readmeMod, strings.Join(mods, ", "))
}

// Check checks the blocks of cfg's READMEs that cfg's module compiles:
// it logs the notes and reports each problem as an error of t.
func Check(t testing.TB, cfg Config) {
	t.Helper()
	problems, notes, err := Problems(cfg)
	for _, note := range notes {
		t.Log(note)
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, problem := range problems {
		t.Error(problem)
	}
}

// Problems returns what is wrong with the blocks of cfg's READMEs that
// cfg's module compiles, and notes on what it did. It runs the go command
// in the current directory, which must be in cfg's module.
func Problems(cfg Config) (problems, notes []string, err error) {
	prelude := basePrelude + cfg.Prelude
	var units []unit
	for _, file := range cfg.READMEs {
		text, err := os.ReadFile(filepath.Join(cfg.RepoRoot, file))
		if err != nil {
			return nil, notes, err
		}
		blocks, err := parseBlocks(file, string(text))
		if err != nil {
			return nil, notes, err
		}
		readmeMod := RootModule
		if dir := filepath.ToSlash(filepath.Dir(file)); dir != "." {
			readmeMod += "/" + dir
		}
		if readmeMod == cfg.Module && len(blocks) == 0 {
			problems = append(problems, file+": no ```go block found")
		}
		for _, b := range blocks {
			if b.skip != "" {
				notes = append(notes, fmt.Sprintf("%s: not compiled: %s", b, b.skip))
				continue
			}
			u := wrap(b, prelude)
			if u.err == nil {
				u.owner, u.err = ownerOf(readmeMod, u.needs)
			}
			switch {
			case u.err != nil && readmeMod == cfg.Module:
				problems = append(problems, fmt.Sprintf("%s: the block cannot be compiled: %v", b, u.err))
			case u.err == nil && u.owner == cfg.Module:
				units = append(units, u)
			case u.err == nil && readmeMod == cfg.Module:
				notes = append(notes, fmt.Sprintf("%s: compiled by %s's readme_test.go", b, u.owner))
			}
		}
	}
	if len(units) == 0 {
		return problems, notes, nil
	}

	// Export data for every package a block imports, built (and cached)
	// by the go command in this module.
	var paths []string
	for _, u := range units {
		for _, path := range u.imports {
			if !slices.Contains(paths, path) {
				paths = append(paths, path)
			}
		}
	}
	sort.Strings(paths)
	exports, err := exportData(paths)
	if err != nil {
		return nil, notes, err
	}
	fset := token.NewFileSet()
	imp := importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		file, ok := exports[path]
		if !ok {
			return nil, fmt.Errorf("no export data for %s: add its package name to importTable in internal/readmecheck", path)
		}
		return os.Open(file)
	})
	var compiled []string
	for _, u := range units {
		for _, problem := range checkUnit(fset, imp, u) {
			problems = append(problems, fmt.Sprintf("%s (the block at line %d)", problem, u.block.fence))
		}
		compiled = append(compiled, u.block.String())
	}
	notes = append(notes, fmt.Sprintf("compiled %d blocks: %s", len(compiled), strings.Join(compiled, ", ")))
	return problems, notes, nil
}

// exportData returns the export data files of paths and their
// dependencies, as the go command builds them in the current module.
func exportData(paths []string) (map[string]string, error) {
	cmd := exec.Command("go", append([]string{"list", "-e", "-export", "-deps", "-json=ImportPath,Export,Error"}, paths...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go list -export %s: %v\n%s", strings.Join(paths, " "), err, stderr.Bytes())
	}
	exports := map[string]string{}
	var errs []string
	for dec := json.NewDecoder(bytes.NewReader(out)); dec.More(); {
		var pkg struct {
			ImportPath, Export string
			Error              *struct{ Err string }
		}
		if err := dec.Decode(&pkg); err != nil {
			return nil, fmt.Errorf("go list -export: %v", err)
		}
		if pkg.Error != nil {
			errs = append(errs, pkg.ImportPath+": "+pkg.Error.Err)
		}
		exports[pkg.ImportPath] = pkg.Export
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("go list -export:\n%s", strings.Join(errs, "\n"))
	}
	return exports, nil
}

// checkUnit compiles a unit and returns what is wrong with it, each
// problem at its README line.
func checkUnit(fset *token.FileSet, imp types.Importer, u unit) []string {
	f, err := parser.ParseFile(fset, "readme.go", u.src, 0)
	if err != nil {
		return []string{err.Error()}
	}
	type problem struct {
		line int
		text string
	}
	var found []problem
	at := func(pos token.Pos, format string, args ...any) {
		p := fset.Position(pos)
		found = append(found, problem{p.Line, fmt.Sprintf("%s:%d: ", p.Filename, p.Line) + fmt.Sprintf(format, args...)})
	}
	info := &types.Info{
		Types: map[ast.Expr]types.TypeAndValue{},
		Defs:  map[*ast.Ident]types.Object{},
		Uses:  map[*ast.Ident]types.Object{},
	}
	var unused []types.Error
	conf := types.Config{
		Importer: imp,
		Error: func(err error) {
			te := err.(types.Error)
			if u.snippet && te.Soft && strings.Contains(te.Msg, "declared and not used") {
				unused = append(unused, te)
				return
			}
			at(te.Pos, "%s", te.Msg)
		},
	}
	conf.Check("readme", fset, []*ast.File{f}, info) // its errors went to conf.Error
	told := errcheck(fset, f, info, u.block.file, at)
	for _, te := range unused {
		for id, obj := range info.Defs {
			if id.Pos() == te.Pos && obj != nil && isError(obj.Type()) && !told[obj] {
				at(te.Pos, "the error assigned to %s is never checked", id.Name)
			}
		}
	}
	sort.SliceStable(found, func(i, j int) bool { return found[i].line < found[j].line })
	var problems []string
	for _, p := range found {
		problems = append(problems, p.text)
	}
	return problems
}

var errorType = types.Universe.Lookup("error").Type().Underlying().(*types.Interface)

func isError(t types.Type) bool {
	if t == nil {
		return false
	}
	if b, ok := t.(*types.Basic); ok && b.Kind() == types.UntypedNil {
		return false
	}
	return types.Implements(t, errorType)
}

// errcheck reports, by at, each error the README's part of f leaves
// unchecked. It returns the variables whose error it reported.
func errcheck(fset *token.FileSet, f *ast.File, info *types.Info, file string, at func(token.Pos, string, ...any)) map[types.Object]bool {
	told := map[types.Object]bool{}
	inREADME := func(n ast.Node) bool { return fset.Position(n.Pos()).Filename == file }
	// errorsOf returns, for each value of e, whether it is an error e
	// returns from a call (nil when e is no call).
	errorsOf := func(e ast.Expr) []bool {
		call, ok := ast.Unparen(e).(*ast.CallExpr)
		if !ok {
			return nil
		}
		if tv := info.Types[call.Fun]; tv.IsType() || tv.IsBuiltin() {
			return nil
		}
		var errs []bool
		switch t := info.TypeOf(call).(type) {
		case *types.Tuple:
			for i := 0; i < t.Len(); i++ {
				errs = append(errs, isError(t.At(i).Type()))
			}
		default:
			errs = append(errs, isError(t))
		}
		return errs
	}
	dropped := func(call *ast.CallExpr, how string) {
		for _, isErr := range errorsOf(call) {
			if isErr && !ignorable(info, call) {
				at(call.Pos(), "%s%s drops the error it returns", how, types.ExprString(call))
				return
			}
		}
	}
	// assigned returns, for each left-hand operand, whether it is given an
	// error a call returns.
	assigned := func(lhs int, rhs []ast.Expr) []bool {
		got := make([]bool, lhs)
		if len(rhs) == 1 && lhs > 1 {
			copy(got, errorsOf(rhs[0]))
			return got
		}
		for i, e := range rhs {
			if errs := errorsOf(e); len(errs) == 1 && i < lhs {
				got[i] = errs[0]
			} else if errs == nil && i < lhs {
				got[i] = isError(info.TypeOf(e)) // `_ = err` too
			}
		}
		return got
	}
	blank := func(e ast.Expr) bool { id, ok := e.(*ast.Ident); return ok && id.Name == "_" }

	// The reads of each variable: its uses, but for being assigned to.
	lhsOnly := map[*ast.Ident]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		if as, ok := n.(*ast.AssignStmt); ok && (as.Tok == token.ASSIGN || as.Tok == token.DEFINE) {
			for _, l := range as.Lhs {
				if id, ok := l.(*ast.Ident); ok {
					lhsOnly[id] = true
				}
			}
		}
		return true
	})
	reads := map[types.Object][]token.Pos{}
	readInClosure := map[types.Object]bool{}
	var walk func(n ast.Node, inLit bool)
	walk = func(n ast.Node, inLit bool) {
		ast.Inspect(n, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.FuncLit:
				if !inLit {
					walk(n.Body, true)
					return false
				}
			case *ast.Ident:
				if obj := info.Uses[n]; obj != nil && !lhsOnly[n] {
					reads[obj] = append(reads[obj], n.Pos())
					if inLit {
						readInClosure[obj] = true
					}
				}
			}
			return true
		})
	}
	walk(f, false)
	mentions := func(s ast.Stmt, obj types.Object) (read, written bool) {
		for _, p := range reads[obj] {
			if s.Pos() <= p && p < s.End() {
				read = true
			}
		}
		ast.Inspect(s, func(n ast.Node) bool {
			if id, ok := n.(*ast.Ident); ok && lhsOnly[id] && (info.Uses[id] == obj || info.Defs[id] == obj) {
				written = true
			}
			return true
		})
		return read, written
	}
	// flow follows an error a call assigns to a variable through the rest
	// of the statements it is in.
	flow := func(list []ast.Stmt) {
		for i, s := range list {
			as, ok := s.(*ast.AssignStmt)
			if !ok || !inREADME(as) || (as.Tok != token.ASSIGN && as.Tok != token.DEFINE) {
				continue
			}
			for j, isErr := range assigned(len(as.Lhs), as.Rhs) {
				id, ok := as.Lhs[j].(*ast.Ident)
				if !isErr || !ok || id.Name == "_" {
					continue
				}
				obj := info.Defs[id]
				if obj == nil {
					obj = info.Uses[id]
				}
				if _, ok := obj.(*types.Var); !ok {
					continue
				}
				checked := false
				for _, next := range list[i+1:] {
					read, written := mentions(next, obj)
					if read {
						checked = true
						break
					}
					if written {
						told[obj] = true
						at(next.Pos(), "the error assigned to %s at line %d is overwritten before it is checked", id.Name, fset.Position(id.Pos()).Line)
						checked = true
						break
					}
				}
				if checked || readInClosure[obj] || obj.Pos() < list[0].Pos() || obj.Pos() >= list[len(list)-1].End() {
					continue // read later in a loop or a closure, or it outlives the block
				}
				later := false
				for _, p := range reads[obj] {
					later = later || p > as.End()
				}
				if !later {
					told[obj] = true
					at(id.Pos(), "the error assigned to %s is never checked", id.Name)
				}
			}
		}
	}

	ast.Inspect(f, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.BlockStmt:
			flow(n.List) // the wrapper's body too: flow looks at the README's statements only
		case *ast.CaseClause:
			flow(n.Body)
		case *ast.CommClause:
			flow(n.Body)
		}
		if n == nil || !inREADME(n) {
			return true // the prelude and the wrapper are no part of the README
		}
		switch n := n.(type) {
		case *ast.ExprStmt:
			if call, ok := ast.Unparen(n.X).(*ast.CallExpr); ok {
				dropped(call, "")
			}
		case *ast.DeferStmt:
			dropped(n.Call, "defer ")
		case *ast.GoStmt:
			dropped(n.Call, "go ")
		case *ast.AssignStmt:
			for i, isErr := range assigned(len(n.Lhs), n.Rhs) {
				if isErr && blank(n.Lhs[i]) {
					at(n.Lhs[i].Pos(), "an error is assigned to _")
				}
			}
		case *ast.ValueSpec:
			for i, isErr := range assigned(len(n.Names), n.Values) {
				if isErr && blank(n.Names[i]) {
					at(n.Names[i].Pos(), "an error is assigned to _")
				}
			}
		}
		return true
	})
	return told
}
