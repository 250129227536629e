//go:build ember_runsc

package main

import (
	"reflect"
	"strings"
	"testing"
)

// Run with: go test -tags ember_runsc ./tools/runscmem/ (make test does; the file is only compiled
// with that tag, as runsc's build compiles it).

func TestProcessOf(t *testing.T) {
	for _, c := range []struct {
		args         []string
		kind, bundle string
		logFD        int
	}{
		// runsc's own re-executions, as ps shows them.
		{[]string{"--overlay2=none", "--root=/r", "--log=/l/runsc.log", "--log-fd=3", "boot", "--bundle=/s/bundle", "--setup-root", "id"}, "sentry", "/s/bundle", 3},
		{[]string{"--root=/r", "--log-fd=3", "gofer", "--bundle", "/s/bundle", "--spec-fd=4", "id"}, "gofer", "/s/bundle", 3},
		{[]string{"--root=/r", "restore", "--bundle", "/s/bundle", "id"}, "", "", -1},
		{[]string{"--root=/r", "--log-fd=5"}, "", "", 5},
		{nil, "", "", -1},
	} {
		kind, bundle, fd := processOf(c.args)
		if kind != c.kind || bundle != c.bundle || fd != c.logFD {
			t.Errorf("processOf(%q) = %q %q %d, want %q %q %d", c.args, kind, bundle, fd, c.kind, c.bundle, c.logFD)
		}
	}
}

func TestApplyGC(t *testing.T) {
	var percent []int
	var limit []int64
	setP := func(n int) int { percent = append(percent, n); return 100 }
	setL := func(n int64) int64 { limit = append(limit, n); return 1 << 62 }
	msgs := applyGC("sentry", map[string]string{
		"dev.ember.sentry.gc-percent":   "25",
		"dev.ember.sentry.memory-limit": "8388608",
		"dev.ember.gofer.gc-percent":    "10", // another process's
	}, setP, setL)
	if !reflect.DeepEqual(percent, []int{25}) || !reflect.DeepEqual(limit, []int64{8388608}) {
		t.Fatalf("set %v %v", percent, limit)
	}
	if want := "sentry gc-percent 25 (was 100)"; len(msgs) != 2 || msgs[0] != want {
		t.Fatalf("messages %q, want %q first", msgs, want)
	}
	percent, limit = nil, nil
	msgs = applyGC("gofer", map[string]string{"dev.ember.gofer.gc-percent": "x", "dev.ember.gofer.memory-limit": "-1"}, setP, setL)
	if len(percent)+len(limit) != 0 || len(msgs) != 2 || !strings.Contains(msgs[0], "ignored") || !strings.Contains(msgs[1], "ignored") {
		t.Fatalf("malformed values: set %v %v, messages %q", percent, limit, msgs)
	}
	if msgs := applyGC("sentry", nil, setP, setL); len(msgs) != 0 {
		t.Fatalf("no annotations: %q", msgs)
	}
}
