// Package sandboxtest has test doubles for the sandbox Manager's dependencies, in the style of
// the real ones: a Driver whose instances are in-process envd stand-ins (reachable over real
// loopback TCP through the Rig's Dial), a Network of slots with the real one's single-use
// accounting, and a RootFS builder. They need no root, so the Manager, and the API edge over
// it, can be tested on their own. Checkpoints are real files: an instance's state (its files,
// envd's token) is written to the image directory and read back by Restore.
package sandboxtest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Rig wires a fake Driver and a fake Network together: the Network's slots name netns paths
// that the Driver's instances are started in, and Dial reaches the instance behind a slot's
// guest address.
type Rig struct {
	Driver  *Driver
	Network *Network
}

// NewRig returns a Rig with n network slots.
func NewRig(n int) *Rig {
	r := &Rig{Network: newNetwork(n)}
	r.Driver = &Driver{rig: r, insts: map[string]*Instance{}}
	return r
}

// Dial reaches envd of the instance running in the slot of addr's guest IP.
func (r *Rig) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, err
	}
	inst := r.Driver.byGuest(ap.Addr())
	if inst == nil {
		return nil, fmt.Errorf("fake dial %s: connection refused", addr)
	}
	var d net.Dialer
	return d.DialContext(ctx, "tcp", inst.ln.Addr().String())
}

// ---- network ----

// Network is a fake sandbox.Network: slots are indexes with a guest address each; acquiring
// a slot takes the lowest free one.
type Network struct {
	mu     sync.Mutex
	used   []bool
	egress map[int]sandbox.Egress
	// FailAcquire, when set, makes Acquire fail.
	FailAcquire error
}

func newNetwork(n int) *Network {
	return &Network{used: make([]bool, n), egress: map[int]sandbox.Egress{}}
}

func (n *Network) slot(i int) sandbox.Slot {
	return sandbox.Slot{Index: i, NetNSPath: fmt.Sprintf("/fake/netns/%d", i), GuestIP: netip.AddrFrom4([4]byte{10, 99, byte(i >> 8), byte(i)})}
}

// Acquire implements sandbox.Network.
func (n *Network) Acquire(ctx context.Context, egress sandbox.Egress) (sandbox.Slot, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.FailAcquire != nil {
		return sandbox.Slot{}, n.FailAcquire
	}
	for i, u := range n.used {
		if !u {
			n.used[i] = true
			n.egress[i] = egress
			return n.slot(i), nil
		}
	}
	return sandbox.Slot{}, fmt.Errorf("no free network slot: %w", errdefs.ErrUnavailable)
}

// Adopt implements sandbox.Network.
func (n *Network) Adopt(index int, egress sandbox.Egress) (sandbox.Slot, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if index < 0 || index >= len(n.used) {
		return sandbox.Slot{}, fmt.Errorf("slot %d: %w", index, errdefs.ErrNotFound)
	}
	n.used[index] = true
	n.egress[index] = egress
	return n.slot(index), nil
}

// Update replaces a held slot's egress rules (sandbox.Manager.UpdateNetwork).
func (n *Network) Update(ctx context.Context, index int, e sandbox.Egress) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if index < 0 || index >= len(n.used) || !n.used[index] {
		return fmt.Errorf("slot %d: %w", index, errdefs.ErrNotFound)
	}
	n.egress[index] = e
	return nil
}

// Egress returns the rules a held slot has.
func (n *Network) Egress(index int) sandbox.Egress {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.egress[index]
}

// Release implements sandbox.Network.
func (n *Network) Release(ctx context.Context, index int) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if index >= 0 && index < len(n.used) {
		n.used[index] = false
	}
	return nil
}

// Reconcile implements sandbox.Network: every slot not in keep is released.
func (n *Network) Reconcile(ctx context.Context, keep []int) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	k := map[int]bool{}
	for _, i := range keep {
		k[i] = true
	}
	for i := range n.used {
		if !k[i] {
			n.used[i] = false
		}
	}
	return nil
}

