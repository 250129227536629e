package daemon

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/egress"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/image"
	"github.com/ember-sandbox/ember/internal/network"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/snapshot"
	"github.com/ember-sandbox/ember/internal/template"
)

// netAdapter presents network.Manager as sandbox.Network.
type netAdapter struct {
	m     *network.Manager
	px    *egress.Proxy // the node's egress proxy: policies of the proxied slots
	mu    sync.Mutex
	slots map[int]*network.Slot
}

func (a *netAdapter) keep(s *network.Slot, e sandbox.Egress) sandbox.Slot {
	a.mu.Lock()
	a.slots[s.Index] = s
	a.mu.Unlock()
	if a.px != nil {
		a.px.Set(s.GuestIP, egressPolicy(e))
	}
	return sandbox.Slot{Index: s.Index, NetNSPath: s.NetNSPath, GuestIP: s.GuestIP}
}

func slotOptions(e sandbox.Egress) network.SlotOptions {
	return network.SlotOptions{AllowInternet: e.AllowInternet, AllowOut: e.AllowOut, DenyOut: e.DenyOut,
		Proxy: e.Proxied(), ProxyOnly: e.Upstream != nil}
}

func (a *netAdapter) Acquire(ctx context.Context, egress sandbox.Egress) (sandbox.Slot, error) {
	s, err := a.m.Acquire(ctx, slotOptions(egress))
	if err != nil {
		return sandbox.Slot{}, err
	}
	return a.keep(s, egress), nil
}

func (a *netAdapter) Adopt(index int, egress sandbox.Egress) (sandbox.Slot, error) {
	s, err := a.m.Adopt(index, slotOptions(egress))
	if err != nil {
		return sandbox.Slot{}, err
	}
	return a.keep(s, egress), nil
}

// Update replaces the egress rules of a held slot (sandbox.Manager.UpdateNetwork).
func (a *netAdapter) Update(ctx context.Context, index int, e sandbox.Egress) error {
	a.mu.Lock()
	s := a.slots[index]
	a.mu.Unlock()
	if s == nil {
		return fmt.Errorf("network slot %d is not held: %w", index, errdefs.ErrNotFound)
	}
	var old *egress.Policy
	if a.px != nil && e.Proxied() { // the policy first: the redirect may start with the update
		old = a.px.Policy(s.GuestIP)
		a.px.Set(s.GuestIP, egressPolicy(e))
	}
	if err := a.m.Update(ctx, s, slotOptions(e)); err != nil {
		if a.px != nil && e.Proxied() {
			a.px.Set(s.GuestIP, old) // the old rules stay in force
		}
		return err
	}
	if a.px != nil {
		a.px.Set(s.GuestIP, egressPolicy(e))
	}
	return nil
}

func (a *netAdapter) Release(ctx context.Context, index int) error {
	a.mu.Lock()
	s := a.slots[index]
	delete(a.slots, index)
	a.mu.Unlock()
	if s == nil {
		return nil
	}
	if a.px != nil {
		a.px.Set(s.GuestIP, nil)
	}
	return a.m.Release(ctx, s)
}

func (a *netAdapter) Reconcile(ctx context.Context, keep []int) error {
	return a.m.Reconcile(ctx, keep)
}

// builderAdapter presents template.Builder as sandbox.RootFSBuilder: a Debian suite
// (debootstrap) or an image from a registry or an archive. Image settings come from the
// environment until the daemon has flags for them:
//
//	EMBER_IMAGE_ALIASES       REF=TARGET,...  (TARGET an image reference or template:NAME;
//	                          e2bdev/base=template:base is built in)
//	EMBER_REGISTRY_MIRRORS    REGISTRY=MIRROR,...  (docker.io=mirror.local:5000)
//	EMBER_INSECURE_REGISTRIES HOST[:PORT],...  (plain HTTP)
//	EMBER_DEFAULT_REGISTRY    registry for references without one (docker.io)
//	EMBER_MAX_LAYER_BYTES, EMBER_MAX_IMAGE_BYTES  unpacked size limits
//
// Layers live in <data-dir>/layers, beside <data-dir>/templates (hard links need one
// filesystem); the data dir is found from the rootfs destination the Manager gives.
type builderAdapter struct {
	b       *template.Builder
	dataDir string   // "" = found from the first rootfs destination
	allow   []string // registries allowed on private addresses (--registry-allow)
	once    sync.Once
	img     template.ImageConfig
	err     error
}

