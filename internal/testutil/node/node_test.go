package node_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/daemon"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/testutil"
	testnode "github.com/ember-sandbox/ember/internal/testutil/node"
)

// A node that closes leaves its sandboxes running for the next start to adopt; RemoveDataDir is
// the end of a benchmark's node, so nothing of it may keep running on the host (before, a
// benchmark that left a sandbox left it running, its data directory deleted under it).
func TestRemoveDataDirEndsWhatTheNodeLeftRunning(t *testing.T) {
	testutil.RequireRoot(t)
	runsc := testutil.Runsc(t)
	tmp, err := os.MkdirTemp("", "ember-testnode-")
	if err != nil {
		t.Fatal(err)
	}
	bins, err := testnode.Build(tmp, false)
	if err != nil {
		t.Fatal(err)
	}
	dataDir := filepath.Join(tmp, "data")
	root := "--root=" + filepath.Join(dataDir, "runsc")
	running := func() bool { return exec.Command("pgrep", "-f", "--", root+"( |$)").Run() == nil }
	defer func() {
		if running() {
			exec.Command("pkill", "-KILL", "-f", "--", root+"( |$)").Run()
		}
	}()
	n, err := testnode.Start(context.Background(), daemon.Config{
		DataDir: dataDir, CacheDir: testnode.CacheDir(), Runsc: runsc, Envd: bins.Envd, PoolSize: 0,
		NodeID: "tn", CIDR: "10.241.0.0/24", Templates: []string{"base"},
	})
	if err != nil {
		testnode.RemoveDataDir(dataDir)
		t.Fatal(err)
	}
	// A sandbox nobody killed: the daemon keeps it for its next start.
	if _, err := n.Manager.Create(context.Background(), sandbox.CreateRequest{TemplateID: "base", Timeout: time.Hour}); err != nil {
		n.Close()
		testnode.RemoveDataDir(dataDir)
		t.Fatal(err)
	}
	n.Close()
	exec.Command("nft", "delete", "table", "inet", "ember_tn").Run()
	if !running() {
		testnode.RemoveDataDir(dataDir)
		t.Fatal("the node left no sandbox running when it closed")
	}
	testnode.RemoveDataDir(dataDir)
	if running() {
		t.Fatal("runsc processes of the removed data dir still run")
	}
	if _, err := os.Stat(tmp); !os.IsNotExist(err) {
		t.Fatalf("the node's directory is still there: %v", err)
	}
}
