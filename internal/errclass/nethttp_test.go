package errclass

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The package reads HTTP statuses, headers and dates without importing
// net/http (issue 43): these tests hold its own status texts, date parser
// and reading of a response by shape to net/http's.

// statusText is http.StatusText for every status FromStatus maps, and ""
// for every other (statedAsStatus asks about no other).
func TestStatusTextIsNetHTTPs(t *testing.T) {
	for code := -1; code <= 1000; code++ {
		want := ""
		if FromStatus(code) != Unknown {
			want = http.StatusText(code)
		}
		if got := statusText(code); got != want {
			t.Errorf("statusText(%d) = %q, want %q", code, got, want)
		}
	}
}

// A status stated with its text is read as net/http names it, in any case.
func TestStatusStatedWithItsText(t *testing.T) {
	for code := 100; code <= 599; code++ {
		text := http.StatusText(code)
		if text == "" || FromStatus(code) == Unknown {
			continue
		}
		for _, msg := range []string{
			fmt.Sprintf("%d %s", code, text),
			fmt.Sprintf("upstream said: %d  %s!", code, text),
		} {
			assert.Equal(t, code, statusInMessage(msg), msg)
		}
		assert.Equal(t, code, statusInMessage(fmt.Sprintf("x %d %s", code, toLowerASCII(text))))
	}
}

func toLowerASCII(s string) string {
	b := []byte(s)
	for i, c := range b {
		if c >= 'A' && c <= 'Z' {
			b[i] = c + 'a' - 'A'
		}
	}
	return string(b)
}

// httpDates are inputs for the date parser: each form net/http accepts,
// near misses and garbage.
func httpDates() []string {
	in := []string{
		"", " ", "0", "30", "1.5", "-1", "soon", "Inf", "NaN",
		"Sun, 06 Nov 1994 08:49:37 GMT",
		"Sunday, 06-Nov-94 08:49:37 GMT",
		"Sun Nov  6 08:49:37 1994",
		"Sun Nov 6 08:49:37 1994",
		"Sun Nov 06 08:49:37 1994",
		"Mon, 06 Nov 1994 08:49:37 GMT",      // a wrong weekday
		"Sun, 06 Nov 1994 08:49:37 UTC",      // not GMT
		"Sun, 06 Nov 1994 08:49:37 gmt",      // lower case
		"Sun, 6 Nov 1994 08:49:37 GMT",       // one-digit day
		"Sun, 06 Nov 1994 08:49:37 GMT ",     // trailing space
		" Sun, 06 Nov 1994 08:49:37 GMT",     // leading space
		"Sun, 06 Nov 1994 08:49:37",          // no zone
		"Sun, 06 Nov 1994 8:49:37 GMT",       // one-digit hour
		"Sun, 06 Nov 1994 24:00:00 GMT",      // out of range
		"Sun, 31 Nov 1994 08:49:37 GMT",      // no such day
		"Thu, 29 Feb 2024 23:59:59 GMT",      // leap day
		"Wed, 29 Feb 2023 23:59:59 GMT",      // not a leap year
		"Sunday, 06-Nov-94 08:49:37 PST",     // another zone
		"Sunday, 06-Nov-94 08:49:37 XYZ",     // an unknown zone
		"Sunday, 06-Nov-1994 08:49:37 GMT",   // four-digit year
		"Sun, 06-Nov-94 08:49:37 GMT",        // short weekday in RFC 850
		"Sunday, 06 Nov 1994 08:49:37 GMT",   // long weekday in IMF-fixdate
		"Sun Nov  6 08:49:37 94",             // two-digit asctime year
		"Sun, 06 Nov 1994 08:49:37.123 GMT",  // fractional seconds
		"Tue, 15 Nov 1994 12:45:26 GMT+0100", // an offset
		"2026-04-27T12:00:00Z",               // RFC 3339
	}
	formats := []string{http.TimeFormat, time.RFC850, time.ANSIC, time.RFC1123, time.RFC1123Z, time.UnixDate}
	r := rand.New(rand.NewPCG(43, 43))
	for range 300 {
		tm := time.Unix(r.Int64N(4102444800), 0).UTC() // 1970–2100
		if r.IntN(4) == 0 {
			tm = tm.In(time.FixedZone("CET", 3600))
		}
		in = append(in, tm.Format(formats[r.IntN(len(formats))]))
	}
	return in
}

// parseHTTPTime parses what http.ParseTime parses, to the same instant and
// zone, and fails where it fails, with the same error.
func TestParseHTTPTimeIsNetHTTPs(t *testing.T) {
	for _, s := range httpDates() {
		checkHTTPTime(t, s)
	}
}

