package envd_test

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	fspb "github.com/ember-sandbox/ember/api/gen/filesystem"
	"github.com/ember-sandbox/ember/internal/envd"
	"github.com/ember-sandbox/ember/internal/testutil"
)

func TestFilesystemRPCs(t *testing.T) {
	h := newHarness(t, envd.Config{})
	ctx := context.Background()
	dir := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(dir+"/compat/sub", 0o755))
	must(os.WriteFile(dir+"/compat/a.txt", []byte("hello file"), 0o644))
	must(os.WriteFile(dir+"/compat/sub/deep.txt", []byte("d"), 0o600))
	must(os.Symlink("a.txt", dir+"/compat/link"))

	t.Run("stat", func(t *testing.T) {
		r, err := h.fs.Stat(ctx, connect.NewRequest(&fspb.StatRequest{Path: dir + "/compat/a.txt"}))
		must(err)
		e := r.Msg.GetEntry()
		if e.GetName() != "a.txt" || e.GetPath() != dir+"/compat/a.txt" || e.GetType() != fspb.FileType_FILE_TYPE_FILE ||
			e.GetSize() != 10 || e.GetMode() != 0o644 || e.GetPermissions() != "-rw-r--r--" || e.GetOwner() != "root" ||
			e.GetGroup() != "root" || e.GetModifiedTime().AsTime().IsZero() {
			t.Fatalf("entry %v", e)
		}
		r, err = h.fs.Stat(ctx, connect.NewRequest(&fspb.StatRequest{Path: dir + "/compat/link"}))
		must(err)
		if r.Msg.GetEntry().GetType() != fspb.FileType_FILE_TYPE_FILE || r.Msg.GetEntry().GetSymlinkTarget() != dir+"/compat/a.txt" {
			t.Fatalf("symlink entry %v", r.Msg.GetEntry())
		}
		if _, err := h.fs.Stat(ctx, connect.NewRequest(&fspb.StatRequest{Path: dir + "/nope"})); codeOf(err) != connect.CodeNotFound {
			t.Fatalf("stat missing: %v", err)
		}
	})

	t.Run("list depth", func(t *testing.T) {
		for _, tc := range []struct {
			depth uint32
			want  []string
		}{
			{1, []string{"compat/a.txt", "compat/link", "compat/sub"}},
			{2, []string{"compat/a.txt", "compat/link", "compat/sub", "compat/sub/deep.txt"}},
		} {
			r, err := h.fs.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: dir + "/compat", Depth: tc.depth}))
			must(err)
			var got []string
			for _, e := range r.Msg.GetEntries() {
				rel, _ := filepath.Rel(dir, e.GetPath())
				got = append(got, rel)
				if rel == "compat/sub" && e.GetType() != fspb.FileType_FILE_TYPE_DIRECTORY {
					t.Errorf("sub is %v", e.GetType())
				}
			}
			slices.Sort(got)
			if !slices.Equal(got, tc.want) {
				t.Errorf("depth %d: %v, want %v", tc.depth, got, tc.want)
			}
		}
		if _, err := h.fs.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: dir + "/missing", Depth: 1})); codeOf(err) != connect.CodeNotFound {
			t.Fatalf("list missing: %v", err)
		}
	})

	t.Run("makedir", func(t *testing.T) {
		p := dir + "/compat/d1/d2"
		r, err := h.fs.MakeDir(ctx, connect.NewRequest(&fspb.MakeDirRequest{Path: p}))
		must(err)
		if r.Msg.GetEntry().GetType() != fspb.FileType_FILE_TYPE_DIRECTORY || r.Msg.GetEntry().GetOwner() != testUser.Username {
			t.Fatalf("entry %v", r.Msg.GetEntry())
		}
		if _, err := h.fs.MakeDir(ctx, connect.NewRequest(&fspb.MakeDirRequest{Path: p})); codeOf(err) != connect.CodeAlreadyExists {
			t.Fatalf("second makedir: %v", err)
		}
	})

	t.Run("move", func(t *testing.T) {
		r, err := h.fs.Move(ctx, connect.NewRequest(&fspb.MoveRequest{Source: dir + "/compat/a.txt", Destination: dir + "/compat/b.txt"}))
		must(err)
		if r.Msg.GetEntry().GetPath() != dir+"/compat/b.txt" || r.Msg.GetEntry().GetName() != "b.txt" {
			t.Fatalf("entry %v", r.Msg.GetEntry())
		}
		if _, err := os.Stat(dir + "/compat/a.txt"); !os.IsNotExist(err) {
			t.Fatalf("old path still there: %v", err)
		}
		if _, err := h.fs.Move(ctx, connect.NewRequest(&fspb.MoveRequest{Source: dir + "/nope", Destination: dir + "/x"})); codeOf(err) != connect.CodeNotFound {
			t.Fatalf("move missing: %v", err)
		}
	})

	t.Run("remove", func(t *testing.T) {
		_, err := h.fs.Remove(ctx, connect.NewRequest(&fspb.RemoveRequest{Path: dir + "/compat/sub"}))
		must(err)
		if _, err := os.Stat(dir + "/compat/sub"); !os.IsNotExist(err) {
			t.Fatalf("still there: %v", err)
		}
		// E2B's envd: removing a missing path succeeds.
		if _, err := h.fs.Remove(ctx, connect.NewRequest(&fspb.RemoveRequest{Path: dir + "/compat/sub"})); err != nil {
			t.Fatalf("remove missing: %v", err)
		}
	})

	t.Run("relative path as user", func(t *testing.T) {
		req := connect.NewRequest(&fspb.MakeDirRequest{Path: "reldir"})
		r, err := h.fs.MakeDir(ctx, req)
		must(err)
		if r.Msg.GetEntry().GetPath() != filepath.Join(testUser.HomeDir, "reldir") {
			t.Fatalf("entry %v", r.Msg.GetEntry())
		}
		req2 := connect.NewRequest(&fspb.StatRequest{Path: "."})
		req2.Header().Set("Authorization", basic("root"))
		r2, err := h.fs.Stat(ctx, req2)
		must(err)
		if r2.Msg.GetEntry().GetPath() != "/root" {
			t.Fatalf("root's home: %v", r2.Msg.GetEntry())
		}
	})
}

