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
