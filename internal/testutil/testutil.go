// Package testutil holds test helpers shared by ember's packages. Tests that need root, runsc,
// network namespaces or a built template call Require*: locally they skip with the reason; in CI
// (EMBER_REQUIRE_ALL=1, set by `make test`) a missing prerequisite fails the test instead, so
// nothing that CI is meant to run is silently skipped.
package testutil

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
	"time"
)

// Need skips (or, in CI, fails) the test unless ok.
func Need(t testing.TB, ok bool, reason string) {
	t.Helper()
	if ok {
		return
	}
	if os.Getenv("EMBER_REQUIRE_ALL") == "1" {
		t.Fatalf("prerequisite missing (EMBER_REQUIRE_ALL=1): %s", reason)
	}
	t.Skip("skipping: " + reason)
}

// RequireRoot needs uid 0.
func RequireRoot(t testing.TB) {
	t.Helper()
	Need(t, os.Geteuid() == 0, "needs root")
}

// RepoRoot returns the repository's top directory.
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// Runsc returns the runsc binary: $EMBER_RUNSC, else <repo>/.cache/bin/runsc, else PATH.
func Runsc(t testing.TB) string {
	t.Helper()
	if p := os.Getenv("EMBER_RUNSC"); p != "" {
		return p
	}
	p := filepath.Join(RepoRoot(), ".cache", "bin", "runsc")
	if _, err := os.Stat(p); err == nil {
		return p
	}
	p, err := exec.LookPath("runsc")
	Need(t, err == nil, "runsc not found (run `make setup`)")
	return p
}

// NotApplicable skips a test that does not apply to the implementation or configuration under
// test (a driver without an optional interface, a run that ignores cgroups). It is not for a
// missing prerequisite: that goes through Need, which CI turns into a failure.
func NotApplicable(t testing.TB, reason string) {
	t.Helper()
	t.Skip("not applicable: " + reason)
}

// SkipShort skips the test under `go test -short`: for tests that are slow or only measure.
// -short is an explicit request, so EMBER_REQUIRE_ALL does not turn this skip into a failure
// (CI runs without -short, so there they run).
func SkipShort(t testing.TB, reason string) {
	t.Helper()
	if testing.Short() {
		t.Skip("skipping in -short mode: " + reason)
	}
}

// Eventually polls f until it is true, failing the test with what when within passes first. It
// polls often at first and backs off to every 100 ms; it returns how long it took.
func Eventually(t testing.TB, within time.Duration, what string, f func() bool) time.Duration {
	t.Helper()
	return eventually(t, within, f, func() { t.Fatalf("not within %v: %s", within, what) })
}

// eventually polls f, often at first and then every 100 ms, calling fail (which must end the
// test) when within passes before f is true.
func eventually(t testing.TB, within time.Duration, f func() bool, fail func()) time.Duration {
	t.Helper()
	start := time.Now()
	wait := 5 * time.Millisecond
	for !f() {
		if time.Since(start) > within {
			fail()
		}
		time.Sleep(wait)
		if wait < 100*time.Millisecond {
			wait *= 2
		}
	}
	return time.Since(start)
}

// EventuallyOr is Eventually with a failure message worth computing: when within passes before f
// is true it fails the test with failure(), called once then, which can show what f saw on its
// last round (through the variables they share) and logs too costly to gather every round. It
// returns how long it took.
func EventuallyOr(t testing.TB, within time.Duration, f func() bool, failure func() string) time.Duration {
	t.Helper()
	return eventually(t, within, f, func() { t.Fatalf("not within %v: %s", within, failure()) })
}
