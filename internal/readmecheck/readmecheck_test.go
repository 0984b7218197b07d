package readmecheck_test

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/bgtask/bgtask/internal/readmecheck"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestProblemsFindsUncheckedErrors runs the checker on a README of its
// own: every problem it must find (the errors left unchecked, and a name,
// bgtask.New, that no longer exists), and nothing in the blocks that are
// right.
func TestProblemsFindsUncheckedErrors(t *testing.T) {
	dir := t.TempDir()
	fence := "```"
	readme := strings.Join([]string{
		"# The checker's own test", // 1
		"",
		fence + "go",
		"m.Observe(bgtask.Event{})",
		"m2 := bgtask.New(nil)", // 5
		"_ = m.Shutdown(ctx)",
		"defer m.Shutdown(ctx)",
		"go m.Shutdown(ctx)",
		`a, err := bgtask.ParseModel("openai/x")`,
		`b, err := bgtask.ParseModel("openai/y")`, // 10
		fence,
		"",
		fence + "go",
		"err := m.Observe(ev)",
		fence, // 15
		"",
		"<!-- not compiled: not Go at all -->",
		fence + "go",
		"this is not Go",
		fence, // 20
		"",
		fence + "go",
		"var b strings.Builder",
		`fmt.Fprintf(&b, "%d", 1)`,
		`b.WriteString("x")`, // 25
		"fmt.Println(b.String())",
		`fmt.Fprintln(os.Stderr, "x")`,
		"if err := m.Shutdown(ctx); err != nil {",
		"	return err",
		"}", // 30
		fence,
		"",
		fence + "go",
		"package main",
		"", // 35
		`import "github.com/bgtask/bgtask"`,
		"",
		"func main() { bgtask.Open(nil, nil) }",
		fence,
		"", // 40
	}, "\n")
	if err := os.WriteFile(filepath.Join(dir, "README.md"), []byte(readme), 0o644); err != nil {
		t.Fatal(err)
	}
	problems, notes, err := readmecheck.Problems(readmecheck.Config{Module: readmecheck.RootModule, RepoRoot: dir, READMEs: []string{"README.md"}})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"README.md:4: m.Observe(bgtask.Event{}) drops the error it returns (the block at line 3)",
		"README.md:5: undefined: bgtask.New (the block at line 3)",
		"README.md:6: an error is assigned to _ (the block at line 3)",
		"README.md:7: defer m.Shutdown(ctx) drops the error it returns (the block at line 3)",
		"README.md:8: go m.Shutdown(ctx) drops the error it returns (the block at line 3)",
		"README.md:10: the error assigned to err at line 9 is overwritten before it is checked (the block at line 3)",
		"README.md:10: the error assigned to err is never checked (the block at line 3)",
		"README.md:14: the error assigned to err is never checked (the block at line 13)",
		"README.md:38: bgtask.Open(nil, nil) drops the error it returns (the block at line 33)",
	}
	if strings.Join(problems, "\n") != strings.Join(want, "\n") {
		t.Errorf("problems:\n%s\nwant:\n%s", strings.Join(problems, "\n"), strings.Join(want, "\n"))
	}
	if !slices.Contains(notes, "README.md:18: not compiled: not Go at all") {
		t.Errorf("notes: %q", notes)
	}
}
