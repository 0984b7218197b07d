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

// Middle bounds s to about max runes by keeping its beginning and its end
// and replacing the middle with a marker that says how many runes were
// dropped; it returns the text and that count (0 when s fits). max < 1 means
// no limit.
func Middle(s string, max int) (string, int) {
	n := utf8.RuneCountInString(s)
	if max < 1 || n <= max {
		return s, 0
	}
	head := max * 2 / 3
	tail := max - head
	runes := []rune(s)
	dropped := n - head - tail
	return string(runes[:head]) + "\n[… " + itoa(dropped) + " characters dropped …]\n" + string(runes[n-tail:]), dropped
}

func itoa(n int) string {
	if n == 0 {
		return "0"
	}
	var b [20]byte
	i := len(b)
	for n > 0 {
		i--
		b[i] = byte('0' + n%10)
		n /= 10
	}
	return string(b[i:])
}
