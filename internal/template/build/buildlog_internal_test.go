package build

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// A build's log stays bounded in memory (the last lines), is kept whole on disk in the data
// dir (appended, not the record re-serialised with every line), and survives a restart.
func TestBuildLogIsBoundedInMemoryAndKeptOnDisk(t *testing.T) {
	dir := t.TempDir()
	bs, err := openBuilds(dir, func(string, ...any) {})
	if err != nil {
		t.Fatal(err)
	}
	id := newBuildID()
	now := time.Now().UTC()
	r := &buildRec{b: TemplateBuild{ID: id, TemplateID: "t", Status: BuildBuilding, CreatedAt: now, UpdatedAt: now}}
	bs.mu.Lock()
	if err := bs.write(r); err != nil {
		t.Fatal(err)
	}
	bs.recs[id] = r
	bs.mu.Unlock()
	const lines = 30000
	line := strings.Repeat("x", 1000)
	for i := 0; i < lines; i++ {
		bs.log(id, "info", "1", fmt.Sprintf("%d %s", i, line))
	}
	bs.update(id, func(b *TemplateBuild) bool { b.Status = BuildReady; return true })

	bs.mu.Lock()
	held, dropped := len(r.b.Logs), r.b.LogsDropped
	bs.mu.Unlock()
	if held > maxBuildLogLines || held+dropped != lines {
		t.Fatalf("in memory: %d lines (+%d dropped) of %d; want at most %d held", held, dropped, lines, maxBuildLogLines)
	}
	if fi, err := os.Stat(filepath.Join(dir, id+".json")); err != nil || fi.Size() > 64<<10 {
		t.Fatalf("the build record holds the log: %v bytes, %v", fi.Size(), err)
	}
	f, err := os.Open(filepath.Join(dir, id+".log"))
	if err != nil {
		t.Fatalf("no log on disk: %v", err)
	}
	n := 0
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		n++
	}
	f.Close()
	if n != lines {
		t.Fatalf("on disk: %d lines, want %d", n, lines)
	}

	bs2, err := openBuilds(dir, func(string, ...any) {})
	if err != nil {
		t.Fatal(err)
	}
	r2 := bs2.recs[id]
	if r2 == nil || len(r2.b.Logs) == 0 || len(r2.b.Logs) > maxBuildLogLines || r2.b.LogsDropped+len(r2.b.Logs) != lines {
		t.Fatalf("after a restart: %+v", r2)
	}
	if last := r2.b.Logs[len(r2.b.Logs)-1].Message; !strings.HasPrefix(last, fmt.Sprint(lines-1)+" ") {
		t.Fatalf("after a restart the last line is %.20q", last)
	}
}

// A record an older ember wrote holds its log itself: its lines move to the log file.
func TestBuildLogOfAnOlderRecordMovesToItsFile(t *testing.T) {
	dir := t.TempDir()
	id := newBuildID()
	rec := fmt.Sprintf(`{"id":%q,"templateId":"t","status":"ready","logs":[{"level":"info","message":"one"},{"level":"info","message":"two"}]}`, id)
	os.WriteFile(filepath.Join(dir, id+".json"), []byte(rec), 0o600)
	bs, err := openBuilds(dir, func(string, ...any) {})
	if err != nil {
		t.Fatal(err)
	}
	if r := bs.recs[id]; r == nil || len(r.b.Logs) != 2 || r.b.Logs[1].Message != "two" {
		t.Fatalf("record: %+v", r)
	}
	if data, err := os.ReadFile(filepath.Join(dir, id+".log")); err != nil || strings.Count(string(data), "\n") != 2 {
		t.Fatalf("log file: %q %v", data, err)
	}
}
