package bgtask_test

import (
	"testing"

	"github.com/bgtask/bgtask/internal/readmecheck"
)

// TestREADMECodeBlocks compiles every ```go block of README.md and fails on
// an error a block leaves unchecked (see internal/readmecheck). A block
// that needs pgledger or otelmetrics is checked by that module's
// readme_test.go.
func TestREADMECodeBlocks(t *testing.T) {
	readmecheck.Check(t, readmecheck.Config{
		Module:   readmecheck.RootModule,
		RepoRoot: ".",
		READMEs:  []string{"README.md"},
	})
}
