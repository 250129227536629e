package volume_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	osexec "os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/testutil"
	"github.com/ember-sandbox/ember/internal/volume"
)

type memStore struct {
	mu   sync.Mutex
	vols map[string]volume.Volume
}

func (s *memStore) PutVolume(_ context.Context, v *volume.Volume) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.vols[v.ID] = *v
	return nil
}

func (s *memStore) GetVolume(_ context.Context, id string) (*volume.Volume, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.vols[id]
	if !ok {
		return nil, fmt.Errorf("volume %q: %w", id, errdefs.ErrNotFound)
	}
	return &v, nil
}

func (s *memStore) DeleteVolume(_ context.Context, id string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.vols, id)
	return nil
}

func (s *memStore) ListVolumes(_ context.Context) ([]*volume.Volume, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*volume.Volume
	for _, v := range s.vols {
		v := v
		out = append(out, &v)
	}
	return out, nil
}

// open makes a Manager; with a disk limit (ext4 images) only as root.
func open(t *testing.T, limit bool, sizeMB int) (*volume.Manager, *memStore, string) {
	t.Helper()
	if limit {
		testutil.Need(t, os.Geteuid() == 0, "disk-limited volumes need root (loop mounts)")
	}
	dir := t.TempDir()
	st := &memStore{vols: map[string]volume.Volume{}}
	m, err := volume.Open(context.Background(), volume.Config{Dir: dir, Store: st, SizeMB: sizeMB, NoDiskLimit: !limit})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		vols, _ := st.ListVolumes(context.Background())
		for _, v := range vols {
			m.SetUsers(nil)
			_ = m.Destroy(context.Background(), v.Owner, v.ID)
		}
	})
	return m, st, dir
}

func TestCreateListGetDestroy(t *testing.T) {
	ctx := context.Background()
	m, _, _ := open(t, false, 0)
	a, err := m.Create(ctx, "", "data")
	if err != nil {
		t.Fatal(err)
	}
	if a.Token == "" || a.ID == "" {
		t.Fatalf("volume %+v: no id or token", a)
	}
	if _, err := m.Create(ctx, "", "data"); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "already exists") {
		t.Fatalf("duplicate name: %v, want a conflict", err)
	}
	if _, err := m.Create(ctx, "", "../x"); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("bad name: %v, want invalid", err)
	}
	b, err := m.Create(ctx, "", "other")
	if err != nil {
		t.Fatal(err)
	}
	vols, err := m.Volumes(ctx, "")
	if err != nil || len(vols) != 2 {
		t.Fatalf("list: %v %v", vols, err)
	}
	for _, key := range []string{a.ID, "data"} {
		got, err := m.Get(ctx, "", key)
		if err != nil || got.ID != a.ID {
			t.Fatalf("get %q: %+v %v", key, got, err)
		}
	}
	if _, err := m.Get(ctx, "", "nope"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("get unknown: %v", err)
	}
	m.SetUsers(func(_ context.Context, id string) ([]string, error) {
		if id == b.ID {
			return []string{"sbx1"}, nil
		}
		return nil, nil
	})
	if err := m.Destroy(ctx, "", b.ID); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("destroy while mounted: %v, want a conflict", err)
	}
	if err := m.Destroy(ctx, "", a.ID); err != nil {
		t.Fatal(err)
	}
	if err := m.Destroy(ctx, "", a.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("destroy twice: %v", err)
	}
	if _, err := os.Stat(m.DataDir(a.ID)); !os.IsNotExist(err) {
		t.Fatalf("destroyed volume's files remain: %v", err)
	}
}

func TestAuthorize(t *testing.T) {
	ctx := context.Background()
	m, _, _ := open(t, false, 0)
	v, _ := m.Create(ctx, "", "tok")
	w, _ := m.Create(ctx, "", "tok2")
	if _, err := m.Authorize(ctx, v.ID, v.Token); err != nil {
		t.Fatal(err)
	}
	for _, tok := range []string{"", "vol_x", w.Token} {
		if _, err := m.Authorize(ctx, v.ID, tok); !errors.Is(err, errdefs.ErrUnauthorized) {
			t.Fatalf("token %q: %v, want unauthorized", tok, err)
		}
	}
	if _, err := m.Authorize(ctx, "nope", v.Token); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("unknown volume: %v", err)
	}
}

