// Package viewtest drives a whole pgledger fleet's live view
// (pgledger/fleetview, served by bgtaskhttp) in headless Chromium: three
// processes on one PostgreSQL ledger, one page. It is a module of its own
// so that neither pgledger nor the root requires chromedp; it starts a
// throwaway PostgreSQL server as pgledger's tests do (pgtest), and needs
// a Chromium as bgtaskhttp/viewtest does.
package viewtest