// watchEvents reads WatchDir until want is seen (name and type) or times out.
func waitWatch(t *testing.T, ch <-chan *fspb.FilesystemEvent, name string, types ...fspb.EventType) {
	t.Helper()
	timeout := time.After(5 * time.Second)
	var seen []string
	for {
		select {
		case ev, ok := <-ch:
			if !ok {
				t.Fatalf("watch ended; seen %v", seen)
			}
			seen = append(seen, ev.GetName()+":"+ev.GetType().String())
			if ev.GetName() == name && slices.Contains(types, ev.GetType()) {
				return
			}
		case <-timeout:
			t.Fatalf("no %s event; seen %v", name, seen)
		}
	}
}

func TestWatchDir(t *testing.T) {
	h := newHarness(t, envd.Config{})
	for _, recursive := range []bool{false, true} {
		name := map[bool]string{false: "flat", true: "recursive"}[recursive]
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			if err := os.Mkdir(dir+"/d1", 0o755); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			stream, err := h.fs.WatchDir(ctx, connect.NewRequest(&fspb.WatchDirRequest{Path: dir, Recursive: recursive}))
			if err != nil {
				t.Fatal(err)
			}
			defer stream.Close()
			if !stream.Receive() || stream.Msg().GetStart() == nil {
				t.Fatalf("first message is not start: %v %v", stream.Msg(), stream.Err())
			}
			ch := make(chan *fspb.FilesystemEvent, 100)
			go func() {
				defer close(ch)
				for stream.Receive() {
					if ev := stream.Msg().GetFilesystem(); ev != nil {
						ch <- ev
					}
				}
			}()
			if err := os.WriteFile(dir+"/w.txt", []byte("x"), 0o644); err != nil {
				t.Fatal(err)
			}
			waitWatch(t, ch, "w.txt", fspb.EventType_EVENT_TYPE_CREATE, fspb.EventType_EVENT_TYPE_WRITE)
			if !recursive {
				return
			}
			if err := os.WriteFile(dir+"/d1/x.txt", []byte("x"), 0o644); err != nil {
				t.Fatal(err)
			}
			waitWatch(t, ch, "d1/x.txt", fspb.EventType_EVENT_TYPE_CREATE, fspb.EventType_EVENT_TYPE_WRITE)
			// A directory created after the watch started is watched too.
			if err := os.Mkdir(dir+"/new", 0o755); err != nil {
				t.Fatal(err)
			}
			waitWatch(t, ch, "new", fspb.EventType_EVENT_TYPE_CREATE)
			time.Sleep(100 * time.Millisecond)
			if err := os.WriteFile(dir+"/new/y.txt", []byte("y"), 0o644); err != nil {
				t.Fatal(err)
			}
			waitWatch(t, ch, "new/y.txt", fspb.EventType_EVENT_TYPE_CREATE, fspb.EventType_EVENT_TYPE_WRITE)
			if err := os.Remove(dir + "/w.txt"); err != nil {
				t.Fatal(err)
			}
			waitWatch(t, ch, "w.txt", fspb.EventType_EVENT_TYPE_REMOVE)
		})
	}
	t.Run("missing dir", func(t *testing.T) {
		stream, err := h.fs.WatchDir(context.Background(), connect.NewRequest(&fspb.WatchDirRequest{Path: "/nonexistent-envd"}))
		if err == nil {
			for stream.Receive() {
			}
			err = stream.Err()
		}
		if codeOf(err) != connect.CodeNotFound {
			t.Fatalf("%v", err)
		}
	})
}

