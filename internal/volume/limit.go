package volume

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Disk limits of a cluster's volumes (Config.LimitDir). s3fs has no quota and the S3 API none
// per prefix, so the limit is held where the bytes land: on the S3 server's host. The S3 server
// is versitygw's posix backend (objects are files; a key prefix is a directory), run with
// --disableotmp (else an object is an O_TMPFILE linked into place, which fails across
// filesystems on every write) and --sidecar DIR (else the objects' metadata, xattrs of the
// temporary file, is lost by the copy into the image: s3fs's modes and owners). One ember node
// runs on its host with --volume-limit-dir set to the directory of <prefix>volumes in the
// bucket. That node (the holder) gives every volume a sparse ext4 image of the volume's size
// under <Dir>/limits/<id>, loop-mounted, and bind-mounts the image's data directory over the
// volume's directory <LimitDir>/<id>. A PUT of an object into a full volume then fails on the
// server (versitygw writes the object in <bucket>/.sgwtmp, then copies it into the image:
// ENOSPC, answered 500), and s3fs, which uploads a file on flush and close, gives the writer
// EIO there (fsync, close). Overshoot: none past the image (a file that does not fit is left
// cut at the limit by the server's copy); a file's bytes are only checked at its upload, so a
// write(2) itself succeeds.
//
// Every node's create waits until the holder has mounted the volume's image (LimitStore
// records it) before it answers, so no byte of a new volume is written outside its image.
// Without a holder in the cluster volumes have no limit, as before.

// LimitStore is a cluster's Store that knows the node holding the volumes' disk limits.
type LimitStore interface {
	// HoldLimits registers this node as the holder (refused while another node is);
	// LetGoLimits unregisters it (a restart without Config.LimitDir).
	HoldLimits(ctx context.Context) error
	LetGoLimits(ctx context.Context) error
	// LimitHeld says whether some node holds the limits.
	LimitHeld(ctx context.Context) (bool, error)
	// MarkLimited records that volume id's image is mounted; Limited reads it.
	MarkLimited(ctx context.Context, id string) error
	Limited(ctx context.Context, id string) (bool, error)
}

var errUnlimited = errors.New("files and no image")

// limitWait is how long a create waits for the holder to mount the new volume's image.
const limitWait = 20 * time.Second

// limitsDir holds the images of the volumes whose limits this node holds.
func (m *Manager) limitsDir() string { return filepath.Join(m.cfg.Dir, "limits") }

// holdLimits mounts, every interval, the images of the cluster's volumes that have none yet
// and drops those of destroyed volumes, until stop is closed.
func (m *Manager) holdLimits(interval time.Duration) {
	defer close(m.held)
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		m.reconcileLimits(context.Background())
		select {
		case <-m.stop:
			return
		case <-m.kick:
		case <-t.C:
		}
	}
}

func (m *Manager) reconcileLimits(ctx context.Context) {
	ls := m.cfg.Store.(LimitStore)
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	vols, err := m.cfg.Store.ListVolumes(ctx)
	if err != nil {
		m.log.Warn("volume limits: list volumes", "err", err)
		return
	}
	live := map[string]bool{}
	for _, v := range vols {
		live[v.ID] = true
		if err := m.limit(v); errors.Is(err, errUnlimited) {
			if !m.unlimited[v.ID] {
				m.log.Warn("volume limits: the volume has files and no image (made before this node held the limits): it stays without a limit", "volume", v.ID)
				m.unlimited[v.ID] = true
			}
			continue
		} else if err != nil {
			m.log.Error("volume limits: mount the volume's image", "volume", v.ID, "err", err)
			continue
		}
		if ok, err := ls.Limited(ctx, v.ID); err == nil && !ok {
			if err := ls.MarkLimited(ctx, v.ID); err != nil {
				m.log.Warn("volume limits: record", "volume", v.ID, "err", err)
			}
		}
	}
	ents, _ := os.ReadDir(m.limitsDir())
	for _, e := range ents {
		if !live[e.Name()] {
			if err := m.unlimit(e.Name()); err != nil {
				m.log.Warn("volume limits: drop a destroyed volume's image", "volume", e.Name(), "err", err)
			} else {
				m.log.Info("volume limits: image dropped", "volume", e.Name())
			}
		}
	}
}

