// Package mcpfleet tests bgtaskmcp in front of a whole pgledger fleet:
// processes on one PostgreSQL ledger, each an MCP server of a fleet view
// (pgledger/fleetview), behind a balancer that sends each request to any
// of them. A client of the MCP tasks extension launches at one process
// and polls, and cancels, at the others: any process answers for any
// task.
//
// It is a module of its own so that neither pgledger nor bgtaskmcp
// requires the other's dependencies (pgx; the MCP SDK). It starts a
// throwaway PostgreSQL server as pgledger's tests do.
package mcpfleet