func TestContent(t *testing.T) {
	ctx := context.Background()
	m, _, _ := open(t, false, 0)
	v, _ := m.Create(ctx, "", "c")
	u := func(n uint32) *uint32 { return &n }
	no, yes := false, true

	e, err := m.WriteFile(v, "/a.txt", strings.NewReader("hello"), volume.Attrs{UID: u(1000), GID: u(1000), Mode: u(0o640)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if e.Name != "a.txt" || e.Path != "/a.txt" || e.Type != volume.TypeFile || e.Size != 5 || e.Mode != 0o640 || e.UID != 1000 {
		t.Fatalf("entry %+v", e)
	}
	if _, err := m.WriteFile(v, "/a.txt", strings.NewReader("x"), volume.Attrs{}, &no); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("write without force over a file: %v", err)
	}
	if _, err := m.WriteFile(v, "/a.txt", strings.NewReader("bye"), volume.Attrs{}, &yes); err != nil {
		t.Fatal(err)
	}
	f, err := m.Open(v, "a.txt")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(f)
	f.Close()
	if string(b) != "bye" {
		t.Fatalf("read %q", b)
	}
	if _, err := m.WriteFile(v, "/no/such/dir/f", strings.NewReader("x"), volume.Attrs{}, nil); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("write into a missing dir: %v", err)
	}
	if _, err := m.WriteFile(v, "/made/by/force/f", strings.NewReader("x"), volume.Attrs{}, &yes); err != nil {
		t.Fatalf("write with force makes parents: %v", err)
	}
	if _, err := m.MakeDir(v, "/d", volume.Attrs{Mode: u(0o700)}, false); err != nil {
		t.Fatal(err)
	}
	if _, err := m.MakeDir(v, "/d", volume.Attrs{}, false); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("mkdir twice: %v", err)
	}
	if _, err := m.MakeDir(v, "/d", volume.Attrs{}, true); err != nil {
		t.Fatalf("mkdir -p of an existing dir: %v", err)
	}
	if _, err := m.MakeDir(v, "/x/y/z", volume.Attrs{}, false); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("mkdir without parents: %v", err)
	}
	if _, err := m.MakeDir(v, "/x/y/z", volume.Attrs{}, true); err != nil {
		t.Fatal(err)
	}
	entries, err := m.ListDir(v, "/", 1)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name)
	}
	sort.Strings(names)
	if strings.Join(names, ",") != "a.txt,d,made,x" {
		t.Fatalf("list / = %v", names)
	}
	deep, _ := m.ListDir(v, "/x", 3)
	if len(deep) != 2 || deep[1].Path != "/x/y/z" {
		t.Fatalf("list depth 3 = %+v", deep)
	}
	if _, err := m.ListDir(v, "/nope", 1); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("list missing: %v", err)
	}
	e, err = m.SetAttrs(v, "/a.txt", volume.Attrs{UID: u(1001), GID: u(1002), Mode: u(0o755)})
	if err != nil || e.UID != 1001 || e.GID != 1002 || e.Mode != 0o755 {
		t.Fatalf("set attrs: %+v %v", e, err)
	}
	if _, err := m.SetAttrs(v, "/nope", volume.Attrs{Mode: u(0o644)}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("set attrs of missing: %v", err)
	}
	if err := m.Remove(v, "/x"); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Stat(v, "/x"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("stat removed: %v", err)
	}
	if err := m.Remove(v, "/x"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("remove missing: %v", err)
	}
	if err := m.Remove(v, "/"); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("remove root: %v", err)
	}
	root, err := m.Stat(v, "/")
	if err != nil || root.Type != volume.TypeDirectory {
		t.Fatalf("stat root: %+v %v", root, err)
	}
}

