package api

import (
	"context"
	"encoding/json"
	"github.com/ember-sandbox/ember/internal/testutil"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	cedge "github.com/ember-sandbox/ember/internal/cluster/edge"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/template/build"
)

// clusterNode is one edge of a test cluster: the real Manager over test doubles, the real
// cluster code on a real etcd, the real API.
type clusterNode struct {
	id   string
	svc  *service
	cl   *cluster.Cluster
	srv  *httptest.Server
	env  *env
	stop func()
}

const clusterTTL = 2 * time.Second

func newClusterNode(t *testing.T, e *clustertest.Etcd, id string, mod func(*sandbox.Config)) *clusterNode {
	t.Helper()
	return newClusterNodeWith(t, e, id, mod, nil, nil)
}

func newClusterNodeWith(t *testing.T, e *clustertest.Etcd, id string, mod func(*sandbox.Config), cmod func(*cluster.Config), wrap func(http.Handler) http.Handler, amods ...func(*Config, *cluster.Cluster, *service)) *clusterNode {
	t.Helper()
	return newClusterNodeBuilds(t, e, id, mod, nil, cmod, wrap, amods...)
}

// newClusterNodeBuilds is newClusterNodeWith with the node's build Manager configured by bmod.
func newClusterNodeBuilds(t *testing.T, e *clustertest.Etcd, id string, mod func(*sandbox.Config), bmod func(*build.Config), cmod func(*cluster.Config), wrap func(http.Handler) http.Handler, amods ...func(*Config, *cluster.Cluster, *service)) *clusterNode {
	t.Helper()
	g := newGuest(t)
	svc := newServiceBuilds(t, g.srv.Listener.Addr().String(), mod, bmod)
	srv := httptest.NewUnstartedServer(nil)
	c, err := clientv3.New(clustertest.ClientConfig(e.Endpoints()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ccfg := cluster.Config{Client: c, NodeID: id, URL: "http://" + srv.Listener.Addr().String(), TTL: clusterTTL,
		Capacity: cluster.Capacity{CPU: 8, MemoryMB: 64 << 10, Slots: 100, DiskFreeMB: 1 << 20},
		Local:    cluster.ManagerLocal(svc.Manager), SyncInterval: 200 * time.Millisecond, Logger: testLogger(t)}
	if cmod != nil {
		cmod(&ccfg)
	}
	cl, err := cluster.New(ctx, ccfg)
	if err != nil {
		t.Fatal(err)
	}
	svc.Manager.Listen(cluster.NewEvents(cl, nil, nil)) // as the daemon does
	keys := auth.NewKeys(cl.Keys())
	acfg := Config{Domain: testDomain, Cluster: cl}
	for _, f := range amods {
		f(&acfg, cl, svc)
	}
	var h http.Handler = New(acfg, svc, keys, testLogger(t))
	if wrap != nil {
		h = wrap(h)
	}
	srv.Config.Handler = h
	srv.Start()
	n := &clusterNode{id: id, svc: svc, cl: cl, srv: srv, env: &env{t: t, fake: svc, keys: keys, api: srv, guest: g}}
	stopped := false
	n.stop = func() {
		if !stopped {
			stopped = true
			srv.CloseClientConnections()
			srv.Close()
			cl.Close()
		}
	}
	t.Cleanup(n.stop)
	return n
}

// shareKey gives every node's env one API key of the cluster's (made through the first edge,
// it works through all) once every node sees every other.
func shareKey(t *testing.T, nodes []*clusterNode) {
	t.Helper()
	key, _, err := nodes[0].env.keys.Create(context.Background(), "test")
	if err != nil {
		t.Fatal(err)
	}
	for _, nd := range nodes {
		nd.env.key = key
	}
	testutil.Eventually(t, 5*time.Second, "every node sees every node", func() bool {
		for _, nd := range nodes {
			if len(nd.cl.Live()) != len(nodes) {
				return false
			}
		}
		return true
	})
}

func newTestCluster(t *testing.T, n int) []*clusterNode {
	t.Helper()
	e := clustertest.Start(t, 3)
	var nodes []*clusterNode
	for i := 0; i < n; i++ {
		nodes = append(nodes, newClusterNode(t, e, string(rune('a'+i)), nil))
	}
	// An API key made through one edge works through all.
	shareKey(t, nodes)
	testutil.Eventually(t, 5*time.Second, "every node sees every node with its template", func() bool {
		for _, nd := range nodes {
			for _, l := range nd.cl.Live() {
				if _, ok := l.Templates["base"]; !ok {
					return false
				}
			}
		}
		return true
	})
	return nodes
}

func (n *clusterNode) holds(id string) bool {
	s, err := n.svc.Manager.Get(context.Background(), id)
	return err == nil && s.State != sandbox.StateKilled
}

// Any node is an edge: creates through every edge are placed over the nodes; control and
// sandbox-plane requests for a sandbox on any node work through every edge (by header and by
// host); lists, kills and /nodes are the cluster's.
func TestClusterAnyNodeIsAnEdge(t *testing.T) {
	nodes := newTestCluster(t, 3)
	var ids []string
	owner := map[string]*clusterNode{}
	for i := 0; i < 9; i++ {
		edge := nodes[i%3]
		r := edge.env.ctl(http.MethodPost, "/sandboxes", `{"templateID":"base","timeout":300}`)
		if r.status != http.StatusCreated {
			t.Fatalf("create through %s: %d %s", edge.id, r.status, r.body)
		}
		var sb struct {
			SandboxID string `json:"sandboxID"`
		}
		r.json(t, &sb)
		ids = append(ids, sb.SandboxID)
		for _, n := range nodes {
			if n.holds(sb.SandboxID) {
				owner[sb.SandboxID] = n
			}
		}
		if owner[sb.SandboxID] == nil {
			t.Fatalf("sandbox %s is on no node", sb.SandboxID)
		}
	}
	used := map[string]int{}
	for _, o := range owner {
		used[o.id]++
	}
	if len(used) < 2 {
		t.Fatalf("9 creates through 3 edges all landed on %v", used)
	}
	t.Logf("placement: %v", used)
	for _, id := range ids {
		for _, edge := range nodes {
			r := edge.env.ctl(http.MethodGet, "/sandboxes/"+id, "")
			if r.status != http.StatusOK {
				t.Fatalf("GET %s (on %s) through %s: %d %s", id, owner[id].id, edge.id, r.status, r.body)
			}
			// Sandbox plane by header, with a body (the guest echoes it).
			r = edge.env.do(http.MethodPost, "/echo", "hello "+id, "E2b-Sandbox-Id", id)
			var echo guestEcho
			if r.status != http.StatusOK {
				t.Fatalf("sandbox plane %s (on %s) through %s: %d %s", id, owner[id].id, edge.id, r.status, r.body)
			}
			r.json(t, &echo)
			if echo.Body != "hello "+id || echo.Path != "/echo" || echo.Headers[cedge.HeaderForwarded] != "" || echo.Headers["X-Api-Key"] != "" {
				t.Fatalf("guest saw %+v", echo)
			}
			// By host, as the SDK's getHost() URLs.
			r = edge.env.do(http.MethodGet, "/by-host", "", "Host", "8080-"+id+"."+testDomain)
			if r.status != http.StatusOK {
				t.Fatalf("host routing %s through %s: %d %s", id, edge.id, r.status, r.body)
			}
			r.json(t, &echo)
			if echo.Host != "8080-"+id+"."+testDomain {
				t.Fatalf("guest saw host %q", echo.Host)
			}
		}
	}
	// Lists are the cluster's, through any edge.
	for _, edge := range nodes {
		var l1, l2 []listedSandboxJSON
		edge.env.ctl(http.MethodGet, "/sandboxes", "").json(t, &l1)
		edge.env.ctl(http.MethodGet, "/v2/sandboxes?limit=100", "").json(t, &l2)
		if len(l1) != 9 || len(l2) != 9 {
			t.Fatalf("lists through %s: v1 %d, v2 %d, want 9", edge.id, len(l1), len(l2))
		}
	}
	// v2 pages across nodes.
	seen := map[string]bool{}
	tok := ""
	for page := 0; page < 10; page++ {
		path := "/v2/sandboxes?limit=4"
		if tok != "" {
			path += "&nextToken=" + tok
		}
		r := nodes[1].env.ctl(http.MethodGet, path, "")
		var l []listedSandboxJSON
		r.json(t, &l)
		for _, s := range l {
			if seen[s.SandboxID] {
				t.Fatalf("%s listed twice", s.SandboxID)
			}
			seen[s.SandboxID] = true
		}
		if tok = r.header.Get(HeaderNextToken); tok == "" {
			break
		}
	}
	if len(seen) != 9 {
		t.Fatalf("pages listed %d sandboxes, want 9", len(seen))
	}
	// /nodes: each node with its sandboxes.
	var views []cluster.NodeView
	nodes[2].env.ctl(http.MethodGet, "/nodes", "").json(t, &views)
	total := 0
	for _, v := range views {
		if v.State != cluster.StateActive || len(v.Sandboxes) != used[v.ID] {
			t.Fatalf("node view %+v, want %d sandboxes", v, used[v.ID])
		}
		total += len(v.Sandboxes)
	}
	if len(views) != 3 || total != 9 {
		t.Fatalf("/nodes: %d nodes, %d sandboxes", len(views), total)
	}
	var one cluster.NodeView
	nodes[0].env.ctl(http.MethodGet, "/nodes/b", "").json(t, &one)
	if one.ID != "b" || len(one.Sandboxes) != used["b"] {
		t.Fatalf("/nodes/b: %+v", one)
	}
	// Kill through an edge that does not hold it.
	id := ids[0]
	edge := nodes[0]
	if owner[id] == nodes[0] {
		edge = nodes[1]
	}
	if r := edge.env.ctl(http.MethodDelete, "/sandboxes/"+id, ""); r.status != http.StatusNoContent {
		t.Fatalf("kill through %s: %d %s", edge.id, r.status, r.body)
	}
	if owner[id].holds(id) {
		t.Fatal("killed through another edge but still running")
	}
	for _, e := range nodes {
		if r := e.env.ctl(http.MethodGet, "/sandboxes/"+id, ""); r.status != http.StatusNotFound {
			t.Fatalf("killed sandbox through %s: %d %s", e.id, r.status, r.body)
		}
	}
	// Unauthenticated through any edge: 401 before any routing.
	if r := nodes[1].env.do(http.MethodGet, "/sandboxes/"+ids[1], ""); r.status != http.StatusUnauthorized {
		t.Fatalf("no key: %d", r.status)
	}
}

// A node that refuses a create (full) is skipped: the create lands elsewhere and the retry
// is counted; a drained node takes no new sandboxes.
func TestClusterRefusalAndDrain(t *testing.T) {
	e := clustertest.Start(t, 3)
	a := newClusterNode(t, e, "a", func(c *sandbox.Config) { c.MaxSandboxes = 1 })
	b := newClusterNode(t, e, "b", nil)
	key, _, _ := a.env.keys.Create(context.Background(), "k")
	a.env.key, b.env.key = key, key
	testutil.Eventually(t, 5*time.Second, "both nodes", func() bool { return len(a.cl.Live()) == 2 && len(b.cl.Live()) == 2 })
	onA := 0
	for i := 0; i < 6; i++ {
		r := a.env.ctl(http.MethodPost, "/sandboxes", `{"templateID":"base"}`)
		if r.status != http.StatusCreated {
			t.Fatalf("create %d: %d %s", i, r.status, r.body)
		}
		var sb struct {
			SandboxID string `json:"sandboxID"`
		}
		r.json(t, &sb)
		if a.holds(sb.SandboxID) {
			onA++
		}
	}
	if onA > 1 {
		t.Fatalf("%d sandboxes on a, which takes 1", onA)
	}
	if a.cl.PlacementRetries() == 0 {
		t.Fatal("no placement retry counted")
	}
	if r := b.env.ctl(http.MethodPost, "/nodes/b/drain", ""); r.status != http.StatusOK || !strings.Contains(string(r.body), `"draining"`) {
		t.Fatalf("drain: %d %s", r.status, r.body)
	}
	testutil.Eventually(t, 5*time.Second, "a sees b draining", func() bool { v, _ := a.cl.Node("b"); return v.State == cluster.StateDraining })
	// a is full, b drained: no room anywhere.
	if r := b.env.ctl(http.MethodPost, "/sandboxes", `{"templateID":"base"}`); r.status != http.StatusTooManyRequests {
		t.Fatalf("create with a full and b drained: %d %s", r.status, r.body)
	}
	if r := a.env.ctl(http.MethodGet, "/nodes/zz", ""); r.status != http.StatusNotFound {
		t.Fatalf("unknown node: %d", r.status)
	}
}

// A node that dies: its sandboxes answer 404 naming the node and the time within the TTL plus
// a margin, through every other edge; nothing is placed on it.
func TestClusterNodeLoss(t *testing.T) {
	nodes := newTestCluster(t, 3)
	var onC []string
	for i := 0; i < 12 && len(onC) < 2; i++ {
		r := nodes[0].env.ctl(http.MethodPost, "/sandboxes", `{"templateID":"base"}`)
		var sb struct {
			SandboxID string `json:"sandboxID"`
		}
		r.json(t, &sb)
		if nodes[2].holds(sb.SandboxID) {
			onC = append(onC, sb.SandboxID)
		}
	}
	if len(onC) == 0 {
		t.Fatal("nothing placed on c")
	}
	stopped := time.Now()
	nodes[2].stop()
	testutil.Eventually(t, clusterTTL+3*time.Second, "c's sandboxes reported lost", func() bool {
		r := nodes[1].env.ctl(http.MethodGet, "/sandboxes/"+onC[0], "")
		return r.status == http.StatusNotFound && strings.Contains(string(r.body), "lost with node c")
	})
	t.Logf("lost %v after c stopped (TTL %v)", time.Since(stopped).Round(time.Millisecond), clusterTTL)
	r := nodes[0].env.ctl(http.MethodGet, "/sandboxes/"+onC[0], "")
	var eb struct{ Message string }
	r.json(t, &eb)
	if r.status != http.StatusNotFound || !strings.HasPrefix(eb.Message, `Sandbox "`+onC[0]+`" doesn't exist or you don't have access to it: it was lost with node c`) {
		t.Fatalf("GET lost sandbox: %d %s", r.status, r.body)
	}
	// The sandbox plane answers as E2B's does (502, "The sandbox was not found"); a Connect
	// client (the SDK's envd calls) is also told why.
	r = nodes[0].env.do(http.MethodGet, "/x", "", "E2b-Sandbox-Id", onC[0])
	if r.status != http.StatusBadGateway || !strings.Contains(string(r.body), `"sandboxId":"`+onC[0]+`"`) || !strings.Contains(string(r.body), "The sandbox was not found") {
		t.Fatalf("sandbox plane of a lost sandbox: %d %s", r.status, r.body)
	}
	r = nodes[0].env.do(http.MethodPost, "/process.Process/List", "{}", "E2b-Sandbox-Id", onC[0], "Connect-Protocol-Version", "1", "Content-Type", "application/json")
	if r.status != http.StatusBadGateway || !strings.Contains(string(r.body), "lost with node c") {
		t.Fatalf("sandbox plane of a lost sandbox, Connect: %d %s", r.status, r.body)
	}
	for i := 0; i < 6; i++ {
		r := nodes[1].env.ctl(http.MethodPost, "/sandboxes", `{"templateID":"base"}`)
		var sb struct {
			SandboxID string `json:"sandboxID"`
		}
		r.json(t, &sb)
		if !nodes[0].holds(sb.SandboxID) && !nodes[1].holds(sb.SandboxID) {
			t.Fatalf("create %d landed on neither live node: %d %s", i, r.status, r.body)
		}
	}
	var views []cluster.NodeView
	nodes[0].env.ctl(http.MethodGet, "/nodes", "").json(t, &views)
	b, _ := json.Marshal(views)
	if !strings.Contains(string(b), `"nodeID":"c","state":"lost"`) {
		t.Fatalf("/nodes: %s", b)
	}
}

// A stale route: the node it names answers "not here", and the edge reads etcd once and tries
// again where the sandbox is now.
func TestClusterNotHereRetries(t *testing.T) {
	e := clustertest.Start(t, 3)
	etcd := e.Client(t)
	ctx := context.Background()
	noSync := func(c *cluster.Config) { c.SyncInterval = time.Hour }
	var b *clusterNode
	var moved atomic.Int64
	a := newClusterNodeWith(t, e, "a", nil, noSync, nil)
	b = newClusterNodeWith(t, e, "b", nil, noSync, nil)
	// c: when asked for the sandbox it does not hold, the route moves to b first (as if the
	// edge's cache had fallen behind).
	c := newClusterNodeWith(t, e, "c", nil, noSync, func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get(cedge.HeaderForwarded) != "" && moved.Load() == 0 {
				id := r.Header.Get(cedge.HeaderFwdSandbox)
				route, _ := json.Marshal(cluster.Route{Node: "b", Epoch: b.cl.Epoch(), Since: time.Now()})
				if _, err := etcd.Put(ctx, "/ember/sandboxes/"+id, string(route)); err != nil {
					t.Error(err)
				}
				moved.Add(1)
			}
			h.ServeHTTP(w, r)
		})
	})
	key, _, _ := a.env.keys.Create(ctx, "k")
	a.env.key = key
	testutil.Eventually(t, 5*time.Second, "three nodes", func() bool { return len(a.cl.Live()) == 3 })
	// A sandbox on b, routed (wrongly) to c.
	allocB := func() string {
		r, err := etcd.Get(ctx, "/ember/alloc/b")
		if err != nil || len(r.Kvs) == 0 {
			return ""
		}
		return string(r.Kvs[0].Value)
	}
	before := allocB()
	sbx, err := b.svc.Manager.Create(ctx, sandbox.CreateRequest{TemplateID: "base", Timeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	// Its claim ran one sync of b (which counts it): done before the route goes wrong, or
	// that sync would kill it as the cluster's on c.
	testutil.Eventually(t, 5*time.Second, "b's sync counted the sandbox", func() bool { return allocB() != before })
	route, _ := json.Marshal(cluster.Route{Node: "c", Epoch: c.cl.Epoch(), Since: time.Now()})
	r, err := etcd.Put(ctx, "/ember/sandboxes/"+sbx.ID, string(route))
	if err != nil {
		t.Fatal(err)
	}
	if err := a.cl.WaitRevision(ctx, r.Header.Revision); err != nil {
		t.Fatal(err)
	}
	res := a.env.do(http.MethodPost, "/echo", "payload", "E2b-Sandbox-Id", sbx.ID)
	var echo guestEcho
	if res.status != http.StatusOK {
		t.Fatalf("through a stale route: %d %s", res.status, res.body)
	}
	res.json(t, &echo)
	if echo.Body != "payload" || moved.Load() != 1 || res.header.Get(cedge.HeaderNotHere) != "" {
		t.Fatalf("echo %+v, moved %d, not-here %q", echo, moved.Load(), res.header.Get(cedge.HeaderNotHere))
	}
}
