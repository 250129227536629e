package api

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// leaveOnCreate is the Manager with a caller that gives up just as its create completes.
type leaveOnCreate struct {
	*service
	leave func()
}

func (l leaveOnCreate) Create(ctx context.Context, req sandbox.CreateRequest) (*sandbox.Sandbox, error) {
	sb, err := l.service.Create(ctx, req)
	l.leave()
	return sb, err
}

// A create whose caller is gone by the time it completes (a client timeout in a burst: CI's
// 100-create load test left one running this way) is killed: nobody has its id, so it would
// hold the node's room until its timeout.
func TestCreateWhoseCallerLeftIsKilled(t *testing.T) {
	e := newEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	h := New(Config{Domain: testDomain}, leaveOnCreate{e.fake, cancel}, e.keys, testLogger(t))
	req := httptest.NewRequest(http.MethodPost, "/sandboxes", strings.NewReader(`{"templateID":"base"}`)).WithContext(ctx)
	req.Header.Set("X-API-Key", e.key)
	req.Header.Set("Content-Type", "application/json")
	h.ServeHTTP(httptest.NewRecorder(), req)
	if l, err := e.fake.List(context.Background(), sandbox.ListFilter{}); err != nil || len(l) != 0 {
		t.Fatalf("after a create whose caller left: %d sandboxes listed (%v); want none", len(l), err)
	}
	if n := len(e.fake.rig.Driver.Running()); n != 0 {
		t.Fatalf("%d instances still run", n)
	}
}
