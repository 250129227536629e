// Command registry serves a local OCI registry for the SDK suite (test/sdk/run.sh): it listens on
// 127.0.0.1 (a free port), pushes one test image, prints "READY host:port" and serves until it is
// killed.
//
// The image, test/app:v1, is the cached debootstrap rootfs ($EMBER_CACHE_DIR/debootstrap/
// debootstrap-bookworm-*.tar, uncompressed) plus a small layer with /opt/app/hello.txt, and a
// config with Env (APP_MODE=from-image, PATH) and WorkingDir /opt/app. The blobs are kept on disk
// under -blobs (default: a temp dir removed at exit).
package main

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// HelloText is the content of /opt/app/hello.txt in the image's own layer.
const HelloText = "hello from the image layer\n"

func main() {
	blobs := flag.String("blobs", "", "directory for the registry's blobs, kept (default: a temp dir, removed at exit)")
	flag.Parse()
	if err := run(*blobs); err != nil {
		fmt.Fprintf(os.Stderr, "registry: %v\n", err)
		os.Exit(1)
	}
}

func run(blobs string) error {
	base, err := debootstrapTarball()
	if err != nil {
		return err
	}
	if blobs == "" {
		d, err := os.MkdirTemp("", "ember-sdk-registry-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(d)
		blobs = d
	} else if err := os.MkdirAll(blobs, 0o700); err != nil {
		return err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	quiet := log.New(io.Discard, "", 0)
	srv := &http.Server{
		Handler:           registry.New(registry.Logger(quiet), registry.WithBlobHandler(registry.NewDiskBlobHandler(blobs))),
		ReadHeaderTimeout: 10 * time.Second,
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	host := ln.Addr().String()

	img, err := testImage(base)
	if err != nil {
		return err
	}
	ref, err := name.ParseReference(host+"/test/app:v1", name.Insecure)
	if err != nil {
		return err
	}
	if err := remote.Write(ref, img); err != nil {
		return fmt.Errorf("push %s: %w", ref, err)
	}
	fmt.Printf("READY %s\n", host)

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

func debootstrapTarball() (string, error) {
	cache := os.Getenv("EMBER_CACHE_DIR")
	if cache == "" {
		return "", errors.New("EMBER_CACHE_DIR is not set (it holds debootstrap/debootstrap-bookworm-*.tar)")
	}
	m, _ := filepath.Glob(filepath.Join(cache, "debootstrap", "debootstrap-bookworm-*.tar"))
	if len(m) == 0 {
		return "", fmt.Errorf("no debootstrap tarball in %s/debootstrap (the base template build makes it)", cache)
	}
	return m[0], nil
}

func testImage(base string) (v1.Image, error) {
	rootfs, err := fileLayer(base)
	if err != nil {
		return nil, err
	}
	app, err := appLayer()
	if err != nil {
		return nil, err
	}
	img, err := mutate.AppendLayers(empty.Image, rootfs, app)
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	cf.Config = v1.Config{
		Env:        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "APP_MODE=from-image"},
		WorkingDir: "/opt/app",
	}
	return mutate.ConfigFile(img, cf)
}

// appLayer is /opt/app (owned by uid 1000, the template's `user`) with hello.txt.
func appLayer() (v1.Layer, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	now := time.Now()
	hdrs := []*tar.Header{
		{Name: "opt/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: now},
		{Name: "opt/app/", Typeflag: tar.TypeDir, Mode: 0o755, Uid: 1000, Gid: 1000, ModTime: now},
		{Name: "opt/app/hello.txt", Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(HelloText)), ModTime: now},
	}
	for _, h := range hdrs {
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
	}
	if _, err := tw.Write([]byte(HelloText)); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	b := buf.Bytes()
	sum := sha256.Sum256(b)
	return &layer{
		open: func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil },
		hash: v1.Hash{Algorithm: "sha256", Hex: hex.EncodeToString(sum[:])},
		size: int64(len(b)),
	}, nil
}

// fileLayer is the uncompressed tar file p as a layer, digested once (no gzip: cheap to push).
func fileLayer(p string) (v1.Layer, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return nil, err
	}
	return &layer{
		open: func() (io.ReadCloser, error) { return os.Open(p) },
		hash: v1.Hash{Algorithm: "sha256", Hex: hex.EncodeToString(h.Sum(nil))},
		size: n,
	}, nil
}

// layer is an uncompressed OCI layer: digest and diff ID are the same hash.
type layer struct {
	open func() (io.ReadCloser, error)
	hash v1.Hash
	size int64
}

func (l *layer) Digest() (v1.Hash, error)             { return l.hash, nil }
func (l *layer) DiffID() (v1.Hash, error)             { return l.hash, nil }
func (l *layer) Compressed() (io.ReadCloser, error)   { return l.open() }
func (l *layer) Uncompressed() (io.ReadCloser, error) { return l.open() }
func (l *layer) Size() (int64, error)                 { return l.size, nil }
func (l *layer) MediaType() (types.MediaType, error)  { return types.OCIUncompressedLayer, nil }
