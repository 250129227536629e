// Package node is how the end-to-end tests and the benchmarks get an ember node: the same
// binaries (envd built static, the ember command), the same cache directory, the same layer
// filesystem and the same clean-up. The end-to-end tests run the built `ember serve` (they kill
// it, restart it and read its logs as an operator would); the benchmarks Start the same daemon
// in process, because they measure and steer the Manager itself.
package node

import (
	"context"
	"fmt"
	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/layerfs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/daemon"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// CacheDir is the shared cache (runsc, etcd, rootfs): $EMBER_CACHE_DIR, else <repo>/.cache.
func CacheDir() string {
	if c := os.Getenv("EMBER_CACHE_DIR"); c != "" {
		return c
	}
	return filepath.Join(testutil.RepoRoot(), ".cache")
}

// Binaries are the programs a node runs.
type Binaries struct {
	Ember string // the ember command ("" when not built)
	Envd  string // envd, statically linked (it runs inside sandboxes)
}

// Build builds envd, and with ember the ember command, into dir.
func Build(dir string, ember bool) (Binaries, error) {
	b := Binaries{Envd: filepath.Join(dir, "envd")}
	steps := []struct {
		out, pkg string
		env      []string
	}{{b.Envd, "./cmd/envd", []string{"CGO_ENABLED=0"}}}
	if ember {
		b.Ember = filepath.Join(dir, "ember")
		steps = append(steps, struct {
			out, pkg string
			env      []string
		}{b.Ember, "./cmd/ember", nil})
	}
	for _, s := range steps {
		cmd := exec.Command("go", "build", "-o", s.out, s.pkg)
		cmd.Dir = testutil.RepoRoot()
		cmd.Env = append(os.Environ(), s.env...)
		if out, err := cmd.CombinedOutput(); err != nil {
			return Binaries{}, fmt.Errorf("go build %s: %v\n%s", s.pkg, err, out)
		}
	}
	return b, nil
}

// RemoveDataDir removes dataDir's parent (the node's temporary directory) with whatever still
// runs from it: a daemon that closes leaves its sandboxes and pools running for the next start
// to adopt, so scripts/remove-data-dir.sh kills them by their runsc root and unmounts what is
// mounted below the data dir; then the namespace mount runsc keeps in its root and the btrfs
// image ember mounts over a data dir that cannot clone (internal/layerfs) go, if still there.
func RemoveDataDir(dataDir string) {
	// What is left is said: a benchmark that leaks a sandbox shows here.
	if out, err := exec.Command("pgrep", "-a", "-f", "--", "--root="+datadir.Runsc(dataDir)+"( |$)").Output(); err == nil && len(out) > 0 {
		var ids []string
		for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			f := strings.Fields(line)
			if len(f) > 0 && strings.HasPrefix(f[1], "runsc-sandbox") {
				ids = append(ids, f[len(f)-1])
			}
		}
		fmt.Fprintf(os.Stderr, "testnode: %s: killing what still runs from it: sandbox instances %v\n", dataDir, ids)
	}
	script := filepath.Join(testutil.RepoRoot(), "scripts", "remove-data-dir.sh")
	if out, err := exec.Command("bash", script, dataDir).CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "testnode: remove-data-dir.sh %s: %v\n%s", dataDir, err, out)
	}
	exec.Command("umount", filepath.Join(datadir.Runsc(dataDir), "null-netns")).Run()
	if err := layerfs.Unmount(dataDir, 10*time.Second); err != nil {
		fmt.Fprintln(os.Stderr, "testnode:", err)
	}
	os.RemoveAll(filepath.Dir(dataDir))
}

// Node is a daemon opened in process, its API served on loopback.
type Node struct {
	*daemon.Node
	URL string // http://127.0.0.1:port
	Key string // the API key
	srv *http.Server
}

// Start opens the daemon cfg describes (as `ember serve` does) and serves its API on a loopback
// port.
func Start(ctx context.Context, cfg daemon.Config) (*Node, error) {
	n, err := daemon.Open(ctx, cfg)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		n.Close()
		return nil, err
	}
	key, err := os.ReadFile(datadir.APIKey(cfg.DataDir))
	if err != nil {
		ln.Close()
		n.Close()
		return nil, err
	}
	srv := &http.Server{Handler: n.Handler}
	go srv.Serve(ln)
	return &Node{Node: n, URL: "http://" + ln.Addr().String(), Key: strings.TrimSpace(string(key)), srv: srv}, nil
}

// Close stops serving the API and closes the daemon.
func (n *Node) Close() {
	n.srv.Close()
	n.Node.Close()
}