// InUse returns the indexes of acquired slots.
func (n *Network) InUse() []int {
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []int
	for i, u := range n.used {
		if u {
			out = append(out, i)
		}
	}
	return out
}

// ---- driver ----

// Driver is a fake runtime.Driver. Each running instance serves envd's /health and /init and
// a tiny file API (GET/PUT /fake/files?path=) on a loopback listener.
type Driver struct {
	rig *Rig
	mu  sync.Mutex
	// insts are the instances the driver knows (running or stopped), by id.
	insts map[string]*Instance
	// Fail, when set, is consulted by every method with the method's name; a non-nil error is
	// returned from it.
	Fail func(op, id string) error
	// Image, when set, is called with "Checkpoint" or "Restore" and the image directory before
	// either runs; an error fails the call (an image that cannot be restored, say).
	Image func(op, imageDir string) error
	// Memory, when set, is the memory Stats reports for an instance (default 1 MiB).
	Memory func(id string) uint64
	// Calls counts calls by method name.
	calls map[string]int
	// layers: captured layers (capture.go).
	layers captureState
}

var _ runtime.Driver = (*Driver)(nil)

// Instance is one fake instance.
type Instance struct {
	ID    string
	Spec  runtime.Spec
	mu    sync.Mutex
	state runtime.State
	files map[string]string
	mem   map[string]string
	token string
	// starts are the process Starts envd answered, as "<command line> token=<access token>".
	starts []string
	ln     net.Listener
	srv    *http.Server
	done   chan struct{}
	exit   runtime.Exit
	// frozen: Freeze was called and Thaw not yet (the fake's instance keeps serving).
	frozen bool
	// prestarted: made by Prestart for preImage and not restored into yet.
	prestarted bool
	preImage   string
}

// image is what Checkpoint writes.
type image struct {
	Files map[string]string `json:"files"`
	// Mem stands for the instance's memory: kept by checkpoints, lost by a boot.
	Mem       map[string]string `json:"mem,omitempty"`
	Token     string            `json:"token"`
	Args      []string          `json:"args"`
	FilesOnly bool              `json:"filesOnly,omitempty"`
}

func (d *Driver) image(op, imageDir string) error {
	d.mu.Lock()
	f := d.Image
	d.mu.Unlock()
	if f != nil {
		return f(op, imageDir)
	}
	return nil
}

func (d *Driver) fail(op, id string) error {
	d.mu.Lock()
	if d.calls == nil {
		d.calls = map[string]int{}
	}
	d.calls[op]++
	f := d.Fail
	d.mu.Unlock()
	if f != nil {
		return f(op, id)
	}
	return nil
}

// Calls returns how often op was called.
func (d *Driver) Calls(op string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.calls[op]
}

func (d *Driver) byGuest(ip netip.Addr) *Instance {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, in := range d.insts {
		in.mu.Lock()
		running := in.state == runtime.StateRunning
		in.mu.Unlock()
		if !running {
			continue
		}
		var idx int
		if _, err := fmt.Sscanf(in.Spec.NetNSPath, "/fake/netns/%d", &idx); err == nil && d.rig.Network.slot(idx).GuestIP == ip {
			return in
		}
	}
	return nil
}

// Name implements runtime.Driver.
func (d *Driver) Name() string { return "fake" }

// Start implements runtime.Driver.
func (d *Driver) Start(ctx context.Context, spec runtime.Spec) error {
	if err := d.fail("Start", spec.ID); err != nil {
		return err
	}
	img := image{Files: map[string]string{}, Args: spec.Args}
	if spec.LayerFrom != "" {
		b, err := os.ReadFile(filepath.Join(spec.LayerFrom, "checkpoint.img"))
		if err != nil {
			return fmt.Errorf("fake: layer of %q: %v: %w", spec.LayerFrom, err, errdefs.ErrNotFound)
		}
		var from image
		if err := json.Unmarshal(b, &from); err != nil {
			return err
		}
		img.Files = from.Files // the files, not the memory or envd's token: a new boot
	}
	return d.run(spec, img)
}

