package otelmetrics_test

import (
	"testing"

	"github.com/bgtask/bgtask/internal/readmecheck"
)

// TestREADMECodeBlocks compiles every ```go block of otelmetrics/README.md,
// and those of README.md that need otelmetrics, and fails on an error a
// block leaves unchecked (see internal/readmecheck).
func TestREADMECodeBlocks(t *testing.T) {
	readmecheck.Check(t, readmecheck.Config{
		Module:   readmecheck.RootModule + "/otelmetrics",
		RepoRoot: "..",
		READMEs:  []string{"otelmetrics/README.md", "README.md"},
	})
}
