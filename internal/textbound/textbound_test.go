package textbound

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/assert"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestOneLine(t *testing.T) {
	tests := []struct {
		name string
		give string
		max  int
		want string
	}{
		{name: "empty", give: "", max: 10, want: ""},
		{name: "plain kept", give: "Too Many Requests", max: 40, want: "Too Many Requests"},
		{name: "newlines folded", give: "line one\n\n  line two\t", max: 0, want: "line one line two"},
		{name: "leading space trimmed", give: "  x", max: 5, want: "x"},
		{name: "exactly max", give: "abcde", max: 5, want: "abcde"},
		{name: "one over max", give: "abcdef", max: 5, want: "abcd…"},
		{name: "cut before space trims it", give: "abc defgh", max: 5, want: "abc…"},
		{name: "runes not bytes", give: "ééééé", max: 5, want: "ééééé"},
		{name: "runes cut", give: "éééééé", max: 3, want: "éé…"},
		{name: "no limit", give: strings.Repeat("a", 500), max: 0, want: strings.Repeat("a", 500)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, OneLine(tt.give, tt.max))
		})
	}
}

func FuzzOneLine(f *testing.F) {
	f.Add("hello\nworld", 5)
	f.Add("  a  b  ", 3)
	f.Fuzz(func(t *testing.T, s string, max int) {
		if max > 1000 || max < -1 {
			return
		}
		got := OneLine(s, max)
		if strings.ContainsAny(got, "\n\r\t") {
			t.Fatalf("OneLine(%q) = %q has a line break or tab", s, got)
		}
		if max >= 1 && utf8.RuneCountInString(got) > max {
			t.Fatalf("OneLine(%q, %d) = %q is longer than max", s, max, got)
		}
		if utf8.ValidString(s) && got != OneLine(got, max) {
			t.Fatalf("OneLine is not idempotent on %q", s)
		}
	})
}