// Restore implements runtime.Driver.
func (d *Driver) Restore(ctx context.Context, spec runtime.Spec, imageDir string) error {
	if err := d.fail("Restore", spec.ID); err != nil {
		return err
	}
	if err := d.image("Restore", imageDir); err != nil {
		return err
	}
	return d.restore(spec, imageDir)
}

func (d *Driver) restore(spec runtime.Spec, imageDir string) error {
	b, err := os.ReadFile(filepath.Join(imageDir, "checkpoint.img"))
	if err != nil {
		return fmt.Errorf("fake: restore image %q: %v: %w", imageDir, err, errdefs.ErrNotFound)
	}
	var img image
	if err := json.Unmarshal(b, &img); err != nil {
		return fmt.Errorf("fake: restore image: %w", err)
	}
	if img.FilesOnly {
		return fmt.Errorf("fake: restore: %s holds no memory image: %w", imageDir, errdefs.ErrInvalid)
	}
	if strings.Join(img.Args, " ") != strings.Join(spec.Args, " ") {
		return fmt.Errorf("fake: restore: args differ: %w", errdefs.ErrInvalid)
	}
	if spec.ConsumeImage {
		os.Remove(filepath.Join(imageDir, "checkpoint.img"))
	}
	return d.run(spec, img)
}

func (d *Driver) run(spec runtime.Spec, img image) error {
	if spec.ID == "" || spec.StateDir == "" || spec.RootFS == "" {
		return fmt.Errorf("fake: incomplete spec: %w", errdefs.ErrInvalid)
	}
	if _, err := os.Stat(spec.StateDir); err != nil {
		return fmt.Errorf("fake: state dir: %w", err)
	}
	d.mu.Lock()
	if old := d.insts[spec.ID]; old != nil && old.state == runtime.StateRunning {
		d.mu.Unlock()
		return fmt.Errorf("fake: instance %s already exists: %w", spec.ID, errdefs.ErrConflict)
	}
	d.mu.Unlock()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	if img.Files == nil {
		img.Files = map[string]string{}
	}
	if img.Mem == nil {
		img.Mem = map[string]string{}
	}
	in := &Instance{ID: spec.ID, Spec: spec, state: runtime.StateRunning, files: img.Files, mem: img.Mem, token: img.Token, ln: ln, done: make(chan struct{})}
	in.srv = &http.Server{Handler: http.HandlerFunc(in.serve), ReadHeaderTimeout: 5 * time.Second}
	go in.srv.Serve(ln)
	// A marker in the state dir, as a real driver leaves files there.
	os.WriteFile(filepath.Join(spec.StateDir, "instance"), []byte(spec.ID), 0o600)
	d.mu.Lock()
	d.insts[spec.ID] = in
	d.mu.Unlock()
	return nil
}

func (in *Instance) serve(w http.ResponseWriter, r *http.Request) {
	in.mu.Lock()
	defer in.mu.Unlock()
	authed := in.token == "" || r.Header.Get("X-Access-Token") == in.token
	switch {
	case r.URL.Path == "/health":
		w.WriteHeader(http.StatusNoContent)
	case r.URL.Path == "/init" && r.Method == http.MethodPost:
		if !authed {
			http.Error(w, "invalid or missing access token", http.StatusUnauthorized)
			return
		}
		var req struct {
			AccessToken string `json:"accessToken"`
		}
		json.NewDecoder(r.Body).Decode(&req)
		in.token = req.AccessToken
		w.WriteHeader(http.StatusNoContent)
	case r.URL.Path == "/process.Process/Start" && r.Method == http.MethodPost:
		// Recorded only; the stream ends at once with an error, as envd's streams end theirs
		// (Connect's end-of-stream message, so the connection stays usable).
		b, _ := io.ReadAll(r.Body)
		in.starts = append(in.starts, fmt.Sprintf("%q token=%s", b, r.Header.Get("X-Access-Token")))
		end := []byte(`{"error":{"code":"unimplemented","message":"fake envd runs no processes"}}`)
		w.Header().Set("Content-Type", r.Header.Get("Content-Type"))
		_, _ = w.Write(append([]byte{2, 0, 0, 0, byte(len(end))}, end...))
	case r.URL.Path == "/fake/files" || r.URL.Path == "/fake/mem":
		if !authed {
			http.Error(w, "invalid or missing access token", http.StatusUnauthorized)
			return
		}
		p := r.URL.Query().Get("path")
		store := in.files
		if r.URL.Path == "/fake/mem" {
			store = in.mem
		}
		if r.Method == http.MethodPut {
			b, _ := io.ReadAll(r.Body)
			store[p] = string(b)
			w.WriteHeader(http.StatusNoContent)
			return
		}
		v, ok := store[p]
		if !ok {
			http.Error(w, "no such file", http.StatusNotFound)
			return
		}
		io.WriteString(w, v)
	default:
		http.NotFound(w, r)
	}
}

