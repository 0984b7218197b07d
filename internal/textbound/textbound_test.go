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

func TestMiddle(t *testing.T) {
	tests := []struct {
		name        string
		give        string
		max         int
		wantDropped int
	}{
		{name: "fits", give: "short", max: 10, wantDropped: 0},
		{name: "exactly max", give: strings.Repeat("a", 30), max: 30, wantDropped: 0},
		{name: "one over", give: strings.Repeat("a", 31), max: 30, wantDropped: 1},
		{name: "long", give: strings.Repeat("x", 1000), max: 90, wantDropped: 910},
		{name: "runes", give: strings.Repeat("é", 50), max: 30, wantDropped: 20},
		{name: "no limit", give: strings.Repeat("a", 100), max: 0, wantDropped: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, dropped := Middle(tt.give, tt.max)
			assert.Equal(t, tt.wantDropped, dropped)
			if dropped == 0 {
				assert.Equal(t, tt.give, got)
				return
			}
			head := tt.max * 2 / 3
			runes := []rune(tt.give)
			assert.True(t, strings.HasPrefix(got, string(runes[:head])), "keeps the beginning")
			assert.True(t, strings.HasSuffix(got, string(runes[len(runes)-(tt.max-head):])), "keeps the end")
			assert.Contains(t, got, "[… "+itoa(dropped)+" characters dropped …]")
		})
	}
}

func TestMiddleKeepsBothEnds(t *testing.T) {
	s := "BEGIN" + strings.Repeat(".", 500) + "END"
	got, dropped := Middle(s, 60)
	assert.True(t, strings.HasPrefix(got, "BEGIN"))
	assert.True(t, strings.HasSuffix(got, "END"))
	assert.Equal(t, len(s)-60, dropped)
}
