package bgtask

import (
	"bytes"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	goruntime "runtime"
	"strings"
	"testing"
)

// The import cost of the root package (issue 43, "a light import"): a
// program that launches one in-process task must not link net/http nor
// crypto/tls.

// maxInProcessBinary bounds the stripped size of inProcessProgram. The
// issue asked for 2.5 MB (2,621,440 bytes); it is not met. Without
// net/http, crypto/tls, regexp, google/uuid and crypto/rand's generator
// the program is 3.82 MB (go1.26, linux/amd64; 5.8 MB before). What is
// left is reachable only because optional features are reached through
// plain field checks the linker cannot see through: the journal's
// encoding and replay (encoding/json too), logging (log/slog), health,
// notifications, metrics, limits (about 1.3 MB together, measured one by
// one in a scratch copy). Reaching 2.5 MB means installing each of those
// through its option (WithJournal, WithLogger, WithHealth, ...) as
// function values, and the root not importing log/slog or hash/crc32:
// see the closing note of issue 43. The bound is 4.0 MB: it catches
// net/http (1.8 MB) or crypto/rand's generator (0.17 MB) coming back.
const maxInProcessBinary = 4_000_000 // 4.0 MB

// inProcessProgram creates an in-process Manager (a FuncHost), runs one task
// and shuts down. It uses only NewFuncHost, Spec, Launch, Wait, Shutdown and
// the constructor, which is on the one line marked CONSTRUCTOR: the line to
// adjust if the constructor changes.
const inProcessProgram = `package main

import (
	"context"
	"fmt"
	"time"

	"github.com/bgtask/bgtask"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	host := bgtask.NewFuncHost(func(ctx context.Context, run bgtask.Run) (string, error) {
		return "done: " + run.Prompt, nil
	})
	m, err := bgtask.Open(ctx, host) // CONSTRUCTOR
	if err != nil {
		panic(err)
	}
	t, err := m.Launch(ctx, bgtask.Spec{Prompt: "hello"})
	if err != nil {
		panic(err)
	}
	t, err = m.Wait(ctx, t.ID)
	if err != nil {
		panic(err)
	}
	fmt.Println(t.ID, t.Status)
	if err := m.Shutdown(ctx); err != nil {
		panic(err)
	}
}
`

// baselineProgram is the same shape with goroutines and fmt only.
const baselineProgram = `package main

import (
	"fmt"
	"sync"
)

func main() {
	var wg sync.WaitGroup
	out := make(chan string, 1)
	wg.Add(1)
	go func() {
		defer wg.Done()
		out <- "done: hello"
	}()
	wg.Wait()
	fmt.Println(<-out)
}
`

// goTool is the go command that runs the tests (the one on PATH).
func goTool() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	return "go"
}

// goEnv is the environment for the go commands the tests run: no
// workspace, and modules resolved from go.mod (the module cache holds
// them).
func goEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "GOWORK=") || strings.HasPrefix(kv, "GOFLAGS=") {
			continue
		}
		env = append(env, kv)
	}
	return append(env, "GOWORK=off", "GOFLAGS=-mod=mod")
}

func runGo(t *testing.T, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command(goTool(), args...)
	cmd.Dir = dir
	cmd.Env = goEnv()
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}
	return stdout.String()
}

func TestImportCostDeps(t *testing.T) {
	root, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	out := runGo(t, root, "list", "-deps", "-f", "{{.ImportPath}} {{.Imports}}", ".")
	deps := map[string]string{} // package → its line: what imports what
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		path, _, _ := strings.Cut(line, " ")
		deps[path] = line
	}
	if _, ok := deps["github.com/bgtask/bgtask"]; !ok {
		t.Fatalf("go list -deps . does not list the root package:\n%s", out)
	}
	for _, banned := range []string{"net/http", "crypto/tls"} {
		if _, ok := deps[banned]; !ok {
			continue
		}
		var importers []string
		for _, line := range deps {
			if strings.Contains(line+" ", " "+banned+" ") || strings.Contains(line, "["+banned+" ") ||
				strings.Contains(line, " "+banned+"]") || strings.Contains(line, "["+banned+"]") {
				path, _, _ := strings.Cut(line, " ")
				importers = append(importers, path)
			}
		}
		t.Errorf("the root package depends on %s (imported by %v)", banned, importers)
	}
}