// stop ends an instance with reason (idempotent).
func (in *Instance) stop(reason runtime.ExitReason) {
	in.mu.Lock()
	if in.state != runtime.StateRunning {
		in.mu.Unlock()
		return
	}
	in.state = runtime.StateStopped
	in.exit = runtime.Exit{Reason: reason, Code: -1, At: time.Now()}
	in.mu.Unlock()
	in.srv.Close()
	close(in.done)
}

func (d *Driver) get(id string) (*Instance, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	in := d.insts[id]
	if in == nil {
		return nil, fmt.Errorf("fake: instance %q: %w", id, errdefs.ErrNotFound)
	}
	return in, nil
}

// Checkpoint implements runtime.Driver.
func (d *Driver) Checkpoint(ctx context.Context, id, imageDir string, opts runtime.CheckpointOptions) error {
	if err := d.fail("Checkpoint", id); err != nil {
		return err
	}
	if err := d.image("Checkpoint", imageDir); err != nil {
		return err
	}
	in, err := d.get(id)
	if err != nil {
		return err
	}
	in.mu.Lock()
	if in.state != runtime.StateRunning {
		in.mu.Unlock()
		return fmt.Errorf("fake: %s is not running: %w", id, errdefs.ErrConflict)
	}
	if opts.FilesOnly && opts.LeaveRunning {
		in.mu.Unlock()
		return fmt.Errorf("fake: FilesOnly with LeaveRunning: %w", errdefs.ErrInvalid)
	}
	img := image{Files: map[string]string{}, Token: in.token, Args: in.Spec.Args, FilesOnly: opts.FilesOnly}
	for k, v := range in.files {
		img.Files[k] = v
	}
	if !opts.FilesOnly {
		img.Mem = map[string]string{}
		for k, v := range in.mem {
			img.Mem[k] = v
		}
	}
	b, _ := json.Marshal(img)
	in.mu.Unlock()
	if err := os.WriteFile(filepath.Join(imageDir, "checkpoint.img"), b, 0o600); err != nil {
		return err
	}
	if opts.FilesOnly {
		// The layer as a real driver's upper directory: the instance's files as host files.
		for p, v := range img.Files {
			f := filepath.Join(imageDir, "upper", filepath.Clean("/"+p))
			if err := os.MkdirAll(filepath.Dir(f), 0o755); err != nil {
				return err
			}
			if err := os.WriteFile(f, []byte(v), 0o644); err != nil {
				return err
			}
		}
		if err := os.MkdirAll(filepath.Join(imageDir, "upper"), 0o755); err != nil {
			return err
		}
	}
	if !opts.LeaveRunning {
		in.stop(runtime.ExitKilled)
	}
	return nil
}

// UpperDir implements runtime.UpperDirer: a filesystem-only checkpoint's files, as host files.
func (d *Driver) UpperDir(imageDir string) (string, error) {
	p := filepath.Join(imageDir, "upper")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("fake: %s holds no layer: %w", imageDir, errdefs.ErrNotFound)
	}
	return p, nil
}