func checkHTTPTime(t *testing.T, s string) {
	t.Helper()
	want, wantErr := http.ParseTime(s)
	got, gotErr := parseHTTPTime(s)
	if (wantErr == nil) != (gotErr == nil) {
		t.Fatalf("parseHTTPTime(%q): error %v, net/http's %v", s, gotErr, wantErr)
	}
	if wantErr != nil {
		if gotErr.Error() != wantErr.Error() {
			t.Fatalf("parseHTTPTime(%q): error %q, net/http's %q", s, gotErr, wantErr)
		}
		return
	}
	gn, go_ := got.Zone()
	wn, wo := want.Zone()
	if !got.Equal(want) || gn != wn || go_ != wo {
		t.Fatalf("parseHTTPTime(%q) = %v, net/http's %v", s, got, want)
	}
}

func FuzzParseHTTPTime(f *testing.F) {
	for _, s := range httpDates() {
		f.Add(s)
	}
	f.Fuzz(checkHTTPTime)
}

// RetryAfter reads a Retry-After date as it read it with http.ParseTime.
func TestRetryAfterDatesAreNetHTTPs(t *testing.T) {
	now := time.Date(2026, 4, 27, 12, 0, 0, 0, time.UTC)
	for _, s := range append(httpDates(),
		now.Add(90*time.Second).Format(http.TimeFormat),
		now.Add(90*time.Second).Format(time.RFC850),
		now.Add(90*time.Second).Format(time.ANSIC),
		now.Add(-time.Hour).Format(http.TimeFormat),
	) {
		var want time.Duration
		wantOK := false
		if _, err := strconv.ParseFloat(s, 64); err == nil {
			continue // a number, not a date: TestRetryAfter covers them
		}
		if tm, err := http.ParseTime(strings.TrimSpace(s)); err == nil { // a header's value is trimmed
			want, wantOK = max(tm.Sub(now), 0), true
		}
		got, ok := retryAfterAt(withHeader(http.Header{"Retry-After": {s}}), now)
		if ok != wantOK || got != want {
			t.Errorf("Retry-After %q: %v %v, want %v %v", s, got, ok, want, wantOK)
		}
	}
}

// A look-alike of http.Response: the fields the package reads, by shape.
type lookalikeResponse struct {
	Status     string
	StatusCode int
	Header     lookalikeHeader
}

type lookalikeHeader map[string][]string

type lookalikeErr struct {
	Response *lookalikeResponse
}

func (lookalikeErr) Error() string { return "x" }

type netHTTPErr struct {
	HTTPResponse *http.Response
}

func (netHTTPErr) Error() string { return "x" }

// Not a response: a pointer to a struct without the shape.
type notAResponse struct {
	Response *struct {
		StatusCode string
		Header     map[string][]string
	}
	RawResponse *struct {
		StatusCode int
		Header     map[string]string
	}
}

func (notAResponse) Error() string { return "x" }

// embeddedResponse embeds an *http.Response: a field named Response, with
// StatusCode and Header promoted.
type embeddedResponse struct {
	*http.Response
}

func (embeddedResponse) Error() string { return "x" }

// An *http.Response field is read as before, a look-alike the same way, a
// pointer without the shape not at all.
func TestResponseReadByShape(t *testing.T) {
	for _, code := range []int{0, 99, 100, 200, 400, 401, 403, 404, 408, 413, 422, 429, 500, 503, 529, 599, 600, -429, 1 << 40} {
		want := 0
		if validStatus(code) {
			want = code
		}
		c, _ := statusOf(netHTTPErr{HTTPResponse: &http.Response{StatusCode: code}})
		assert.Equal(t, want, c, "*http.Response %d", code)
		c, _ = statusOf(lookalikeErr{Response: &lookalikeResponse{StatusCode: code}})
		assert.Equal(t, want, c, "look-alike %d", code)
		c, _ = statusOf(&notAResponse{})
		assert.Equal(t, 0, c)
	}
	c, _ := statusOf(netHTTPErr{})
	assert.Equal(t, 0, c, "a nil response")

	now := time.Date(2026, 4, 27, 12, 0, 0, 0, time.UTC)
	d, ok := retryAfterAt(netHTTPErr{HTTPResponse: &http.Response{Header: http.Header{"Retry-After": {"7"}}}}, now)
	require.True(t, ok)
	assert.Equal(t, 7*time.Second, d)
	d, ok = retryAfterAt(lookalikeErr{Response: &lookalikeResponse{Header: lookalikeHeader{"retry-after-ms": {"250"}}}}, now)
	require.True(t, ok)
	assert.Equal(t, 250*time.Millisecond, d)
	_, ok = retryAfterAt(lookalikeErr{Response: &lookalikeResponse{}}, now)
	assert.False(t, ok, "no header")

	// An embedded *http.Response is read as before, nil or not.
	c, _ = statusOf(embeddedResponse{Response: &http.Response{StatusCode: 503}})
	assert.Equal(t, 503, c)
	c, _ = statusOf(embeddedResponse{})
	assert.Equal(t, 0, c)
	assert.Equal(t, Overloaded, Classify(embeddedResponse{Response: &http.Response{StatusCode: 503}}))
}
