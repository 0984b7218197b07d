// Package textbound bounds text for places that must stay small and on one
// line: timeline error lines, notices and log fields.
package textbound

import (
	"strings"
	"unicode"
	"unicode/utf8"
)

// Ellipsis marks where OneLine cut text.
const Ellipsis = "…"

// OneLine folds every run of white space (newlines included) into one space,
// trims the ends, and cuts the result to at most max runes, the last of which
// is Ellipsis when anything was cut. max < 1 means no limit.
func OneLine(s string, max int) string {
	if isPlain(s, max) {
		return s
	}
	var b strings.Builder
	b.Grow(len(s))
	space := false
	for _, r := range s {
		if unicode.IsSpace(r) {
			space = b.Len() > 0
			continue
		}
		if space {
			b.WriteByte(' ')
			space = false
		}
		b.WriteRune(r)
	}
	out := b.String()
	if max < 1 || utf8.RuneCountInString(out) <= max {
		return out
	}
	n := 0
	for i := range out {
		if n == max-1 {
			return strings.TrimRightFunc(out[:i], unicode.IsSpace) + Ellipsis
		}
		n++
	}
	return out
}

// isPlain reports whether s is already one trimmed line within max runes.
func isPlain(s string, max int) bool {
	if s == "" {
		return true
	}
	if max >= 1 && utf8.RuneCountInString(s) > max {
		return false
	}
	prevSpace := true // a leading space is not plain
	for _, r := range s {
		sp := unicode.IsSpace(r)
		if sp && (r != ' ' || prevSpace) {
			return false
		}
		prevSpace = sp
	}
	return !prevSpace
}
