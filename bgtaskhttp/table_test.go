package bgtaskhttp

import (
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
)

// tableTasks are five tasks an hour before now, launched a minute apart
// (t1 first), of two agents and three models, with their costs and ends.
func tableTasks(now time.Time) []bgtask.Task {
	at := func(m int) time.Time { return now.Add(-time.Hour + time.Duration(m)*time.Minute) }
	t1 := ended("t1", bgtask.StatusCompleted, at(0), at(10), "a/1", 30, "", "")
	t2 := ended("t2", bgtask.StatusError, at(1), at(2), "a/2", 10, "429 Too Many Requests", bgtask.ReasonProviderError)
	t3 := ended("t3", bgtask.StatusError, at(2), at(40), "b/1", 0, "context too long", bgtask.ReasonContextOverflow)
	t4 := ended("t4", bgtask.StatusRunning, at(3), time.Time{}, "b/1", 5, "", "")
	t4.Attempts[0].CompletedAt = time.Time{}
	t5 := ended("t5", bgtask.StatusCancelled, at(4), at(5), "a/1", 0, "", "")
	t1.Agent, t2.Agent, t3.Agent, t4.Agent, t5.Agent = "explore", "explore", "review", "review", "explore"
	for _, t := range []*bgtask.Task{&t1, &t2, &t3, &t4, &t5} {
		t.Model = t.Attempts[0].Model
	}
	return []bgtask.Task{t1, t2, t3, t4, t5}
}

// ids are the ids of rows, in order.
func ids(rows []tableRow) []string {
	out := make([]string, len(rows))
	for i, r := range rows {
		out[i] = r.Task.ID
	}
	return out
}

func TestTableFiltersAndSorts(t *testing.T) {
	now := time.Date(2026, 12, 7, 12, 0, 0, 0, time.UTC)
	tasks := tableTasks(now)
	for _, c := range []struct {
		query string
		want  []string
		total int
	}{
		{"", []string{"t5", "t4", "t3", "t2", "t1"}, 5},                                // newest first
		{"order=asc", []string{"t1", "t2", "t3", "t4", "t5"}, 5},                       // oldest first
		{"model=a", []string{"t5", "t2", "t1"}, 3},                                     // a provider: each of its models
		{"model=a/1", []string{"t5", "t1"}, 2},                                         // one model
		{"agent=review", []string{"t4", "t3"}, 2},                                      //
		{"class=rate_limited", []string{"t2"}, 1},                                      // the kind of error
		{"class=context_overflow&agent=explore", nil, 0},                               // every filter at once
		{"status=error&status=cancelled", []string{"t5", "t3", "t2"}, 3},               //
		{"sort=cost", []string{"t1", "t2", "t4", "t5", "t3"}, 5},                       // the most first; ties newest first
		{"sort=cost&order=asc", []string{"t5", "t3", "t4", "t2", "t1"}, 5},             // ties still newest first
		{"sort=duration", []string{"t4", "t3", "t1", "t5", "t2"}, 5},                   // a live task runs to now (57 min); t5 and t2 tie at 1 min: newest first
		{"sort=class&order=asc&status=error", []string{"t3", "t2"}, 2},                 //
		{"sort=model&order=asc", []string{"t5", "t1", "t2", "t4", "t3"}, 5},            //
		{"from=2026-12-07T11:02:00Z", []string{"t5", "t4", "t3"}, 3},                   // launched at or after
		{"from=2026-12-07T11:01:00Z&to=2026-12-07T11:03:00Z", []string{"t3", "t2"}, 2}, // before to
		{"from=57m", []string{"t5", "t4"}, 2},                                          // a duration before now
		{"limit=2", []string{"t5", "t4"}, 5},                                           // a page; the total is all
		{"limit=2&offset=4", []string{"t1"}, 5},                                        //
		{"offset=9", nil, 5},                                                           // past the end
	} {
		v, err := url.ParseQuery(c.query)
		require.NoError(t, err)
		q, err := tableQueryOf(v, now)
		require.NoError(t, err, c.query)
		page, total := tableOf(tasks, q, now)
		assert.Equal(t, c.want, nilIfEmpty(ids(page)), c.query)
		assert.Equal(t, c.total, total, c.query)
	}
}

func nilIfEmpty(s []string) []string {
	if len(s) == 0 {
		return nil
	}
	return s
}

// A bad value is a bad argument that names it and says what is wanted.
func TestTableRefusesBadQueries(t *testing.T) {
	now := time.Date(2026, 12, 7, 12, 0, 0, 0, time.UTC)
	for query, says := range map[string]string{
		"status=bogus":          `unknown status "bogus"`,
		"sort=price":            `sort "price": want one of status, agent`,
		"order=up":              `order "up"`,
		"from=yesterday":        `from "yesterday": want a time`,
		"from=1h&to=2h":         `from "1h": want a time before to`,
		"limit=0":               `limit "0": want a whole number from 1 to 1000`,
		"limit=-5":              `limit "-5"`,
		"offset=x":              `offset "x": want a whole number from 0`,
		"limit=99999999999999":  `limit "99999999999999"`,
		"to=2026-13-01T00:00Z":  `to "2026-13-01T00:00Z"`,
		"from=-5m":              `from "-5m"`,
		"status=running&sort=x": `sort "x"`,
	} {
		v, err := url.ParseQuery(query)
		require.NoError(t, err)
		_, err = tableQueryOf(v, now)
		assert.ErrorIs(t, err, bgtask.ErrInvalidArgument, query)
		assert.ErrorContains(t, err, says, query)
	}
}
