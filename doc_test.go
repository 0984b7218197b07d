package bgtask

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"strings"
	"testing"
)

// Every exported field of an exported type is documented: by its own
// comment, or by the comment of a field before it that names it.
func TestEveryExportedFieldIsDocumented(t *testing.T) {
	fset := token.NewFileSet()
	pkgs, err := parser.ParseDir(fset, ".", func(fi os.FileInfo) bool { return !strings.HasSuffix(fi.Name(), "_test.go") }, parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range pkgs["bgtask"].Files {
		ast.Inspect(f, func(n ast.Node) bool {
			ts, ok := n.(*ast.TypeSpec)
			if !ok || !ts.Name.IsExported() {
				return true
			}
			st, ok := ts.Type.(*ast.StructType)
			if !ok {
				return true
			}
			group := "" // the comment in force: a field's own, or the last one before it
			for _, fld := range st.Fields.List {
				switch {
				case fld.Doc != nil:
					group = fld.Doc.Text()
				case fld.Comment != nil:
					group = fld.Comment.Text()
				}
				for _, nm := range fld.Names {
					if !nm.IsExported() || fld.Doc != nil || fld.Comment != nil {
						continue
					}
					if !strings.Contains(group, nm.Name) {
						t.Errorf("%s: %s.%s has no comment", fset.Position(fld.Pos()), ts.Name.Name, nm.Name)
					}
				}
			}
			return true
		})
	}
}

// The README's Layout names every source file of the root package, and
// only files that exist.
func TestTheREADMELayoutNamesEveryFile(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, layout, ok := strings.Cut(string(readme), "\n## Layout\n")
	if !ok {
		t.Fatal("the README has no Layout section")
	}
	layout, _, _ = strings.Cut(layout, "\n## ")
	files, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]bool{}
	for _, f := range files {
		name := f.Name()
		if strings.HasSuffix(name, ".go") && !strings.HasSuffix(name, "_test.go") {
			have[name] = true
			if !strings.Contains(layout, "`"+name+"`") {
				t.Errorf("the README's Layout does not name %s", name)
			}
		}
	}
	for _, field := range strings.Split(layout, "`") {
		if strings.HasSuffix(field, ".go") && !strings.Contains(field, "/") && !strings.HasSuffix(field, "_test.go") && !have[field] {
			t.Errorf("the README's Layout names %s, which is not a file of the root package", field)
		}
	}
	if len(have) < 10 {
		t.Fatalf("found %d source files: not the root package's directory", len(have))
	}
}
