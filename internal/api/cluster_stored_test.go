package api

import (
	"context"
	"github.com/ember-sandbox/ember/internal/testutil"
	"net/http"
	"net/url"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// deletesPorter is a node's Manager whose image-store deletes are recorded.
type deletesPorter struct {
	cluster.PausedPorter
	mu      sync.Mutex
	deleted []string
}

func (p *deletesPorter) DeleteStored(_ context.Context, image string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.deleted = append(p.deleted, image)
}

func (p *deletesPorter) has(image string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Contains(p.deleted, image)
}

// A stored paused sandbox of a dead node is listed (v1 with state=paused, v2 by default and
// with state=paused, over pages) through every edge as it was while its node lived; a GET
// answers from its stored record without moving it; a kill ends it without moving it (its
// route, record and pause image deleted).
func TestClusterListsStoredSandboxOfDeadNode(t *testing.T) {
	e := clustertest.Start(t, 3)
	movers := map[string]*cluster.Moves{}
	porters := map[string]*deletesPorter{}
	var mu sync.Mutex
	withMover := func(c *Config, cl *cluster.Cluster, svc *service) {
		p := &deletesPorter{PausedPorter: svc.Manager}
		mv := cluster.NewMoves(cl, p)
		t.Cleanup(mv.Close)
		c.Mover = mv
		mu.Lock()
		movers[cl.NodeID()], porters[cl.NodeID()] = mv, p
		mu.Unlock()
	}
	var nodes []*clusterNode
	for _, id := range []string{"a", "b", "c"} {
		nodes = append(nodes, newClusterNodeWith(t, e, id, nil, nil, nil, withMover))
	}
	shareKey(t, nodes)
	a, b, c := nodes[0], nodes[1], nodes[2]
	// One sandbox on c to pause and store, one running elsewhere.
	var onC, running string
	for i := 0; i < 20 && (onC == "" || running == ""); i++ {
		r := a.env.ctl(http.MethodPost, "/sandboxes", `{"templateID":"base","metadata":{"k":"v"}}`)
		var sb struct {
			SandboxID string `json:"sandboxID"`
		}
		r.json(t, &sb)
		switch {
		case c.holds(sb.SandboxID) && onC == "":
			onC = sb.SandboxID
		case !c.holds(sb.SandboxID) && running == "":
			running = sb.SandboxID
		default:
			a.env.ctl(http.MethodDelete, "/sandboxes/"+sb.SandboxID, "")
		}
	}
	if onC == "" || running == "" {
		t.Fatalf("placement: on c %q, elsewhere %q", onC, running)
	}
	if r := a.env.ctl(http.MethodPost, "/sandboxes/"+onC+"/pause", ""); r.status != http.StatusNoContent {
		t.Fatalf("pause: %d %s", r.status, r.body)
	}
	sb, err := c.svc.Manager.Get(context.Background(), onC)
	if err != nil {
		t.Fatal(err)
	}
	image := "paused-" + onC + "-1"
	if err := movers["c"].Stored(context.Background(), &sandbox.PortableSandbox{Sandbox: *sb, ImageID: image}); err != nil {
		t.Fatal(err)
	}
	var alive []listedSandboxJSON
	a.env.ctl(http.MethodGet, "/v2/sandboxes?state=paused", "").json(t, &alive)
	if len(alive) != 1 || alive[0].SandboxID != onC {
		t.Fatalf("paused list while c lives: %+v", alive)
	}
	want := alive[0]

	c.stop() // no leave: its lease runs out
	testutil.Eventually(t, clusterTTL+5*time.Second, "c gone", func() bool { return len(a.cl.Live()) == 2 && len(b.cl.Live()) == 2 })
	md := url.QueryEscape(url.Values{"k": {"v"}}.Encode())
	for _, edge := range []*clusterNode{a, b} {
		for _, path := range []string{"/v2/sandboxes", "/v2/sandboxes?state=paused", "/sandboxes?state=paused", "/v2/sandboxes?metadata=" + md, "/v2/sandboxes?state=running,lost"} {
			var l []listedSandboxJSON
			if r := edge.env.ctl(http.MethodGet, path, ""); r.status != http.StatusOK {
				t.Fatalf("%s through %s: %d %s", path, edge.id, r.status, r.body)
			} else {
				r.json(t, &l)
			}
			n := 0
			for _, s := range l {
				if s.SandboxID == onC {
					n++
					if s.State != "paused" || s.TemplateID != want.TemplateID || s.Metadata["k"] != "v" || !s.StartedAt.Equal(want.StartedAt) ||
						s.CPUCount != want.CPUCount || s.MemoryMB != want.MemoryMB || !s.EndAt.Equal(want.EndAt) || s.Node != "" {
						t.Fatalf("%s through %s lists %+v, want %+v", path, edge.id, s, want)
					}
				}
			}
			wantN := 1
			if path == "/v2/sandboxes?state=running,lost" {
				wantN = 0
			}
			if n != wantN {
				t.Fatalf("%s through %s: %d times in %+v, want %d", path, edge.id, n, l, wantN)
			}
		}
		// v1's default lists running ones only, as it did while c lived.
		var v1 []listedSandboxJSON
		edge.env.ctl(http.MethodGet, "/sandboxes", "").json(t, &v1)
		if len(v1) != 1 || v1[0].SandboxID != running {
			t.Fatalf("v1 default through %s: %+v", edge.id, v1)
		}
		// Pages of one: each sandbox once.
		for _, order := range []string{"asc", "desc"} {
			var seen []string
			tok := ""
			for page := 0; page < 5; page++ {
				path := "/v2/sandboxes?limit=1&order=" + order
				if tok != "" {
					path += "&nextToken=" + tok
				}
				r := edge.env.ctl(http.MethodGet, path, "")
				var l []listedSandboxJSON
				r.json(t, &l)
				for _, s := range l {
					seen = append(seen, s.SandboxID)
				}
				if tok = r.header.Get(HeaderNextToken); tok == "" {
					break
				}
			}
			slices.Sort(seen)
			exp := []string{onC, running}
			slices.Sort(exp)
			if !slices.Equal(seen, exp) {
				t.Fatalf("pages (%s) through %s: %v, want %v", order, edge.id, seen, exp)
			}
		}
	}

	// A GET answers from the stored record: still stored, still c's, held by no node.
	r := b.env.ctl(http.MethodGet, "/sandboxes/"+onC, "")
	var got sandboxDetailJSON
	r.json(t, &got)
	if r.status != http.StatusOK || got.State != "paused" || got.TemplateID != "base" || got.Metadata["k"] != "v" || !got.StartedAt.Equal(want.StartedAt) {
		t.Fatalf("GET through b: %d %s", r.status, r.body)
	}
	if l, err := b.cl.Locate(context.Background(), onC, true); err != nil || l.Node != "c" || !l.Stored {
		t.Fatalf("after a GET: %+v %v, want still stored on c", l, err)
	}
	if a.holds(onC) || b.holds(onC) {
		t.Fatal("a GET moved the sandbox")
	}

	// A kill ends it where it is: route, record and pause image gone, adopted by no node.
	if r := a.env.ctl(http.MethodDelete, "/sandboxes/"+onC, ""); r.status != http.StatusNoContent {
		t.Fatalf("kill through a: %d %s", r.status, r.body)
	}
	if a.holds(onC) || b.holds(onC) || !porters["a"].has(image) {
		t.Fatalf("kill: held by a %v, b %v; image deleted %v", a.holds(onC), b.holds(onC), porters["a"].deleted)
	}
	if l, err := b.cl.Locate(context.Background(), onC, true); err != nil || l.Known() {
		t.Fatalf("after the kill: %+v %v, want unknown", l, err)
	}
	if r := b.env.ctl(http.MethodGet, "/sandboxes/"+onC, ""); r.status != http.StatusNotFound {
		t.Fatalf("GET after the kill: %d %s", r.status, r.body)
	}
	var l []listedSandboxJSON
	b.env.ctl(http.MethodGet, "/v2/sandboxes", "").json(t, &l)
	if len(l) != 1 || l[0].SandboxID != running {
		t.Fatalf("list after the kill: %+v", l)
	}
}
