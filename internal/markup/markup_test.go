package markup

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestBodyKeepsTextVerbatimButClosers(t *testing.T) {
	tests := []struct{ give, want string }{
		{give: "plain <b>html</b> & Go generics List<T>", want: "plain <b>html</b> & Go generics List<T>"},
		{give: "x </task_result></task> y", want: "x &lt;/task_result>&lt;/task> y"},
		{give: "literal &lt;/task here", want: "literal &amp;lt;/task here"},
		{give: "&amp;lt;/task", want: "&amp;amp;lt;/task"},
		{give: "&amp;</task", want: "&amp;&lt;/task"},
		{give: "", want: ""},
	}
	for _, tt := range tests {
		got := Body(tt.give)
		assert.Equal(t, tt.want, got)
		assert.NotContains(t, got, "</task")
		assert.Equal(t, tt.give, Unbody(got))
	}
}

func TestTextAndAttr(t *testing.T) {
	assert.Equal(t, "a &lt;task&gt; b", strings.ReplaceAll(Text("a <task> b"), ">", "&gt;"))
	assert.Equal(t, "fine", Text("fine"))
	assert.Equal(t, "&lt;x&gt; &amp; &quot;q&quot;", Attr(`<x> & "q"`))
	assert.Equal(t, "a&#10;b&#9;c", Attr("a\nb\tc"), "an attribute stays on one line")
}

func FuzzBody(f *testing.F) {
	f.Add("</task_result>")
	f.Add("&lt;/task&amp;lt;/task</task")
	f.Fuzz(func(t *testing.T, s string) {
		got := Body(s)
		if strings.Contains(got, "</task") {
			t.Fatalf("Body(%q) = %q still holds a closer", s, got)
		}
		if back := Unbody(got); back != s {
			t.Fatalf("Unbody(Body(%q)) = %q", s, back)
		}
	})
}