// State implements runtime.Driver.
func (d *Driver) State(ctx context.Context, id string) (runtime.Status, error) {
	in, err := d.get(id)
	if err != nil {
		return runtime.Status{State: runtime.StateUnknown}, err
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	return runtime.Status{State: in.state, Frozen: in.frozen && in.state == runtime.StateRunning}, nil
}

// Freeze implements runtime.Driver: the instance is marked frozen (it keeps serving).
func (d *Driver) Freeze(ctx context.Context, id string) error {
	return d.setFrozen("Freeze", id, true)
}

// Thaw implements runtime.Driver.
func (d *Driver) Thaw(ctx context.Context, id string) error {
	return d.setFrozen("Thaw", id, false)
}

func (d *Driver) setFrozen(op, id string, frozen bool) error {
	if err := d.fail(op, id); err != nil {
		return err
	}
	in, err := d.get(id)
	if err != nil {
		return err
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.state != runtime.StateRunning {
		return fmt.Errorf("fake: %s %s: not running: %w", op, id, errdefs.ErrConflict)
	}
	in.frozen = frozen
	return nil
}

var _ runtime.MemoryReducer = (*Driver)(nil)

// ReduceMemory implements runtime.MemoryReducer: counted (Calls("ReduceMemory")); Memory may
// answer less afterwards.
func (d *Driver) ReduceMemory(ctx context.Context, id string) error {
	if err := d.fail("ReduceMemory", id); err != nil {
		return err
	}
	_, err := d.get(id)
	return err
}

// Stats implements runtime.Driver.
func (d *Driver) Stats(ctx context.Context, id string) (runtime.Stats, error) {
	if _, err := d.get(id); err != nil {
		return runtime.Stats{}, err
	}
	d.mu.Lock()
	mem := d.Memory
	d.mu.Unlock()
	b := uint64(1 << 20)
	if mem != nil {
		b = mem(id)
	}
	return runtime.Stats{MemoryBytes: b, Timestamp: time.Now()}, nil
}

// Kill implements runtime.Driver.
func (d *Driver) Kill(ctx context.Context, id string) error {
	in, err := d.get(id)
	if err != nil {
		return err
	}
	in.stop(runtime.ExitKilled)
	return nil
}

// Delete implements runtime.Driver.
func (d *Driver) Delete(ctx context.Context, id string) error {
	if err := d.fail("Delete", id); err != nil {
		return err
	}
	d.mu.Lock()
	in := d.insts[id]
	delete(d.insts, id)
	d.mu.Unlock()
	if in != nil {
		in.stop(runtime.ExitKilled)
	}
	return nil
}

// List implements runtime.Driver.
func (d *Driver) List(ctx context.Context) ([]string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	ids := make([]string, 0, len(d.insts))
	for id := range d.insts {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return ids, nil
}

// Release implements runtime.Driver (the fake keeps nothing in state dirs).
func (d *Driver) Release(ctx context.Context, stateDir string) error {
	return d.fail("Release", stateDir)
}

// Sweep implements runtime.Driver: every instance not in keep is deleted.
func (d *Driver) Sweep(ctx context.Context, keep []string) ([]string, error) {
	kept := map[string]bool{}
	for _, id := range keep {
		kept[id] = true
	}
	ids, _ := d.List(ctx)
	var removed []string
	for _, id := range ids {
		if !kept[id] {
			if err := d.Delete(ctx, id); err != nil {
				return removed, err
			}
			removed = append(removed, id)
		}
	}
	return removed, nil
}

// Wait implements runtime.Driver.
func (d *Driver) Wait(ctx context.Context, id string) (runtime.Exit, error) {
	in, err := d.get(id)
	if err != nil {
		return runtime.Exit{Reason: runtime.ExitKilled, Code: -1, At: time.Now()}, nil
	}
	select {
	case <-in.done:
		in.mu.Lock()
		defer in.mu.Unlock()
		return in.exit, nil
	case <-ctx.Done():
		return runtime.Exit{}, ctx.Err()
	}
}

// ExportImage implements runtime.Driver: the image's files, copied.
func (d *Driver) ExportImage(ctx context.Context, imageDir, dstDir string) error {
	if err := d.fail("ExportImage", ""); err != nil {
		return err
	}
	b, err := os.ReadFile(filepath.Join(imageDir, "checkpoint.img"))
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dstDir, "checkpoint.img"), b, 0o600)
}

// ImportImage implements runtime.Driver.
func (d *Driver) ImportImage(ctx context.Context, srcDir, imageDir string, opts runtime.ImportOptions) error {
	if err := d.fail("ImportImage", ""); err != nil {
		return err
	}
	b, err := os.ReadFile(filepath.Join(srcDir, "checkpoint.img"))
	if err != nil {
		return err
	}
	if opts.MaxBytes > 0 && int64(len(b)) > opts.MaxBytes {
		return fmt.Errorf("fake: image over %d bytes: %w", opts.MaxBytes, errdefs.ErrInvalid)
	}
	if err := os.MkdirAll(imageDir, 0o700); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(imageDir, "checkpoint.img"), b, 0o600)
}

