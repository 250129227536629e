package clustertest

import (
	"context"
	"testing"
	"time"
)

// A 3-member cluster serves writes with one member killed, and the killed member catches up.
func TestEtcdSurvivesOneMember(t *testing.T) {
	e := Start(t, 3)
	c := e.Client(t)
	e.Kill(1)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// A proposal that reached the killed member (the leader, or forwarded to it) just before
	// it died is lost, and etcd answers "request timed out" after its request timeout: a client
	// tries again, as ember's cluster code does at its next renewal or reconcile.
	for attempt := 1; ; attempt++ {
		pctx, pcancel := context.WithTimeout(ctx, 8*time.Second)
		_, err := c.Put(pctx, "/k", "v")
		pcancel()
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("put with a member down: %v (%d attempts)", err, attempt)
		}
		t.Logf("put with a member down, attempt %d: %v; trying again", attempt, err)
	}
	e.Restart(1)
	r, err := c.Get(ctx, "/k")
	if err != nil || len(r.Kvs) != 1 || string(r.Kvs[0].Value) != "v" {
		t.Fatalf("get: %v %v", r, err)
	}
}
