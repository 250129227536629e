package gvisor

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestFailureReason(t *testing.T) {
	tests := []struct {
		name  string
		files map[string]string
		want  string
	}{
		{"go panic in the sandbox", map[string]string{
			panicLogName:                    "\npanic: runtime error: invalid memory address\n[signal SIGSEGV: segmentation violation]\n\ngoroutine 1 [running]:\n",
			"runsc.log.20260101-1.boot.txt": "I1201 14:49:03.090659       1 x.go:1] fine\n",
		}, "panic: runtime error: invalid memory address"},
		{"fatal log line of the sandbox", map[string]string{
			panicLogName:                     "",
			"runsc.log.20260101-1.gofer.txt": "W1201 14:49:03.090659       1 x.go:1] gofer: failed to open\n",
			"runsc.log.20260101-1.boot.txt":  "I1201 14:49:03.000001       1 x.go:1] Restore starts\nW1201 14:49:03.090659       1 controller.go:9] urpc: RPC call for method containerManager.Restore failed: EOF\nW1201 14:49:03.100000       1 x.go:2] --allow-suid is disabled\n",
		}, "urpc: RPC call for method containerManager.Restore failed: EOF"},
		{"go message written to the debug log (stderr)", map[string]string{
			"runsc.log.20260101-1.boot.txt": "I1201 14:49:03.000001       1 x.go:1] Restore starts\nfatal error: out of memory\n",
		}, "fatal error: out of memory"},
		{"nothing said", map[string]string{
			"runsc.log.20260101-1.boot.txt": "I1201 14:49:03.000001       1 x.go:1] Restore starts\nW1201 14:49:03.100000       1 x.go:2] --allow-suid is disabled\n",
		}, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			for n, c := range tc.files {
				if err := os.WriteFile(filepath.Join(dir, n), []byte(c), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			if got := failureReason(dir); got != tc.want {
				t.Errorf("failureReason = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestPruneFailedLogs(t *testing.T) {
	parent := t.TempDir()
	now := time.Now()
	for i := 0; i < 25; i++ {
		d := filepath.Join(parent, fmt.Sprintf("x%02d", i))
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
		mt := now.Add(time.Duration(i) * time.Second)
		if err := os.Chtimes(d, mt, mt); err != nil {
			t.Fatal(err)
		}
	}
	pruneFailedLogs(parent, failedLogsKept)
	ents, _ := os.ReadDir(parent)
	if len(ents) != failedLogsKept || ents[0].Name() != "x05" {
		t.Errorf("after prune: %d dirs from %s, want the newest %d (x05..x24)", len(ents), ents[0].Name(), failedLogsKept)
	}
}