// Exec implements runtime.Driver (not supported by the fake).
func (d *Driver) Exec(ctx context.Context, id string, args []string) ([]byte, int, error) {
	return nil, -1, errors.New("fake: exec not supported")
}

// Crash stops a running instance as if it died by itself (reason: killed, out of memory, ...).
func (d *Driver) Crash(id string, reason runtime.ExitReason) error {
	in, err := d.get(id)
	if err != nil {
		return err
	}
	in.stop(reason)
	return nil
}

// Running returns the ids of running instances.
func (d *Driver) Running() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []string
	for id, in := range d.insts {
		in.mu.Lock()
		if in.state == runtime.StateRunning {
			out = append(out, id)
		}
		in.mu.Unlock()
	}
	sort.Strings(out)
	return out
}

// Files returns a copy of a running instance's files.
func (d *Driver) Files(id string) map[string]string {
	in, err := d.get(id)
	if err != nil {
		return nil
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	out := map[string]string{}
	for k, v := range in.files {
		out[k] = v
	}
	return out
}

// WriteFile writes a file into a running instance (as a process in the sandbox would).
func (d *Driver) WriteFile(id, path, data string) error {
	in, err := d.get(id)
	if err != nil {
		return err
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.state != runtime.StateRunning {
		return fmt.Errorf("fake: %s not running: %w", id, errdefs.ErrConflict)
	}
	in.files[path] = data
	return nil
}

// Token returns envd's access token in a running instance.
func (d *Driver) Token(id string) string {
	in, err := d.get(id)
	if err != nil {
		return ""
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.token
}

// Close stops every instance (test cleanup).
func (d *Driver) Close() {
	d.mu.Lock()
	insts := make([]*Instance, 0, len(d.insts))
	for _, in := range d.insts {
		insts = append(insts, in)
	}
	d.mu.Unlock()
	for _, in := range insts {
		in.stop(runtime.ExitKilled)
	}
}

// ---- builder ----

// Builder is a fake sandbox.RootFSBuilder: it makes an empty directory.
type Builder struct{}

// BuildRootFS implements sandbox.RootFSBuilder.
func (Builder) BuildRootFS(ctx context.Context, req sandbox.BuildRequest, dest string, progress func(string)) (sandbox.RootFSInfo, error) {
	return sandbox.RootFSInfo{}, os.MkdirAll(filepath.Join(dest, "usr", "local", "bin"), 0o755)
}

// Starts returns the process Starts a running instance's envd was asked for, each as the
// request body (quoted) and " token=" the access token it carried.
func (d *Driver) Starts(id string) []string {
	in, err := d.get(id)
	if err != nil {
		return nil
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	return append([]string(nil), in.starts...)
}
