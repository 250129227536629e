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
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := c.Put(ctx, "/k", "v"); err != nil {
		t.Fatalf("put with a member down: %v", err)
	}
	e.Restart(1)
	r, err := c.Get(ctx, "/k")
	if err != nil || len(r.Kvs) != 1 || string(r.Kvs[0].Value) != "v" {
		t.Fatalf("get: %v %v", r, err)
	}
}
