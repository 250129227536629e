package image

import (
	"archive/tar"
	"bufio"
	"compress/gzip"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/klauspost/compress/zstd"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Auth is a registry credential given with a build request.
type Auth struct {
	Username, Password string
	// Token is a bearer (registry) token; used instead of a username and password.
	Token string
}

// Resolver finds images: a reference is first looked up in Aliases (exact reference, then the
// repository without tag), then its registry is replaced by a mirror when Mirrors has one.
type Resolver struct {
	// Aliases maps an image reference to another reference, or to "template:NAME" for a local
	// template (the caller resolves those; see Resolve).
	Aliases map[string]string
	// Mirrors maps a registry host (docker.io is "index.docker.io") to a mirror host.
	Mirrors map[string]string
	// Insecure lists registry hosts reached over plain HTTP (and HTTPS without verification).
	Insecure []string
	// DefaultRegistry is used for references without a registry (default docker.io).
	DefaultRegistry string
	// Allow lists the registries (host[:port] as references name them; a host without a port
	// allows any of its ports) that may be on a loopback, private, link-local or metadata
	// address. Every other registry address is checked after resolution, on every connection
	// (redirects too), and refused (ErrInvalid): a pull runs on the host's network.
	Allow []string
	// Keychain supplies credentials; authn.DefaultKeychain (~/.docker/config.json) when nil.
	Keychain authn.Keychain
	// Transport for registry requests (it then does its own address checks); when nil, a
	// transport whose dialer refuses the addresses Allow does not list.
	Transport http.RoundTripper
}

// DefaultAliases are the built-in aliases: E2B's fromBaseImage() names e2bdev/base, which is
// ember's own base template.
var DefaultAliases = map[string]string{
	"e2bdev/base":        "template:base",
	"e2bdev/base:latest": "template:base",
}

// Resolve applies the aliases to ref. A result "template:NAME" names a local template.
func (r *Resolver) Resolve(ref string) string {
	for i := 0; i < 8; i++ { // aliases may chain, but not loop
		next, ok := lookupAlias(r.Aliases, ref)
		if !ok {
			next, ok = lookupAlias(DefaultAliases, ref)
		}
		if !ok || next == ref {
			return ref
		}
		ref = next
		if strings.HasPrefix(ref, "template:") {
			return ref
		}
	}
	return ref
}

func lookupAlias(m map[string]string, ref string) (string, bool) {
	if v, ok := m[ref]; ok {
		return v, true
	}
	if i := strings.LastIndex(ref, ":"); i > 0 && !strings.Contains(ref[i:], "/") {
		if v, ok := m[ref[:i]]; ok {
			return v, true
		}
	}
	return "", false
}

// Pull returns the image ref names (linux/amd64 of a multi-platform index). insecure reaches
// its registry over plain HTTP. Nothing is downloaded but the manifest and config: layers are
// fetched as the store unpacks them.
func (r *Resolver) Pull(ctx context.Context, ref string, insecure bool, auth *Auth) (v1.Image, error) {
	opts := []name.Option{}
	if r.DefaultRegistry != "" {
		opts = append(opts, name.WithDefaultRegistry(r.DefaultRegistry))
	}
	parsed, err := name.ParseReference(ref, opts...)
	if err != nil {
		return nil, fmt.Errorf("image reference %q: %v: %w", ref, err, errdefs.ErrInvalid)
	}
	host := parsed.Context().RegistryStr()
	if m := r.Mirrors[host]; m != "" {
		host = m
	}
	if insecure || r.isInsecure(host) {
		opts = append(opts, name.Insecure)
	}
	reg, err := name.NewRegistry(host, opts...)
	if err != nil {
		return nil, fmt.Errorf("registry %q: %v: %w", host, err, errdefs.ErrInvalid)
	}
	repo := reg.Repo(parsed.Context().RepositoryStr())
	var target name.Reference
	switch p := parsed.(type) {
	case name.Tag:
		target = repo.Tag(p.TagStr())
	case name.Digest:
		target = repo.Digest(p.DigestStr())
	}
	kc := r.Keychain
	if kc == nil {
		kc = authn.DefaultKeychain
	}
	ropts := []remote.Option{remote.WithContext(ctx), remote.WithPlatform(v1.Platform{OS: "linux", Architecture: "amd64"})}
	tr := r.Transport
	if tr == nil {
		tr = r.guardedTransport()
	}
	if auth != nil && (auth.Username != "" || auth.Token != "") {
		ropts = append(ropts, remote.WithAuth(&authn.Basic{Username: auth.Username, Password: auth.Password}))
		if auth.Token != "" {
			ropts[len(ropts)-1] = remote.WithAuth(&authn.Bearer{Token: auth.Token})
		}
	} else {
		// The operator's credentials for this registry: sent to it (or a token service of
		// its own domain) only, never to another host its challenge or a redirect names.
		a, err := kc.Resolve(reg)
		if err != nil {
			return nil, fmt.Errorf("registry %s: credentials: %v: %w", host, err, errdefs.ErrUnavailable)
		}
		if a != authn.Anonymous {
			tr = &credGuard{base: tr, registry: reg.RegistryStr()}
		}
		ropts = append(ropts, remote.WithAuth(a))
	}
	ropts = append(ropts, remote.WithTransport(tr))
	img, err := remote.Image(target, ropts...)
	if err != nil {
		return nil, fmt.Errorf("pull %s from registry %s: %w", ref, host, classify(err))
	}
	return img, nil
}

func (r *Resolver) isInsecure(host string) bool {
	for _, h := range r.Insecure {
		if h == host {
			return true
		}
	}
	return false
}

// classify wraps registry, auth and network errors in ember's categories. What a registry
// answered is said by its status code (and error codes), never by its body: the build status
// must not echo what any address answered.
func classify(err error) error {
	var re *refusedError
	if errors.As(err, &re) {
		return fmt.Errorf("%v: %w", re, errdefs.ErrInvalid)
	}
	var ce *credError
	if errors.As(err, &ce) {
		return fmt.Errorf("%v: %w", ce, errdefs.ErrUnauthorized)
	}
	var te *transport.Error
	if errors.As(err, &te) {
		msg := fmt.Sprintf("the registry answered %d %s", te.StatusCode, http.StatusText(te.StatusCode))
		if te.Request != nil && te.Request.URL != nil {
			msg = fmt.Sprintf("%s %s: %s", te.Request.Method, te.Request.URL.Redacted(), msg)
		}
		var codes []string
		for _, d := range te.Errors {
			codes = append(codes, string(d.Code))
		}
		if len(codes) > 0 {
			msg += " (" + strings.Join(codes, ", ") + ")"
		}
		switch te.StatusCode {
		case http.StatusUnauthorized, http.StatusForbidden:
			return fmt.Errorf("%s: %w", msg, errdefs.ErrUnauthorized)
		case http.StatusNotFound:
			return fmt.Errorf("%s: %w", msg, errdefs.ErrNotFound)
		case http.StatusTooManyRequests:
			return fmt.Errorf("%s: %w", msg, errdefs.ErrExhausted)
		}
		for _, d := range te.Errors {
			switch d.Code {
			case transport.ManifestUnknownErrorCode, transport.NameUnknownErrorCode, transport.BlobUnknownErrorCode:
				return fmt.Errorf("%s: %w", msg, errdefs.ErrNotFound)
			case transport.UnauthorizedErrorCode, transport.DeniedErrorCode:
				return fmt.Errorf("%s: %w", msg, errdefs.ErrUnauthorized)
			}
		}
		return fmt.Errorf("%s: %w", msg, errdefs.ErrUnavailable)
	}
	var ne net.Error
	var oe *net.OpError
	if errors.As(err, &ne) || errors.As(err, &oe) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("registry unreachable: %v: %w", err, errdefs.ErrUnavailable)
	}
	for _, c := range []error{errdefs.ErrInvalid, errdefs.ErrExhausted, errdefs.ErrCorrupt, errdefs.ErrNotFound, errdefs.ErrUnavailable, errdefs.ErrUnauthorized, context.Canceled, context.DeadlineExceeded} {
		if errors.Is(err, c) {
			return err
		}
	}
	if strings.Contains(err.Error(), "dial tcp") || strings.Contains(err.Error(), "no such host") || strings.Contains(err.Error(), "connection refused") {
		return fmt.Errorf("registry unreachable: %v: %w", err, errdefs.ErrUnavailable)
	}
	return err
}

