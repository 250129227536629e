package envd

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/fsnotify/fsnotify"
	"golang.org/x/sys/unix"

	pb "github.com/ember-sandbox/ember/api/gen/filesystem"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// dirWatcher turns inotify events under root into FilesystemEvents named relative to root.
type dirWatcher struct {
	root         string
	recursive    bool
	includeEntry bool
	w            *fsnotify.Watcher
	out          *queue[*pb.FilesystemEvent]
	done         chan struct{}
	wg           sync.WaitGroup

	// waits are envd's own writes waiting for their event to be taken in (expect), by path.
	waitMu sync.Mutex
	waits  map[string][]chan struct{}
}

func newDirWatcher(root string, recursive, includeEntry, allowNetworkMounts bool) (*dirWatcher, error) {
	root = filepath.Clean(root) // events are named root + "/" + name; expectWrite matches them
	fi, err := os.Stat(root)
	if err != nil {
		return nil, fsError("path "+root+" not found", err)
	}
	if !fi.IsDir() {
		return nil, connect.NewError(connect.CodeInvalidArgument, errorf(errdefs.ErrInvalid, "path %s not a directory", root))
	}
	// inotify sees only changes made through this kernel: on a network filesystem, changes from
	// elsewhere never show up. As E2B's envd, refuse unless the caller accepts that (>= 0.6.4).
	if !allowNetworkMounts && onNetworkMount(root) {
		return nil, connect.NewError(connect.CodeInvalidArgument, errorf(errdefs.ErrInvalid, "cannot watch path on network filesystem: %s", root))
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	d := &dirWatcher{
		root: root, recursive: recursive, includeEntry: includeEntry,
		w: w, out: newQueue[*pb.FilesystemEvent](), done: make(chan struct{}), waits: map[string][]chan struct{}{},
	}
	if err := d.add(root); err != nil {
		w.Close()
		return nil, fsError("path "+root+" not found", err)
	}
	d.wg.Add(1)
	go d.run()
	return d, nil
}

// add watches dir and, when recursive, every directory below it.
func (d *dirWatcher) add(dir string) error {
	if !d.recursive {
		return d.w.Add(dir)
	}
	return filepath.WalkDir(dir, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			if p == dir {
				return err
			}
			return nil
		}
		if de.IsDir() {
			if err := d.w.Add(p); err != nil && p == dir {
				return err
			}
		}
		return nil
	})
}

func (d *dirWatcher) run() {
	defer d.wg.Done()
	for {
		select {
		case <-d.done:
			return
		case ev, ok := <-d.w.Events:
			if !ok {
				return
			}
			d.handle(ev)
		case _, ok := <-d.w.Errors:
			if !ok {
				return
			}
		}
	}
}

var opTypes = []struct {
	op fsnotify.Op
	t  pb.EventType
}{
	{fsnotify.Create, pb.EventType_EVENT_TYPE_CREATE},
	{fsnotify.Write, pb.EventType_EVENT_TYPE_WRITE},
	{fsnotify.Remove, pb.EventType_EVENT_TYPE_REMOVE},
	{fsnotify.Rename, pb.EventType_EVENT_TYPE_RENAME},
	{fsnotify.Chmod, pb.EventType_EVENT_TYPE_CHMOD},
}

func (d *dirWatcher) handle(ev fsnotify.Event) {
	if d.recursive && ev.Has(fsnotify.Create) {
		if fi, err := os.Lstat(ev.Name); err == nil && fi.IsDir() {
			_ = d.add(ev.Name)
		}
	}
	rel, err := filepath.Rel(d.root, ev.Name)
	if err != nil {
		rel = ev.Name
	}
	for _, ot := range opTypes {
		if !ev.Has(ot.op) {
			continue
		}
		fe := &pb.FilesystemEvent{Name: rel, Type: ot.t}
		if d.includeEntry && ot.op != fsnotify.Remove && ot.op != fsnotify.Rename {
			if e, err := entryInfo(ev.Name, newNameCache()); err == nil {
				fe.Entry = e
			}
		}
		d.out.push(fe)
	}
	d.waitMu.Lock()
	for _, ch := range d.waits[ev.Name] {
		close(ch)
	}
	delete(d.waits, ev.Name)
	d.waitMu.Unlock()
}

// sees reports whether d is told of changes to the file at path (absolute, clean).
func (d *dirWatcher) sees(path string) bool {
	dir := filepath.Dir(path)
	if dir == d.root {
		return true
	}
	rel, err := filepath.Rel(d.root, dir)
	return d.recursive && err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}

// expect returns a channel closed once d has taken in an event of path (the caller's write is
// about to make one); forget drops it unused.
func (d *dirWatcher) expect(path string) chan struct{} {
	ch := make(chan struct{})
	d.waitMu.Lock()
	d.waits[path] = append(d.waits[path], ch)
	d.waitMu.Unlock()
	return ch
}

func (d *dirWatcher) forget(path string, ch chan struct{}) {
	d.waitMu.Lock()
	defer d.waitMu.Unlock()
	w := slices.DeleteFunc(d.waits[path], func(c chan struct{}) bool { return c == ch })
	if len(w) == 0 {
		delete(d.waits, path)
	} else {
		d.waits[path] = w
	}
}

// Filesystem magic numbers of network filesystems (linux/magic.h; SMB2 and CIFS share one).
const (
	nfsSuperMagic  = 0x6969
	smbSuperMagic  = 0x517b
	cifsMagic      = 0xff534d42
	smb2Magic      = 0xfe534d42
	fuseSuperMagic = 0x65735546
)

