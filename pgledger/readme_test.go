package pgledger_test

import (
	"testing"

	"github.com/bgtask/bgtask/internal/readmecheck"
)

// TestREADMECodeBlocks compiles every ```go block of pgledger/README.md,
// and those of README.md that need pgledger, and fails on an error a block
// leaves unchecked (see internal/readmecheck).
func TestREADMECodeBlocks(t *testing.T) {
	readmecheck.Check(t, readmecheck.Config{
		Module:   readmecheck.RootModule + "/pgledger",
		RepoRoot: "..",
		READMEs:  []string{"pgledger/README.md", "README.md"},
		Prelude: `
var (
	pool *pgxpool.Pool
	node *pgledger.Node
)
`,
	})
}
