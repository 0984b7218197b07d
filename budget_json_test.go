package bgtask

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A budget's Left says "no limit" as null, not -1, and 0 (nothing left)
// as 0; a BudgetState reads back as it was, and one an earlier version
// wrote (-1 for no limit, 0 left out) reads as it meant.
func TestBudgetStateJSONSaysNoLimitAsNull(t *testing.T) {
	s := BudgetState{TaskID: "root", Limit: Budget{Tokens: 1000, Requests: 5}, Spent: Usage{InputTokens: 1000, Requests: 2},
		Left: Budget{Tokens: 0, Cost: -1, Requests: 3, Spawns: -1}, Exceeded: LimitTokens}
	b, err := json.Marshal(s)
	require.NoError(t, err)
	var wire map[string]any
	require.NoError(t, json.Unmarshal(b, &wire))
	assert.Equal(t, map[string]any{"tokens": 0.0, "cost": nil, "requests": 3.0, "spawns": nil}, wire["left"], string(b))
	assert.NotContains(t, string(b), "-1")

	var back BudgetState
	require.NoError(t, json.Unmarshal(b, &back))
	assert.Equal(t, s, back)

	var task Task
	require.NoError(t, json.Unmarshal([]byte(`{"id":"t","budget":{"taskID":"root","limit":{"tokens":1000},"spent":{},"spawned":0,"left":{"cost":-1,"requests":-1,"spawns":-1}}}`), &task))
	require.NotNil(t, task.Budget)
	assert.Equal(t, Budget{Tokens: 0, Cost: -1, Requests: -1, Spawns: -1}, task.Budget.Left, "an earlier version's: -1 is no limit, a figure left out is 0")
	b, err = json.Marshal(task)
	require.NoError(t, err)
	assert.Contains(t, string(b), `"left":{"tokens":0,"cost":null,"requests":null,"spawns":null}`)

	assert.Error(t, json.Unmarshal([]byte(`{"left":{"tokens":"many"}}`), &back))
}
