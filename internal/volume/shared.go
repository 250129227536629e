package volume

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Volumes in a cluster: every node mounts the cluster's S3 bucket with s3fs (Debian's s3fs-fuse,
// a FUSE filesystem over S3) and a volume is the directory <prefix>volumes/<id> of that bucket;
// its record lives in etcd (internal/cluster), so every node serves /volumes and the content
// API, and a sandbox on any node bind-mounts the same directory. Why s3fs: the cluster already
// has etcd and S3, NFS has no kernel client on these hosts, JuiceFS is not served by the module
// proxy, and the distributed filesystems in Debian (GlusterFS, MooseFS, CephFS) each need
// servers of their own on every node. s3fs keeps no state of its own: everything is in the
// bucket, so a node that restarts mounts it again and sees every volume.
//
// Consistency between nodes: s3fs caches no stat (max_stat_cache_size=0) and the kernel keeps no
// FUSE attribute or entry (their timeouts 0), so a read on one node goes to S3 and sees what
// another node's writer closed (s3fs uploads a file on close and fsync). gVisor revalidates its
// bind mounts (runsc's --file-access-mounts=shared, the default) on every access, and keeps no
// host file of these open beyond the guest's own opens (runtime.Bind.Remote): s3fs serves every
// open of a file what it read while any is open.
//
// What it does not give by itself: a disk limit per volume (s3fs has no quota; the node on the
// S3 server's host holds the limits there: limit.go); writers on two nodes to one file at once get last-closed-wins; and
// while a process on a node holds a file open, opens of it on that node see what it saw.

// S3FS is where the shared engine's bucket is.
type S3FS struct {
	Endpoint  string // host:port
	TLS       bool
	CAFile    string // PEM file of CAs to trust (TLS)
	Insecure  bool   // no certificate check (tests)
	Bucket    string
	Prefix    string // key prefix of ember's objects in the bucket ("" or ending in "/")
	AccessKey string
	SecretKey string
	Region    string
}

// SharedDir is the directory that holds the volumes when c's bucket is mounted at mnt; volume
// id is <SharedDir>/<id>.
func SharedDir(c S3FS, mnt string) string {
	return filepath.Join(mnt, filepath.FromSlash(c.Prefix), "volumes")
}

// s3fsBinary is s3fs-fuse's command (scripts/setup.sh installs Debian's package).
const s3fsBinary = "s3fs"

// MountShared mounts c's bucket at mnt with s3fs unless a live mount is there already (s3fs
// outlives a daemon that stops: the next start reuses it), and returns the directory that holds
// the volumes (Config.Shared). stateDir keeps s3fs's credentials file (0600).
func MountShared(ctx context.Context, c S3FS, mnt, stateDir string) (string, error) {
	shared := SharedDir(c, mnt)
	if isMountPoint(mnt) {
		if _, err := os.Stat(mnt); err == nil {
			return shared, os.MkdirAll(shared, 0o755)
		}
		// The s3fs behind it died ("transport endpoint is not connected"): mount anew.
		if err := unix.Unmount(mnt, unix.MNT_DETACH); err != nil {
			return "", fmt.Errorf("unmount dead s3fs at %s: %w", mnt, err)
		}
	}
	if _, err := exec.LookPath(s3fsBinary); err != nil {
		return "", fmt.Errorf("volumes in a cluster need s3fs (scripts/setup.sh installs it): %w", err)
	}
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		return "", err
	}
	passwd := filepath.Join(stateDir, "s3fs.passwd")
	if err := os.WriteFile(passwd, []byte(c.AccessKey+":"+c.SecretKey+"\n"), 0o600); err != nil {
		return "", err
	}
	scheme := "http"
	if c.TLS {
		scheme = "https"
	}
	region := c.Region
	if region == "" {
		region = "us-east-1"
	}
	opts := []string{
		"passwd_file=" + passwd,
		"url=" + scheme + "://" + c.Endpoint,
		"endpoint=" + region,
		"use_path_request_style",
		"sigv4",
		// gofer (root) and the content API reach it; files keep the owners and modes set in them.
		"allow_other",
		"mp_umask=0022",
		// Another node's write is seen at once: no stat cache, no kernel attribute or entry cache.
		"max_stat_cache_size=0",
		"attr_timeout=0",
		"entry_timeout=0",
		"negative_timeout=0",
		// A PUT refused by the server (a volume at its disk limit: limit.go) fails the writer's
		// close or fsync after one retry, not after five with growing pauses (minutes).
		"retries=2",
		"dbglevel=err",
	}
	if c.Insecure {
		opts = append(opts, "no_check_certificate", "ssl_verify_hostname=0")
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, s3fsBinary, c.Bucket, mnt, "-o", strings.Join(opts, ","))
	cmd.Env = os.Environ()
	if c.TLS && c.CAFile != "" {
		cmd.Env = append(cmd.Env, "CURL_CA_BUNDLE="+c.CAFile)
	}
	// s3fs checks the bucket, mounts, then leaves a daemon behind (in a session of its own, so
	// it outlives this process); it exits non-zero when the bucket cannot be reached.
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("s3fs %s at %s: %v: %s", c.Bucket, mnt, err, strings.TrimSpace(string(out)))
	}
	for deadline := time.Now().Add(10 * time.Second); !isMountPoint(mnt); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			return "", errors.New("s3fs exited without mounting " + mnt)
		}
	}
	return shared, os.MkdirAll(shared, 0o755)
}