func (a *builderAdapter) BuildRootFS(ctx context.Context, req sandbox.BuildRequest, dest string, progress func(string)) (sandbox.RootFSInfo, error) {
	src, ok := imageSource(req)
	cfg, err := a.imageConfig(dest)
	if err != nil {
		return sandbox.RootFSInfo{}, err
	}
	if !ok {
		return a.debian(ctx, cfg, dest, progress)
	}
	if src.Ref != "" {
		resolved := cfg.Resolver.Resolve(src.Ref)
		if name, ok := strings.CutPrefix(resolved, "template:"); ok {
			if name != "base" {
				return sandbox.RootFSInfo{}, fmt.Errorf("image %s is an alias of template %q; only the base template can stand in for an image: %w", src.Ref, name, errdefs.ErrInvalid)
			}
			if progress != nil {
				progress(fmt.Sprintf("image %s is ember's base template here (no registry needed)", src.Ref))
			}
			return a.debian(ctx, cfg, dest, progress)
		}
		if resolved != src.Ref && progress != nil {
			progress(fmt.Sprintf("image %s: using %s", src.Ref, resolved))
		}
		src.Ref = resolved
	}
	defs, stack, err := a.b.BuildFromImage(ctx, cfg, src, dest, progress)
	if err != nil {
		return sandbox.RootFSInfo{}, err
	}
	return sandbox.RootFSInfo{Env: defs.Env, User: defs.User, Workdir: defs.Workdir, StartCmd: defs.StartCmd, Lowers: stack.Lowers}, nil
}

func (a *builderAdapter) debian(ctx context.Context, cfg template.ImageConfig, dest string, progress func(string)) (sandbox.RootFSInfo, error) {
	stack, err := a.b.BuildDebian(ctx, cfg, dest, progress)
	return sandbox.RootFSInfo{Lowers: stack.Lowers}, err
}

// CollectLayers implements sandbox.LayerCollector: the layer store's GC.
func (a *builderAdapter) CollectLayers(ctx context.Context, keep []string) ([]string, error) {
	if a.dataDir == "" {
		return nil, nil
	}
	cfg, err := a.imageConfig("")
	if err != nil {
		return nil, err
	}
	return cfg.Layers.GC(keep)
}

// TemplateFor implements build.TemplateResolver: an image reference aliased to a local
// template (E2B's e2bdev/base is ember's base, plus EMBER_IMAGE_ALIASES).
func (a *builderAdapter) TemplateFor(ref string) (string, bool) {
	aliases, err := parseMap("EMBER_IMAGE_ALIASES")
	if err != nil {
		aliases = nil
	}
	r := &image.Resolver{Aliases: aliases}
	return strings.CutPrefix(r.Resolve(ref), "template:")
}

// imageSource reads the image a build request names, if any.
func imageSource(req sandbox.BuildRequest) (template.ImageSource, bool) {
	src := template.ImageSource{Ref: req.FromImage, Archive: req.FromArchive, Insecure: req.Insecure}
	if req.Auth != nil {
		src.Auth = &image.Auth{Username: req.Auth.Username, Password: req.Auth.Password, Token: req.Auth.Token}
	}
	switch {
	case src.Ref != "" || src.Archive != "":
	case strings.HasPrefix(req.From, "docker://"):
		src.Ref = strings.TrimPrefix(req.From, "docker://")
	case strings.HasPrefix(req.From, "docker+http://"):
		src.Ref, src.Insecure = strings.TrimPrefix(req.From, "docker+http://"), true
	case strings.HasPrefix(req.From, "archive:"):
		src.Archive = strings.TrimPrefix(req.From, "archive:")
	default:
		return src, false
	}
	return src, true
}