// OpenArchive opens an image archive: a `docker save` tarball (manifest.json) or an OCI image
// layout tarball (index.json; extracted into scratch, which the caller removes). The first
// image of the archive (linux/amd64 when an index has several) is returned.
func OpenArchive(file, scratch string) (v1.Image, error) {
	names, err := archiveNames(file)
	if err != nil {
		return nil, err
	}
	switch {
	case names["manifest.json"]:
		img, err := tarball.ImageFromPath(file, nil)
		if err != nil {
			return nil, fmt.Errorf("archive %s: %v: %w", file, err, errdefs.ErrInvalid)
		}
		return img, nil
	case names["index.json"]:
		if err := extractLayout(file, scratch); err != nil {
			return nil, err
		}
		p, err := layout.FromPath(scratch)
		if err != nil {
			return nil, fmt.Errorf("archive %s: %v: %w", file, err, errdefs.ErrInvalid)
		}
		idx, err := p.ImageIndex()
		if err != nil {
			return nil, fmt.Errorf("archive %s: %v: %w", file, err, errdefs.ErrInvalid)
		}
		return firstImage(idx, file)
	}
	return nil, fmt.Errorf("archive %s: neither a docker save tarball (manifest.json) nor an OCI layout (index.json): %w", file, errdefs.ErrInvalid)
}