// onNetworkMount reports whether path is on NFS, SMB/CIFS or FUSE.
func onNetworkMount(path string) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return false
	}
	switch uint32(st.Type) {
	case nfsSuperMagic, smbSuperMagic, cifsMagic, smb2Magic, fuseSuperMagic:
		return true
	}
	return false
}

func (d *dirWatcher) close() {
	select {
	case <-d.done:
		return
	default:
	}
	close(d.done)
	d.w.Close()
	d.wg.Wait()
}

func (f *filesystemService) WatchDir(ctx context.Context, req *connect.Request[pb.WatchDirRequest], stream *connect.ServerStream[pb.WatchDirResponse]) error {
	acct, err := f.fsAccount(req.Header())
	if err != nil {
		return err
	}
	d, err := newDirWatcher(acct.resolvePath(req.Msg.GetPath()), req.Msg.GetRecursive(), req.Msg.GetIncludeEntry(), req.Msg.GetAllowNetworkMounts())
	if err != nil {
		return err
	}
	defer d.close()
	if err := stream.Send(&pb.WatchDirResponse{Event: &pb.WatchDirResponse_Start{Start: &pb.WatchDirResponse_StartEvent{}}}); err != nil {
		return err
	}
	var tick <-chan time.Time
	if iv := keepaliveInterval(req.Header()); iv > 0 {
		t := time.NewTicker(iv)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case <-d.out.notify:
			for _, ev := range d.out.take() {
				if err := stream.Send(&pb.WatchDirResponse{Event: &pb.WatchDirResponse_Filesystem{Filesystem: ev}}); err != nil {
					return err
				}
			}
		case <-tick:
			if err := stream.Send(&pb.WatchDirResponse{Event: &pb.WatchDirResponse_Keepalive{Keepalive: &pb.WatchDirResponse_KeepAlive{}}}); err != nil {
				return err
			}
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return connect.NewError(connect.CodeDeadlineExceeded, errors.New("watch timeout exceeded"))
			}
			return connect.NewError(connect.CodeCanceled, ctx.Err())
		}
	}
}

// watcherRegistry holds the watchers of the polling API (CreateWatcher/GetWatcherEvents).
type watcherRegistry struct {
	mu sync.Mutex
	m  map[string]*dirWatcher
}

func newWatcherRegistry() *watcherRegistry { return &watcherRegistry{m: map[string]*dirWatcher{}} }

func (r *watcherRegistry) get(id string) (*dirWatcher, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	d, ok := r.m[id]
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, errorf(errdefs.ErrNotFound, "watcher '%s' not found", id))
	}
	return d, nil
}

// writeSettle bounds how long a write through envd's file API waits for the polling watchers
// of its directory to take in its event (normally well under a millisecond).
const writeSettle = 200 * time.Millisecond

// expectWrite is called before envd itself writes the file at path: the function it returns,
// called once the write is done, waits (at most writeSettle) until every polling watcher that
// sees path has taken in an event of it, so that a GetWatcherEvents after the write's answer
// finds it, as it would for a kernel's synchronous inotify queue. Nothing to wait for without
// such a watcher.
func (r *watcherRegistry) expectWrite(path string) (wait func(written bool)) {
	path = filepath.Clean(path)
	type expectation struct {
		d  *dirWatcher
		ch chan struct{}
	}
	var es []expectation
	r.mu.Lock()
	for _, d := range r.m {
		if d.sees(path) {
			es = append(es, expectation{d, d.expect(path)})
		}
	}
	r.mu.Unlock()
	return func(written bool) {
		if len(es) == 0 {
			return
		}
		t := time.NewTimer(writeSettle)
		defer t.Stop()
		for _, e := range es {
			if written {
				select {
				case <-e.ch:
					continue
				case <-e.d.done:
				case <-t.C:
				}
			}
			e.d.forget(path, e.ch)
		}
	}
}

func (r *watcherRegistry) closeAll() {
	r.mu.Lock()
	ws := r.m
	r.m = map[string]*dirWatcher{}
	r.mu.Unlock()
	for _, d := range ws {
		d.close()
	}
}

func (f *filesystemService) CreateWatcher(_ context.Context, req *connect.Request[pb.CreateWatcherRequest]) (*connect.Response[pb.CreateWatcherResponse], error) {
	acct, err := f.fsAccount(req.Header())
	if err != nil {
		return nil, err
	}
	d, err := newDirWatcher(acct.resolvePath(req.Msg.GetPath()), req.Msg.GetRecursive(), req.Msg.GetIncludeEntry(), req.Msg.GetAllowNetworkMounts())
	if err != nil {
		return nil, err
	}
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	id := hex.EncodeToString(b)
	r := f.s.watchers
	r.mu.Lock()
	r.m[id] = d
	r.mu.Unlock()
	return connect.NewResponse(&pb.CreateWatcherResponse{WatcherId: id}), nil
}

func (f *filesystemService) GetWatcherEvents(_ context.Context, req *connect.Request[pb.GetWatcherEventsRequest]) (*connect.Response[pb.GetWatcherEventsResponse], error) {
	d, err := f.s.watchers.get(req.Msg.GetWatcherId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.GetWatcherEventsResponse{Events: d.out.take()}), nil
}

func (f *filesystemService) RemoveWatcher(_ context.Context, req *connect.Request[pb.RemoveWatcherRequest]) (*connect.Response[pb.RemoveWatcherResponse], error) {
	r := f.s.watchers
	d, err := r.get(req.Msg.GetWatcherId())
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	delete(r.m, req.Msg.GetWatcherId())
	r.mu.Unlock()
	d.close()
	return connect.NewResponse(&pb.RemoveWatcherResponse{}), nil
}