// limit makes volume v's image if it has none, mounts it and bind-mounts its data directory at
// <LimitDir>/<id>.
func (m *Manager) limit(v *Volume) error {
	dir := filepath.Join(m.limitsDir(), v.ID)
	img, mnt := filepath.Join(dir, imageName), filepath.Join(dir, "mnt")
	target := filepath.Join(m.cfg.LimitDir, v.ID)
	if isMountPoint(target) && isMountPoint(mnt) {
		return nil
	}
	if _, err := os.Stat(img); os.IsNotExist(err) {
		// A volume made before a node held the limits has its files in the directory: an
		// image mounted over them would hide them. It stays without a limit.
		if ents, err := os.ReadDir(target); err == nil && len(ents) > 0 {
			return errUnlimited
		}
		if err := makeImage(dir, v.SizeMB); err != nil {
			return err
		}
	}
	if err := mountImage(img, mnt); err != nil {
		return err
	}
	data := filepath.Join(mnt, "data")
	if err := mkdirOpen(data); err != nil {
		return err
	}
	if isMountPoint(target) {
		return nil
	}
	if err := os.MkdirAll(target, 0o755); err != nil {
		return err
	}
	if err := unix.Mount(data, target, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind the volume's image at %s: %w", target, err)
	}
	return nil
}

// unlimit unmounts a destroyed volume's image and deletes it.
func (m *Manager) unlimit(id string) error {
	target := filepath.Join(m.cfg.LimitDir, id)
	if isMountPoint(target) {
		if err := unix.Unmount(target, unix.MNT_DETACH); err != nil {
			return err
		}
	}
	// The S3 server's directory of the volume, empty under the mount (s3fs has deleted the
	// files): gone with it.
	_ = os.Remove(target)
	dir := filepath.Join(m.limitsDir(), id)
	if mnt := filepath.Join(dir, "mnt"); isMountPoint(mnt) {
		if err := unix.Unmount(mnt, unix.MNT_DETACH); err != nil {
			return err
		}
	}
	return os.RemoveAll(dir)
}

// waitLimited waits until the holder mounted volume id's image (a create on any node), and
// says whether the cluster has one.
func (m *Manager) waitLimited(ctx context.Context, id string) (bool, error) {
	ls, ok := m.cfg.Store.(LimitStore)
	if !ok || m.cfg.Shared == "" {
		return false, nil
	}
	if m.cfg.LimitDir != "" {
		select {
		case m.kick <- struct{}{}:
		default:
		}
	}
	held, err := ls.LimitHeld(ctx)
	if err != nil || !held {
		return false, err
	}
	ctx, cancel := context.WithTimeout(ctx, limitWait)
	defer cancel()
	for {
		if ok, err := ls.Limited(ctx, id); err == nil && ok {
			return true, nil
		}
		select {
		case <-ctx.Done():
			return true, fmt.Errorf("the node that holds the volumes' disk limits did not mount volume %s's image in %v: %w", id, limitWait, errdefs.ErrUnavailable)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// makeImage writes a sparse ext4 image of sizeMB at <dir>/disk.img.
func makeImage(dir string, sizeMB int) error {
	if err := os.MkdirAll(filepath.Join(dir, "mnt"), 0o700); err != nil {
		return err
	}
	img := filepath.Join(dir, imageName)
	f, err := os.OpenFile(img, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	err = f.Truncate(int64(sizeMB) << 20) // sparse
	f.Close()
	if err != nil {
		return err
	}
	// No reserved blocks (the whole limit is the user's), no lazy init (no background writes).
	out, err := exec.Command("mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=0,lazy_journal_init=0", img).CombinedOutput()
	if err != nil {
		return errors.Join(fmt.Errorf("mkfs.ext4 volume image: %v: %s", err, out), os.Remove(img))
	}
	return nil
}

// mountImage loop-mounts img at mnt unless something is mounted there already.
func mountImage(img, mnt string) error {
	if isMountPoint(mnt) {
		return nil
	}
	// mount(8) sets up the loop device with autoclear: unmounting frees it.
	out, err := exec.Command("mount", "-t", "ext4", "-o", "loop,nosuid,nodev,noatime", img, mnt).CombinedOutput()
	if err != nil {
		return fmt.Errorf("mount volume image: %v: %s", err, out)
	}
	return nil
}
