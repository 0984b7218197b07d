// Package markup escapes text for the <task> envelope: open fields (an
// attribute, an error, a notice) can hold no tag at all; a body (the answer,
// the evidence) stays verbatim except that it can never close a tag, and is
// recovered exactly by Unbody.
package markup

import (
	"strconv"
	"strings"
)

// Attr escapes s for a double-quoted attribute value on one line: markup
// characters and control characters (a newline included) become entities.
func Attr(s string) string {
	plain := true
	for i := range len(s) {
		if c := s[i]; c < 0x20 || c == 0x7f || c == '&' || c == '<' || c == '>' || c == '"' {
			plain = false
			break
		}
	}
	if plain {
		return s
	}
	var b strings.Builder
	for _, r := range s {
		switch {
		case r == '&':
			b.WriteString("&amp;")
		case r == '<':
			b.WriteString("&lt;")
		case r == '>':
			b.WriteString("&gt;")
		case r == '"':
			b.WriteString("&quot;")
		case r < 0x20 || r == 0x7f:
			b.WriteString("&#" + strconv.Itoa(int(r)) + ";")
		default:
			b.WriteRune(r)
		}
	}
	return b.String()
}

// Text escapes s for an open text field (an error message, a status): "&"
// and "<" become entities, so it can hold no tag at all.
func Text(s string) string {
	if !strings.ContainsAny(s, "&<") {
		return s
	}
	return strings.NewReplacer("&", "&amp;", "<", "&lt;").Replace(s)
}

// closer starts every closing tag of the envelope; tail is what follows
// "&" in its escaped form.
const (
	closer = "</task"
	tail   = "lt;/task"
	amp    = "amp;"
)

// Body makes s safe as the body of a <task_…> element while keeping it
// verbatim everywhere else. Only "</task", which could close the envelope,
// changes: it becomes "&lt;/task". So that Unbody restores s exactly, a
// literal "&" (amp;)ᵏ "lt;/task" already in s gains one more "amp;".
func Body(s string) string {
	if !strings.Contains(s, closer) && !strings.Contains(s, tail) {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 16)
	for i := 0; i < len(s); {
		if strings.HasPrefix(s[i:], closer) {
			b.WriteString("&" + tail)
			i += len(closer)
			continue
		}
		if s[i] == '&' {
			j, k := ampRun(s, i+1)
			if strings.HasPrefix(s[j:], tail) {
				b.WriteString("&" + strings.Repeat(amp, k+1) + tail)
				i = j + len(tail)
				continue
			}
		}
		b.WriteByte(s[i])
		i++
	}
	return b.String()
}

// Unbody inverts Body.
func Unbody(s string) string {
	if !strings.Contains(s, tail) {
		return s
	}
	var b strings.Builder
	b.Grow(len(s))
	for i := 0; i < len(s); {
		if s[i] == '&' {
			j, k := ampRun(s, i+1)
			if strings.HasPrefix(s[j:], tail) {
				if k == 0 {
					b.WriteString(closer)
				} else {
					b.WriteString("&" + strings.Repeat(amp, k-1) + tail)
				}
				i = j + len(tail)
				continue
			}
		}
		b.WriteByte(s[i])
		i++
	}
	return b.String()
}

// ampRun counts the "amp;" repeated from i and returns where they end.
func ampRun(s string, i int) (end, k int) {
	for strings.HasPrefix(s[i:], amp) {
		i += len(amp)
		k++
	}
	return i, k
}