// A sandbox can put any symlink in its volume: the content API must never follow one out of
// the volume, and `..` is refused before any lookup.
func TestTraversalRefused(t *testing.T) {
	ctx := context.Background()
	m, _, _ := open(t, false, 0)
	v, _ := m.Create(ctx, "", "t")
	outside := t.TempDir()
	secret := filepath.Join(outside, "secret")
	if err := os.WriteFile(secret, []byte("host secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	data := m.DataDir(v.ID)
	// What a sandbox could write into its volume.
	for name, target := range map[string]string{"abs": outside, "absfile": secret, "rel": "../../../../../../../../" + outside, "inside": "sub"} {
		if err := os.Symlink(target, filepath.Join(data, name)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(data, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(data, "sub", "ok"), []byte("ok"), 0o644); err != nil {
		t.Fatal(err)
	}
	refused := func(what string, err error) {
		t.Helper()
		if err == nil {
			t.Fatalf("%s: allowed, want refused", what)
		}
		if !errors.Is(err, errdefs.ErrInvalid) && !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("%s: %v, want invalid or not found", what, err)
		}
	}
	for _, p := range []string{"../etc/passwd", "/a/../../etc", "..", "/x/.."} {
		_, err := m.Stat(v, p)
		if !errors.Is(err, errdefs.ErrInvalid) {
			t.Fatalf("stat %q: %v, want invalid", p, err)
		}
	}
	_, err := m.Open(v, "/absfile")
	refused("read through an absolute symlink", err)
	_, err = m.Open(v, "/abs/secret")
	refused("read under an absolute dir symlink", err)
	_, err = m.Open(v, "/rel/secret")
	refused("read under a relative escaping symlink", err)
	_, err = m.WriteFile(v, "/abs/new", strings.NewReader("x"), volume.Attrs{}, nil)
	refused("write under a symlink out", err)
	_, err = m.WriteFile(v, "/absfile", strings.NewReader("pwned"), volume.Attrs{}, nil)
	refused("write through a symlink (last component)", err)
	_, err = m.ListDir(v, "/abs", 1)
	refused("list through a symlink out", err)
	_, err = m.MakeDir(v, "/abs/d", volume.Attrs{}, true)
	refused("mkdir -p through a symlink out", err)
	mode := uint32(0o777)
	_, err = m.SetAttrs(v, "/absfile", volume.Attrs{Mode: &mode})
	refused("chmod through a symlink", err)
	if err := m.Remove(v, "/abs"); err != nil { // removes the link itself
		t.Fatalf("remove a symlink: %v", err)
	}
	if b, err := os.ReadFile(secret); err != nil || string(b) != "host secret" {
		t.Fatalf("the host file changed: %q %v", b, err)
	}
	if fi, _ := os.Stat(secret); fi.Mode().Perm() != 0o600 {
		t.Fatalf("the host file's mode changed: %v", fi.Mode())
	}
	if _, err := os.Stat(outside); err != nil {
		t.Fatalf("the outside dir is gone: %v", err)
	}
	// A link that stays inside is fine.
	f, err := m.Open(v, "/inside/ok")
	if err != nil {
		t.Fatalf("read through an inside link: %v", err)
	}
	f.Close()
	e, err := m.Stat(v, "/absfile")
	if err != nil || e.Type != volume.TypeSymlink || e.Target != secret {
		t.Fatalf("stat of a link: %+v %v", e, err)
	}
}

// A volume's disk limit is an ext4 image: a write past it fails as a full volume, and the
// volume stays usable.
func TestDiskLimit(t *testing.T) {
	ctx := context.Background()
	m, _, _ := open(t, true, 16)
	v, err := m.Create(ctx, "", "small")
	if err != nil {
		t.Fatal(err)
	}
	_, err = m.WriteFile(v, "/big", bytes.NewReader(make([]byte, 32<<20)), volume.Attrs{}, nil)
	if !errors.Is(err, errdefs.ErrExhausted) {
		t.Fatalf("write past the limit: %v, want exhausted", err)
	}
	if err := m.Remove(v, "/big"); err != nil {
		t.Fatal(err)
	}
	if _, err := m.WriteFile(v, "/small", strings.NewReader("fits"), volume.Attrs{}, nil); err != nil {
		t.Fatal(err)
	}
	entries, _ := m.ListDir(v, "/", 1)
	if len(entries) != 1 {
		t.Fatalf("list / = %+v (lost+found must stay hidden)", entries)
	}
}

// Records and content survive a restart (a new Manager on the same store and directory), and
// the images are mounted again.
func TestReopen(t *testing.T) {
	ctx := context.Background()
	m, st, dir := open(t, os.Geteuid() == 0, 16)
	v, err := m.Create(ctx, "", "keep")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.WriteFile(v, "/f", strings.NewReader("kept"), volume.Attrs{}, nil); err != nil {
		t.Fatal(err)
	}
	if os.Geteuid() == 0 {
		// As after a host reboot: the image is not mounted.
		if err := exec("umount", filepath.Join(dir, v.ID, "mnt")); err != nil {
			t.Fatal(err)
		}
	}
	m2, err := volume.Open(ctx, volume.Config{Dir: dir, Store: st, NoDiskLimit: os.Geteuid() != 0})
	if err != nil {
		t.Fatal(err)
	}
	f, err := m2.Open(v, "/f")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(f)
	f.Close()
	if string(b) != "kept" {
		t.Fatalf("read %q after reopen", b)
	}
}

func exec(name string, args ...string) error {
	out, err := osexec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %v: %s", name, err, out)
	}
	return nil
}

// A volume resolved for a sandbox being created cannot be destroyed until the create is done
// (the sandbox is then recorded, and Users reports it).
func TestDestroyWaitsForResolvedMounts(t *testing.T) {
	ctx := context.Background()
	m, _, _ := open(t, false, 0)
	v, _ := m.Create(ctx, "", "r")
	if _, _, _, err := m.Resolve(ctx, "", "nosuch"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("resolve unknown: %v", err)
	}
	id, dir, release, err := m.Resolve(ctx, "", "r")
	if err != nil || id != v.ID || dir != m.DataDir(v.ID) {
		t.Fatalf("resolve: %s %s %v", id, dir, err)
	}
	if err := m.Destroy(ctx, "", v.ID); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("destroy during a create: %v, want a conflict", err)
	}
	release()
	release() // idempotent
	if err := m.Destroy(ctx, "", v.ID); err != nil {
		t.Fatal(err)
	}
}

// Two nodes' Managers on one shared directory and one store (a cluster: the directory is the
// s3fs mount of the bucket, the store etcd): a volume made through one is a directory of the
// shared filesystem, open to the sandbox's users; its content written through one is read
// through the other, and a destroy through the other removes it.
func TestSharedVolumes(t *testing.T) {
	ctx := context.Background()
	shared := t.TempDir()
	st := &memStore{vols: map[string]volume.Volume{}}
	node := func() *volume.Manager {
		m, err := volume.Open(ctx, volume.Config{Dir: t.TempDir(), Store: st, Shared: shared})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	m1, m2 := node(), node()
	v, err := m1.Create(ctx, "", "data")
	if err != nil {
		t.Fatal(err)
	}
	if m1.DataDir(v.ID) != filepath.Join(shared, v.ID) || m2.DataDir(v.ID) != m1.DataDir(v.ID) {
		t.Fatalf("data dirs %s and %s, want %s", m1.DataDir(v.ID), m2.DataDir(v.ID), filepath.Join(shared, v.ID))
	}
	if fi, err := os.Stat(m1.DataDir(v.ID)); err != nil || fi.Mode().Perm() != 0o777 {
		t.Fatalf("the volume's directory: %v %v, want mode 0777", fi, err)
	}
	if _, err := m1.WriteFile(v, "/f", strings.NewReader("hello"), volume.Attrs{}, nil); err != nil {
		t.Fatal(err)
	}
	got, err := m2.Get(ctx, "", "data")
	if err != nil {
		t.Fatal(err)
	}
	f, err := m2.Open(got, "/f")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(f)
	f.Close()
	if string(b) != "hello" {
		t.Fatalf("read through the other node: %q", b)
	}
	if err := m2.Destroy(ctx, "", v.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(shared, v.ID)); !os.IsNotExist(err) {
		t.Fatalf("the volume's directory after destroy: %v", err)
	}
}

// limitStore is a cluster's store as the volume limits see it (volume.LimitStore).
type limitStore struct {
	*memStore
	holder  string
	limited map[string]bool
}

func (s *limitStore) HoldLimits(context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.holder = "me"
	return nil
}

// LetGoLimits drops only the caller's own registration: here, the other node's call keeps the
// holder's.
func (s *limitStore) LetGoLimits(context.Context) error { return nil }

func (s *limitStore) LimitHeld(context.Context) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.holder != "", nil
}

func (s *limitStore) MarkLimited(_ context.Context, id string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.limited[id] = true
	return nil
}

func (s *limitStore) Limited(_ context.Context, id string) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.limited[id], nil
}