func firstImage(idx v1.ImageIndex, file string) (v1.Image, error) {
	m, err := idx.IndexManifest()
	if err != nil {
		return nil, fmt.Errorf("archive %s: %v: %w", file, err, errdefs.ErrInvalid)
	}
	var pick *v1.Descriptor
	for i := range m.Manifests {
		d := &m.Manifests[i]
		if d.Platform != nil && (d.Platform.OS != "linux" || d.Platform.Architecture != "amd64") {
			continue
		}
		pick = d
		break
	}
	if pick == nil {
		return nil, fmt.Errorf("archive %s: no linux/amd64 image: %w", file, errdefs.ErrInvalid)
	}
	if pick.MediaType.IsIndex() {
		child, err := idx.ImageIndex(pick.Digest)
		if err != nil {
			return nil, fmt.Errorf("archive %s: %v: %w", file, err, errdefs.ErrInvalid)
		}
		return firstImage(child, file)
	}
	img, err := idx.Image(pick.Digest)
	if err != nil {
		return nil, fmt.Errorf("archive %s: %v: %w", file, err, errdefs.ErrInvalid)
	}
	return img, nil
}

func archiveNames(file string) (map[string]bool, error) {
	if !filepath.IsAbs(file) {
		return nil, fmt.Errorf("archive %s: the path must be absolute: %w", file, errdefs.ErrInvalid)
	}
	f, err := os.Open(file)
	if err != nil {
		if os.IsNotExist(err) {
			return nil, fmt.Errorf("archive %s: %w", file, errdefs.ErrNotFound)
		}
		return nil, fmt.Errorf("archive %s: %w", file, err)
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("archive %s: not a regular file: %w", file, errdefs.ErrInvalid)
	}
	names := map[string]bool{}
	tr := tar.NewReader(bufio.NewReader(f))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return names, nil
		}
		if err != nil {
			return nil, fmt.Errorf("archive %s: not a tar file: %v: %w", file, err, errdefs.ErrInvalid)
		}
		names[path.Clean(h.Name)] = true
	}
}

// extractLayout writes an OCI layout tarball's oci-layout, index.json and blobs/sha256/<hex>
// into dir; nothing else, as regular files only, so the archive's names cannot place anything
// elsewhere. Blob contents are verified by go-containerregistry as they are read.
func extractLayout(file, dir string) error {
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := os.MkdirAll(filepath.Join(dir, "blobs", "sha256"), 0o700); err != nil {
		return err
	}
	tr := tar.NewReader(bufio.NewReader(f))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("archive %s: %v: %w", file, err, errdefs.ErrInvalid)
		}
		if h.Typeflag != tar.TypeReg {
			continue
		}
		n := path.Clean(strings.TrimPrefix(h.Name, "./"))
		var out string
		switch {
		case n == "oci-layout" || n == "index.json":
			out = filepath.Join(dir, n)
		case strings.HasPrefix(n, "blobs/sha256/"):
			hx := strings.TrimPrefix(n, "blobs/sha256/")
			if _, err := hex.DecodeString(hx); err != nil || len(hx) != 64 {
				continue
			}
			out = filepath.Join(dir, "blobs", "sha256", hx)
		default:
			continue
		}
		w, err := os.OpenFile(out, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if err != nil {
			return fmt.Errorf("archive %s: %s: %w", file, n, err)
		}
		_, err = io.Copy(w, tr)
		if cerr := w.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	}
}

// uncompress decompresses a layer blob by its magic bytes (gzip, zstd or none).
func uncompress(r io.Reader, _ v1.Layer) (io.ReadCloser, error) {
	br := bufio.NewReaderSize(r, 64*1024)
	magic, _ := br.Peek(4)
	switch {
	case len(magic) >= 2 && magic[0] == 0x1f && magic[1] == 0x8b:
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, fmt.Errorf("gzip: %v: %w", err, errdefs.ErrInvalid)
		}
		return zr, nil
	case len(magic) == 4 && magic[0] == 0x28 && magic[1] == 0xb5 && magic[2] == 0x2f && magic[3] == 0xfd:
		zr, err := zstd.NewReader(br)
		if err != nil {
			return nil, fmt.Errorf("zstd: %v: %w", err, errdefs.ErrInvalid)
		}
		return zr.IOReadCloser(), nil
	}
	return io.NopCloser(br), nil
}
