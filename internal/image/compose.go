package image

import (
	"context"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
)

// Stack is a template's root filesystem as an overlayfs lower stack: Top, the template's own
// layer directory (its files only, never shared), over Lowers, the image's layer directories
// (top first), which every template built on them shares read-only.
type Stack struct {
	Top    string
	Lowers []string
}

// Dirs is the whole stack, top first.
func (s Stack) Dirs() []string { return append([]string{s.Top}, s.Lowers...) }

// ComposeStats counts what Compose made.
type ComposeStats struct {
	// Layers is the number of image layers in the stack; Links the hard links into lower
	// layers that were made in the top layer.
	Layers, Links int
}

// Compose makes the template rootfs of layers (bottom layer first, as an image lists them) with
// top (an existing directory, the template's own layer) above them: the stack of top and the
// layers' directories, which overlayfs merges (each layer's whiteouts and opaque directories
// are in its directory). Nothing is copied and no layer is written: the only thing Compose
// writes is, in top, each hard link of a layer whose target is in a lower layer (a link to the
// lower layer's file, made through the merged stack), unless a higher layer has its own entry
// at that name. This is the one entry point for "these layers make this template's rootfs".
func Compose(ctx context.Context, top string, layers []LayerDir) (Stack, ComposeStats, error) {
	st := ComposeStats{Layers: len(layers)}
	stack := Stack{Top: top}
	for i := len(layers) - 1; i >= 0; i-- {
		stack.Lowers = append(stack.Lowers, layers[i].RootDir())
	}
	if fi, err := os.Lstat(top); err != nil || !fi.IsDir() {
		return stack, st, fmt.Errorf("top layer %s: not a directory: %w", top, errdefs.ErrInvalid)
	}
	type link struct {
		Link
		layer int
	}
	var links []link
	for i, l := range layers {
		if err := checkMeta(l.Meta); err != nil {
			return stack, st, fmt.Errorf("layer %s: %w", shortDigest(l.Digest), err)
		}
		for _, ln := range l.Meta.Links {
			links = append(links, link{ln, i})
		}
	}
	if len(links) == 0 {
		return stack, st, nil
	}
	err := stack.Edit(ctx, func(t *Tree) error {
		for _, ln := range links {
			if err := ctx.Err(); err != nil {
				return err
			}
			if shadowed(layers[ln.layer+1:], ln.Name) {
				continue
			}
			dir, base := path.Split(ln.Name)
			dir = strings.TrimSuffix(dir, "/")
			if err := t.MkdirAll(dir, 0o755, 0, 0); err != nil {
				return fmt.Errorf("hard link /%s: %w", ln.Name, err)
			}
			parent, err := openBeneath(t.fd, dir)
			if err != nil {
				return fmt.Errorf("hard link /%s: %w", ln.Name, pathError(dir, err))
			}
			if err := clear(parent, base, false); err != nil {
				unix.Close(parent)
				return err
			}
			ok, err := linkBeneath(t.fd, ln.Target, parent, base)
			unix.Close(parent)
			if err != nil {
				return fmt.Errorf("layer %s: hard link /%s -> /%s: %w", shortDigest(layers[ln.layer].Digest), ln.Name, ln.Target, err)
			}
			if !ok {
				return fmt.Errorf("layer %s: hard link /%s: target /%s is in no layer: %w", shortDigest(layers[ln.layer].Digest), ln.Name, ln.Target, errdefs.ErrInvalid)
			}
			st.Links++
		}
		return nil
	})
	return stack, st, err
}

// shadowed reports whether one of layers has an entry (or a whiteout) of its own at rel.
func shadowed(layers []LayerDir, rel string) bool {
	for _, l := range layers {
		root, err := unix.Open(l.RootDir(), unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
		if err != nil {
			continue
		}
		t := Tree{fd: root}
		ok := t.Exists(rel)
		unix.Close(root)
		if ok {
			return true
		}
	}
	return false
}

func shortDigest(d string) string {
	short := strings.TrimPrefix(d, "sha256:")
	if len(short) > 12 {
		short = short[:12]
	}
	return short
}

// Edit mounts the stack writable, with Top as the overlay's upper directory, and runs fn on the
// merged tree: what fn writes lands in Top (overlayfs copies a lower directory up before an
// entry is added to it, and records a removal as a whiteout), never in a shared layer. It needs
// root. The mount is gone when Edit returns. Hard links from outside the tree cannot be made
// through the mount (another filesystem): make them in Top afterwards.
func (s Stack) Edit(ctx context.Context, fn func(t *Tree) error) error {
	if len(s.Lowers) == 0 {
		t, err := OpenTree(s.Top)
		if err != nil {
			return err
		}
		defer t.Close()
		return fn(t)
	}
	scratch, err := os.MkdirTemp(filepath.Dir(s.Top), "."+filepath.Base(s.Top)+".edit-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(scratch)
	work, merged := filepath.Join(scratch, "work"), filepath.Join(scratch, "merged")
	for _, d := range []string{work, merged} {
		if err := os.Mkdir(d, 0o700); err != nil {
			return err
		}
	}
	if err := overlayfs.Mount(merged, s.Lowers, s.Top, work); err != nil {
		return err
	}
	defer overlayfs.Unmount(merged)
	t, err := OpenTree(merged)
	if err != nil {
		return err
	}
	err = fn(t)
	t.Close()
	if uerr := overlayfs.Unmount(merged); err == nil {
		err = uerr
	}
	return err
}

// checkMeta refuses a Meta whose paths could name anything but an entry inside the tree.
func checkMeta(m Meta) error {
	for _, d := range m.Opaque {
		if err := entryPath(d, true); err != nil {
			return fmt.Errorf("opaque directory: %w", err)
		}
	}
	for _, w := range m.Whiteouts {
		if err := entryPath(w, false); err != nil {
			return fmt.Errorf("whiteout: %w", err)
		}
	}
	for _, l := range m.Links {
		if err := entryPath(l.Name, false); err != nil {
			return fmt.Errorf("hard link: %w", err)
		}
		if err := entryPath(l.Target, false); err != nil {
			return fmt.Errorf("hard link target: %w", err)
		}
	}
	return nil
}