func TestImportCostBinarySize(t *testing.T) {
	if testing.Short() {
		t.Skip("builds two programs")
	}
	root, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	sum, err := os.ReadFile(filepath.Join(root, "go.sum")) // the checksums the module's deps need
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	build := func(name, goMod, src string) int64 {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte(goMod), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "go.sum"), sum, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
		bin := filepath.Join(dir, name)
		runGo(t, dir, "build", "-mod=mod", "-trimpath", "-ldflags=-s -w", "-o", bin, ".")
		fi, err := os.Stat(bin)
		if err != nil {
			t.Fatal(err)
		}
		return fi.Size()
	}
	goLine := "" // the toolchain's own version, so no other toolchain is asked for
	if v, ok := strings.CutPrefix(goruntime.Version(), "go"); ok {
		if i := strings.IndexAny(v, " -"); i >= 0 {
			v = v[:i]
		}
		goLine = "\ngo " + v + "\n"
	}
	baseline := build("baseline", "module baseline\n"+goLine, baselineProgram)
	inproc := build("inprocess", "module inprocess\n"+goLine+"\n"+
		"require github.com/bgtask/bgtask v0.0.0\n\n"+
		"replace github.com/bgtask/bgtask => "+root+"\n", inProcessProgram)
	t.Logf("stripped sizes: baseline (goroutines + fmt) %d bytes (%.2f MB); one in-process task %d bytes (%.2f MB); limit %d",
		baseline, float64(baseline)/(1<<20), inproc, float64(inproc)/(1<<20), maxInProcessBinary)
	if inproc > maxInProcessBinary {
		t.Errorf("a program that runs one in-process task is %d bytes stripped, more than %d", inproc, maxInProcessBinary)
	}
}

// usageLineRE is the regexp isUsageLine replaced, so that the package
// compiles none at init: isUsageLine must match exactly what it matches.
var usageLineRE = regexp.MustCompile(`^ *Usage: \d+ tokens \(\d+ in, (\d+ cached, )?\d+ out\), \d+ requests?, cost -?\d+\.\d+$`)

func TestImportCostUsageLineIsTheRegexps(t *testing.T) {
	r := rand.New(rand.NewPCG(43, 1))
	var lines []string
	for _, u := range []Usage{
		{}, {InputTokens: 1, OutputTokens: 2, Requests: 1, Cost: 1},
		{InputTokens: 1200, CachedTokens: 800, OutputTokens: 34, Requests: 3, Cost: 2*CostUnit + 5},
		{InputTokens: 1 << 62, CachedTokens: 1 << 62, OutputTokens: 1 << 62, Requests: 1 << 62, Cost: 1 << 62},
	} {
		lines = append(lines, "Usage: "+u.String(), "  Usage: "+u.String())
	}
	for range 200 {
		u := Usage{InputTokens: r.Int64N(1e6), OutputTokens: r.Int64N(1e6), Requests: r.Int64N(4), Cost: Cost(r.Int64N(1e9))}
		if r.IntN(2) == 0 {
			u.CachedTokens = r.Int64N(u.InputTokens + 1)
		}
		lines = append(lines, strings.Repeat(" ", r.IntN(3))+"Usage: "+u.String())
	}
	lines = append(lines, "", " ", "Usage:", "Usage: ", "\tUsage: 3 tokens (1 in, 2 out), 1 request, cost 0.000001",
		"Usage: 3 tokens (1 in, 2 out), 1 request, cost -0.5",
		"Usage: 3 tokens (1 in, 2 out), 1 request, cost --0.5",
		"Usage: 3 tokens (1 in, 2 out), 1 requestss, cost 0.5",
		"Usage: 3 tokens (1 in, 2 out), 1 request, cost 0.5\r",
		"Usage: 3 tokens (1 in, cached, 2 out), 1 request, cost 0.5",
		"Usage: 3 tokens (1 in, 5 cached, 5 cached, 2 out), 1 request, cost 0.5",
		"Usage: 3 tokens (1 in, ５ cached, 2 out), 1 request, cost 0.5",
		"Usage: 3 tokens (1 in, 2 out), 1 request, cost 0.",
		"Usage: 3 tokens (1 in, 2 out), 1 request, cost .5",
		"Usage: 3 tokens (1 in, 2 out), 1 request, cost 5")
	// Mutations of real lines: a byte dropped, doubled or replaced.
	const alphabet = " 0123456789-.,()sUuagecdinotkqr\t"
	for _, l := range lines[:40] {
		for range 30 {
			i := r.IntN(len(l) + 1)
			switch r.IntN(3) {
			case 0:
				if i < len(l) {
					lines = append(lines, l[:i]+l[i+1:])
				}
			case 1:
				if i < len(l) {
					lines = append(lines, l[:i+1]+l[i:])
				}
			default:
				c := alphabet[r.IntN(len(alphabet))]
				if i < len(l) {
					lines = append(lines, l[:i]+string(c)+l[i+1:])
				} else {
					lines = append(lines, l+string(c))
				}
			}
		}
	}
	matched := 0
	for _, l := range lines {
		want := usageLineRE.MatchString(l)
		if got := isUsageLine(l); got != want {
			t.Errorf("isUsageLine(%q) = %v, the regexp says %v", l, got, want)
		}
		if want {
			matched++
		}
	}
	if matched < 200 || matched == len(lines) {
		t.Fatalf("%d of %d lines match: the inputs do not test both ways", matched, len(lines))
	}
}
