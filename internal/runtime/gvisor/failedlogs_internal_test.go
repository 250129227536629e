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

func TestKmsgAbout(t *testing.T) {
	q := kmsgQuery{since: 100 * time.Second, cgroup: "ember/sb-1", pid: 4242, runsc: "/x/runsc"}
	pids := map[int]bool{4242: true}
	tests := []struct {
		rec  string
		want bool
	}{
		{"5,1234,100500000,-;audit: type=1326 audit(1.2:3): auid=4294967295 uid=0 gid=0 ses=4294967295 pid=4242 comm=\"exe\" exe=\"/x/runsc\" sig=31 arch=c000003e syscall=321 compat=0 ip=0x1 code=0x80000000\n", true},
		{"5,1234,100500000,-;audit: type=1326 audit(1.2:3): auid=4294967295 uid=0 gid=0 ses=4294967295 pid=77 comm=\"exe\" exe=\"/x/runsc\" sig=31 arch=c000003e syscall=321 compat=0 ip=0x1 code=0x80000000\n", true},
		{"5,1234,100500000,-;audit: type=1326 audit(1.2:3): pid=78 comm=\"sh\" exe=\"/bin/sh\" sig=31\n", false},
		// The OOM killer: the record naming the cgroup gives the pid of the next one.
		{"6,10,100500000,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=sb-1,mems_allowed=0,oom_memcg=/a/ember/sb-1,task_memcg=/a/ember/sb-1,task=exe,pid=17936,uid=0\n", true},
		{"3,11,100500001,-;Memory cgroup out of memory: Killed process 17936 (exe) total-vm:1kB\n SUBSYSTEM=x\n", true},
		{"6,12,100500000,-;oom-kill:constraint=CONSTRAINT_MEMCG,oom_memcg=/a/ember/sb-10,task_memcg=/a/ember/sb-10,task=exe,pid=999,uid=0\n", false},
		{"3,13,100500001,-;Memory cgroup out of memory: Killed process 999 (exe) total-vm:1kB\n", false},
		{"5,1,90000000,-;audit: pid=4242 sig=31\n", false}, // before the launch: another process of that pid
		{"6,2,100500000,-;loop1: detected capacity change from 0 to 8\n", false},
	}
	for _, tc := range tests {
		if _, ok := q.about([]byte(tc.rec), pids); ok != tc.want {
			t.Errorf("about(%q) = %v, want %v", tc.rec, ok, tc.want)
		}
	}
}
