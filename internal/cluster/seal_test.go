package cluster_test

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/secret"
)

// What etcd holds is no secret: the cluster secret, the snapshot signing key, a stored paused
// sandbox's envd token and env vars, a template's init token and env, a team's secret (E2B's
// Secret API) are sealed with the cluster key (which etcd never sees). A secret made through
// node a resolves on node b (what b's egress proxy does), for its team only. Reading every key of etcd finds none of them, while the
// nodes read them back; a node with another key cannot join, and a record planted in plain
// text by someone without the key is not taken.
func TestEtcdHoldsNoPlainSecrets(t *testing.T) {
	e, key, a, la, b, lb := sealedPair(t)
	if !bytes.Equal(a.Secret(), b.Secret()) {
		t.Fatal("the nodes sign with different secrets")
	}
	ma, mb := cluster.NewMoves(a, &fakePorter{local: la}), cluster.NewMoves(b, &fakePorter{local: lb})
	t.Cleanup(ma.Close)
	t.Cleanup(mb.Close)
	ctx := context.Background()

	const token, envVal, initToken, tplEnv = "envd-token-0123456789abcdef", "db-password-hunter2", "init-token-fedcba9876543210", "template-api-key-s3cr3t"
	if err := a.Claim(ctx, la.add("sx"), ""); err != nil {
		t.Fatal(err)
	}
	ps := &sandbox.PortableSandbox{Sandbox: sandbox.Sandbox{ID: "sx", TemplateID: "base", AccessToken: token,
		EnvVars: map[string]string{"DB_PASSWORD": envVal}}, ImageID: "paused-sx"}
	if err := ma.Stored(ctx, ps); err != nil {
		t.Fatal(err)
	}
	tpl := cluster.SharedTemplate{ID: "snapx", BuildID: "b1", Node: "a", Size: cluster.TemplateSize{CPU: 1, MemoryMB: 512},
		Portable: sandbox.PortableTemplate{Template: sandbox.Template{ID: "snapx", Kind: "snapshot", InitToken: initToken,
			Env: map[string]string{"API_KEY": tplEnv}}, ImageID: "img"}}
	if _, err := a.PublishTemplate(ctx, tpl, true); err != nil {
		t.Fatal(err)
	}
	snapKey, err := cluster.SharedKey(ctx, e.Client(t), "", "snapshot-key", key, nil, 32)
	if err != nil {
		t.Fatal(err)
	}
	const secretVal = "sk-team-secret-0123456789"
	sa, err := secret.NewCluster(a, nil)
	if err != nil {
		t.Fatal(err)
	}
	sb, err := secret.NewCluster(b, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sa.Create(ctx, "team-1", "api-key", secretVal, nil); err != nil {
		t.Fatal(err)
	}
	if got, err := sb.Expand(ctx, "team-1", "Bearer ${e2b.secrets.api-key}"); err != nil || got != "Bearer "+secretVal {
		t.Fatalf("b resolves a's secret: %q %v", got, err)
	}
	if _, err := sb.Expand(ctx, "team-2", "${e2b.secrets.api-key}"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("another team resolves it: %v", err)
	}
	if _, err := sb.Create(ctx, "team-1", "api-key", "x", nil); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("b makes a second secret of that name: %v", err)
	}
	// Both nodes making one name at once: one secret (the name is claimed in etcd); once
	// destroyed, the name is free again.
	for range 5 {
		errs := make(chan error, 2)
		for _, m := range []*secret.Manager{sa, sb} {
			go func() { _, err := m.Create(ctx, "team-1", "race", "v", nil); errs <- err }()
		}
		made := 0
		for range 2 {
			if err := <-errs; err == nil {
				made++
			} else if !errors.Is(err, errdefs.ErrConflict) {
				t.Fatal(err)
			}
		}
		if made != 1 {
			t.Fatalf("%d secrets named race made at once", made)
		}
		if err := sb.Destroy(ctx, "team-1", "race"); err != nil {
			t.Fatal(err)
		}
	}

	// The nodes read them.
	if got, err := b.SharedTemplate(ctx, "snapx"); err != nil || got == nil || got.Portable.Template.InitToken != initToken {
		t.Fatalf("b reads the template: %+v %v", got, err)
	}
	if img := mb.StoredImage(ctx, "sx"); img != "paused-sx" {
		t.Fatalf("b reads the stored record: image %q", img)
	}

	// etcd does not.
	resp, err := e.Client(t).Get(ctx, "/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	secrets := map[string]string{"team secret": secretVal, "envd token": token, "env var": envVal, "init token": initToken, "template env": tplEnv,
		"cluster secret": hex.EncodeToString(a.Secret()), "snapshot key": hex.EncodeToString(snapKey)}
	for _, kv := range resp.Kvs {
		for what, s := range secrets {
			if strings.Contains(string(kv.Value), s) || bytes.Contains(kv.Value, []byte(s)) {
				t.Errorf("%s is readable in etcd under %s", what, kv.Key)
			}
		}
	}
	if len(resp.Kvs) < 5 {
		t.Fatalf("only %d keys in etcd", len(resp.Kvs))
	}

	// Another key does not open them: such a node cannot join.
	other, _ := cluster.NewSealKey(bytes.Repeat([]byte{7}, 32))
	cli, err := clientv3.New(clustertest.ClientConfig(e.Endpoints()))
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	jctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := cluster.New(jctx, cluster.Config{Client: cli, NodeID: "c", Local: newLocal(), TTL: ttl, SealKey: other}); err == nil || !strings.Contains(err.Error(), "cluster key") {
		t.Fatalf("a node with another sealing key joined: %v", err)
	}

	// A plain record written by someone with etcd access but without the key is not taken.
	if _, err := e.Client(t).Put(ctx, "/ember/stored/sx", `{"sandbox":{"id":"sx","accessToken":"planted"},"imageID":"planted-image"}`); err != nil {
		t.Fatal(err)
	}
	if img := mb.StoredImage(ctx, "sx"); img != "" {
		t.Fatalf("a planted plain record was taken: image %q", img)
	}
}

// sealedPair starts etcd (one member) and two nodes, a and b, that seal with the cluster key.
func sealedPair(t *testing.T) (e *clustertest.Etcd, key *cluster.SealKey, a *cluster.Cluster, la *fakeLocal, b *cluster.Cluster, lb *fakeLocal) {
	t.Helper()
	e = clustertest.Start(t, 1)
	key, err := cluster.LoadSealKey(e.KeyFile())
	if err != nil {
		t.Fatal(err)
	}
	sealed := func(c *cluster.Config) { c.SealKey = key }
	la, lb = newLocal("base"), newLocal("base")
	a = join(t, e.Endpoints(), "a", 4, la, sealed)
	b = join(t, e.Endpoints(), "b", 4, lb, sealed)
	return e, key, a, la, b, lb
}