// A write through envd's file API is answered once every polling watcher of its directory has
// taken in its event: a poll right after the write finds it (E2B's
// test_watch_directory_changes_with_entry_info: write, then get_new_events at once, failed
// under gVisor when envd's inotify reader had not caught up yet). Many rounds, as the race is
// narrow on a host kernel.
func TestWatcherPollingSeesEnvdsOwnWriteAtOnce(t *testing.T) {
	h := newHarness(t, envd.Config{})
	ctx := context.Background()
	dir := t.TempDir()
	if err := os.WriteFile(dir+"/w.txt", []byte("first"), 0o644); err != nil {
		t.Fatal(err)
	}
	cr, err := h.fs.CreateWatcher(ctx, connect.NewRequest(&fspb.CreateWatcherRequest{Path: dir, IncludeEntry: true}))
	if err != nil {
		t.Fatal(err)
	}
	id := cr.Msg.GetWatcherId()
	for i := 0; i < 300; i++ {
		code, resp, _ := doReq(t, http.MethodPost, filesURL(h.url, map[string]string{"path": dir + "/w.txt", "username": "root"}),
			strings.NewReader(fmt.Sprintf("round %d", i)), map[string]string{"Content-Type": "application/octet-stream"})
		if code != http.StatusOK {
			t.Fatalf("POST %d %s", code, resp)
		}
		r, err := h.fs.GetWatcherEvents(ctx, connect.NewRequest(&fspb.GetWatcherEventsRequest{WatcherId: id}))
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, ev := range r.Msg.GetEvents() {
			if ev.GetName() == "w.txt" && ev.GetType() == fspb.EventType_EVENT_TYPE_WRITE {
				found = true
			}
		}
		if !found {
			t.Fatalf("round %d: the poll right after the write has no WRITE event of w.txt: %v", i, r.Msg.GetEvents())
		}
		time.Sleep(2 * time.Millisecond) // the rest of the write's events (attributes) come in
		if _, err := h.fs.GetWatcherEvents(ctx, connect.NewRequest(&fspb.GetWatcherEventsRequest{WatcherId: id})); err != nil {
			t.Fatal(err)
		}
	}
}

func TestWatcherPolling(t *testing.T) {
	h := newHarness(t, envd.Config{})
	ctx := context.Background()
	dir := t.TempDir()
	cr, err := h.fs.CreateWatcher(ctx, connect.NewRequest(&fspb.CreateWatcherRequest{Path: dir, Recursive: true, IncludeEntry: true}))
	if err != nil {
		t.Fatal(err)
	}
	id := cr.Msg.GetWatcherId()
	if err := os.WriteFile(dir+"/p.txt", []byte("p"), 0o644); err != nil {
		t.Fatal(err)
	}
	var found *fspb.FilesystemEvent
	testutil.Eventually(t, 5*time.Second, "the watcher reports the create event of p.txt", func() bool {
		r, err := h.fs.GetWatcherEvents(ctx, connect.NewRequest(&fspb.GetWatcherEventsRequest{WatcherId: id}))
		if err != nil {
			t.Fatal(err)
		}
		for _, ev := range r.Msg.GetEvents() {
			if ev.GetName() == "p.txt" && ev.GetType() == fspb.EventType_EVENT_TYPE_CREATE {
				found = ev
			}
		}
		return found != nil
	})
	if found.GetEntry().GetPath() != dir+"/p.txt" {
		t.Fatalf("create event with entry not seen: %v", found)
	}
	if _, err := h.fs.RemoveWatcher(ctx, connect.NewRequest(&fspb.RemoveWatcherRequest{WatcherId: id})); err != nil {
		t.Fatal(err)
	}
	if _, err := h.fs.GetWatcherEvents(ctx, connect.NewRequest(&fspb.GetWatcherEventsRequest{WatcherId: id})); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("after remove: %v", err)
	}
}