// A cluster's volume made through a node that does not hold the limits is answered once the
// holder has bind-mounted its image over the volume's directory (here the directory every node
// sees is the holder's, as if the S3 server's): a write past the limit fails with no space;
// once the volume is destroyed, the holder drops its image.
func TestSharedVolumeLimits(t *testing.T) {
	testutil.RequireRoot(t) // loop and bind mounts
	ctx := context.Background()
	shared := t.TempDir()
	st := &limitStore{memStore: &memStore{vols: map[string]volume.Volume{}}, limited: map[string]bool{}}
	other, err := volume.Open(ctx, volume.Config{Dir: t.TempDir(), Store: st, Shared: shared, SizeMB: 16})
	if err != nil {
		t.Fatal(err)
	}
	// A volume made while no node held the limits keeps its files (and has no limit).
	old, err := other.Create(ctx, "", "old")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := other.WriteFile(old, "/f", strings.NewReader("kept"), volume.Attrs{}, nil); err != nil {
		t.Fatal(err)
	}
	holder, err := volume.Open(ctx, volume.Config{Dir: t.TempDir(), Store: st, Shared: shared, LimitDir: shared, SizeMB: 16})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(holder.Close)
	if b, err := os.ReadFile(filepath.Join(other.DataDir(old.ID), "f")); err != nil || string(b) != "kept" {
		t.Fatalf("a volume made before the holder: %q %v", b, err)
	}
	v, err := other.Create(ctx, "", "data")
	if err != nil {
		t.Fatal(err)
	}
	var st1, st2 unix.Stat_t
	if unix.Stat(filepath.Join(shared, v.ID), &st1) != nil || unix.Stat(shared, &st2) != nil || st1.Dev == st2.Dev {
		t.Fatalf("the volume's directory is not the image's mount once its create answered")
	}
	if fi, err := os.Stat(other.DataDir(v.ID)); err != nil || fi.Mode().Perm() != 0o777 {
		t.Fatalf("the volume's directory: %v %v, want mode 0777", fi, err)
	}
	if _, err := other.WriteFile(v, "/big", bytes.NewReader(make([]byte, 32<<20)), volume.Attrs{}, nil); !errors.Is(err, errdefs.ErrExhausted) {
		t.Fatalf("write past the limit: %v, want exhausted", err)
	}
	if err := other.Destroy(ctx, "", v.ID); err != nil {
		t.Fatal(err)
	}
	var statErr error
	testutil.EventuallyOr(t, 10*time.Second, func() bool {
		_, statErr = os.Stat(filepath.Join(shared, v.ID))
		return os.IsNotExist(statErr)
	}, func() string { return fmt.Sprintf("the destroyed volume's image is still mounted: %v", statErr) })
}