func (a *builderAdapter) imageConfig(dest string) (template.ImageConfig, error) {
	a.once.Do(func() {
		dataDir := a.dataDir
		if dataDir == "" {
			dataDir = filepath.Dir(filepath.Dir(filepath.Dir(dest))) // <data-dir>/templates/<name>/rootfs-<id>
		}
		st := &image.Store{Root: datadir.Layers(dataDir), MaxLayerBytes: template.DefaultMaxLayerBytes, MaxImageBytes: template.DefaultMaxImageBytes, MaxLayerEntries: template.DefaultMaxLayerEntries}
		for _, v := range []struct {
			env string
			p   *int64
		}{{"EMBER_MAX_LAYER_BYTES", &st.MaxLayerBytes}, {"EMBER_MAX_IMAGE_BYTES", &st.MaxImageBytes}} {
			if s := os.Getenv(v.env); s != "" {
				n, err := strconv.ParseInt(s, 10, 64)
				if err != nil || n < 0 {
					a.err = fmt.Errorf("%s: %q is not a byte count: %w", v.env, s, errdefs.ErrInvalid)
					return
				}
				*v.p = n
			}
		}
		r := &image.Resolver{DefaultRegistry: os.Getenv("EMBER_DEFAULT_REGISTRY"), Allow: a.allow}
		var err error
		if r.Aliases, err = parseMap("EMBER_IMAGE_ALIASES"); err != nil {
			a.err = err
			return
		}
		mirrors, err := parseMap("EMBER_REGISTRY_MIRRORS")
		if err != nil {
			a.err = err
			return
		}
		r.Mirrors = map[string]string{}
		for k, v := range mirrors {
			if k == "docker.io" {
				k = "index.docker.io"
			}
			r.Mirrors[k] = v
		}
		for _, h := range strings.Split(os.Getenv("EMBER_INSECURE_REGISTRIES"), ",") {
			if h = strings.TrimSpace(h); h != "" {
				r.Insecure = append(r.Insecure, h)
			}
		}
		a.err = st.Cleanup()
		a.img = template.ImageConfig{Layers: st, Resolver: r}
	})
	return a.img, a.err
}

func parseMap(env string) (map[string]string, error) {
	m := map[string]string{}
	for _, kv := range strings.Split(os.Getenv(env), ",") {
		if kv = strings.TrimSpace(kv); kv == "" {
			continue
		}
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" || v == "" {
			return nil, fmt.Errorf("%s: %q is not KEY=VALUE: %w", env, kv, errdefs.ErrInvalid)
		}
		m[k] = v
	}
	return m, nil
}

// imageAdapter stores exported checkpoint images (flat directories of regular files, in the
// driver's format) in the snapshot store.
type imageAdapter struct {
	s *snapshot.Store
	// private: this node is the backend's only writer (the local backend), so collecting
	// unreferenced chunks cannot remove chunks another node's save in progress needs.
	private bool
}

func (a *imageAdapter) Save(ctx context.Context, id, dir string) error {
	_, err := a.s.Save(ctx, id, dir)
	return err
}

func (a *imageAdapter) Fetch(ctx context.Context, id, dir string, unpack func(ctx context.Context, src, dst string) error) error {
	return a.s.Fetch(ctx, id, dir, snapshot.FetchImport(unpack))
}

func (a *imageAdapter) Delete(ctx context.Context, id string) error { return a.s.Delete(ctx, id) }

func (a *imageAdapter) Exists(ctx context.Context, id string) (bool, error) {
	_, err := a.s.Stat(ctx, id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return false, nil
	}
	return err == nil, err
}

func (a *imageAdapter) Adopt(ctx context.Context, id, dir string) error {
	return a.s.Adopt(ctx, id, dir)
}

// Collect runs the store's GC on a private backend. A bucket other nodes may write is left
// alone: its GC needs a cluster-wide view of the saves in flight.
func (a *imageAdapter) Collect(ctx context.Context) error {
	if !a.private {
		return nil
	}
	_, err := a.s.GC(ctx)
	return err
}

func parsePrefix(s string) (netip.Prefix, error) {
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return p, fmt.Errorf("network.cidr: %w", err)
	}
	return p, nil
}
