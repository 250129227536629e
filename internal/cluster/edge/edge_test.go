package edge

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// fakeCluster places on its nodes in order, skipping excluded ones.
type fakeCluster struct {
	Cluster // unused methods panic
	nodes   []cluster.NodeInfo
	local   string
	mu      sync.Mutex
	placed  []string
	cancels []string
	locs    map[string]cluster.Location // Locate's answers
}

func (c *fakeCluster) Locate(_ context.Context, id string, _ bool) (cluster.Location, error) {
	return c.locs[id], nil
}

func (c *fakeCluster) NodeID() string { return c.local }
func (c *fakeCluster) Secret() []byte { return []byte("secret") }
func (c *fakeCluster) Place(_ context.Context, req cluster.PlaceRequest) (*cluster.Reservation, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, n := range c.nodes {
		if !slices.Contains(req.Exclude, n.ID) {
			c.placed = append(c.placed, n.ID)
			return &cluster.Reservation{ID: "r-" + n.ID, Node: n.ID, URL: n.URL, Local: n.ID == c.local}, nil
		}
	}
	return nil, errors.New("no room: " + errdefs.ErrExhausted.Error())
}
func (c *fakeCluster) Cancel(_ context.Context, r *cluster.Reservation) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cancels = append(c.cancels, r.ID)
}

// fakeLocal writes errors with the errdefs pair, as api does.
type fakeLocal struct{ Local }

func (fakeLocal) WriteError(w http.ResponseWriter, _ *http.Request, err error) {
	errdefs.WriteHTTP(w, err, "")
}
func (fakeLocal) MaxBodyBytes() int64 { return 1 << 20 }

// seen records the reservation header of every request the fake nodes received; they answer
// at once when an edge fans out (ListOthers), hence the lock.
type seen struct {
	mu   sync.Mutex
	rids []string
}

func (s *seen) add(rid string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rids = append(s.rids, rid)
}

func (s *seen) reset() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rids = nil
}

func (s *seen) all() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.rids)
}

// node is another node's API: it checks the node proof and answers with status and body.
func node(t *testing.T, status int, body string, saw *seen) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := Verify([]byte("secret"), r); err != nil {
			errdefs.WriteHTTP(w, err, "")
			return
		}
		if r.Header.Get(headerAPIKey) != "" || r.Header.Get("Authorization") != "" {
			t.Errorf("a forward carried the client's key")
		}
		saw.add(r.Header.Get(HeaderReservation))
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = w.Write([]byte(body))
	}))
	t.Cleanup(srv.Close)
	return srv
}

// A create that nodes refuse (429, 503) goes to the next node, each refused reservation
// cancelled; the answer is the accepting node's, or the last refusal's, status and message
// as the node wrote them (the error crossed back in and out again).
func TestPlaceCreateRetriesRefusals(t *testing.T) {
	var saw seen
	full := node(t, http.StatusTooManyRequests, `{"code":429,"message":"node b is full"}`, &saw)
	failing := node(t, http.StatusServiceUnavailable, `{"code":503,"message":"node c: runsc is down"}`, &saw)
	ok := node(t, http.StatusCreated, `{"sandboxID":"abc"}`, &saw)
	for _, tc := range []struct {
		name    string
		nodes   []cluster.NodeInfo
		status  int
		body    string
		cancels []string
	}{
		{"third accepts", []cluster.NodeInfo{{ID: "b", URL: full.URL}, {ID: "c", URL: failing.URL}, {ID: "d", URL: ok.URL}},
			http.StatusCreated, `{"sandboxID":"abc"}`, []string{"r-b", "r-c"}},
		{"all refuse", []cluster.NodeInfo{{ID: "b", URL: full.URL}, {ID: "c", URL: failing.URL}, {ID: "e", URL: failing.URL}},
			http.StatusServiceUnavailable, "node c: runsc is down", []string{"r-b", "r-c", "r-e"}},
		{"unreachable", []cluster.NodeInfo{{ID: "f", URL: "http://127.0.0.1:1"}, {ID: "d", URL: ok.URL}},
			http.StatusCreated, `{"sandboxID":"abc"}`, []string{"r-f"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			saw.reset()
			fc := &fakeCluster{nodes: tc.nodes, local: "a"}
			e := New(Config{Cluster: fc, Local: fakeLocal{}})
			req := httptest.NewRequest(http.MethodPost, "/sandboxes", strings.NewReader(`{"templateID":"base"}`))
			req.Header.Set(headerAPIKey, "client-key")
			rec := httptest.NewRecorder()
			e.Serve(rec, req, Target{Kind: Create, TemplateID: "base", Body: []byte(`{"templateID":"base"}`),
				CreateHere: func(context.Context, string) ([]byte, error) { t.Fatal("created here"); return nil, nil }})
			if rec.Code != tc.status || !strings.Contains(rec.Body.String(), tc.body) {
				t.Fatalf("answer %d %s, want %d %s", rec.Code, rec.Body, tc.status, tc.body)
			}
			if tc.status >= 400 {
				var b errdefs.Body
				if json.Unmarshal(rec.Body.Bytes(), &b) != nil || b.Code != tc.status || b.Message != tc.body {
					t.Fatalf("error body %s, want code %d message %q", rec.Body, tc.status, tc.body)
				}
			}
			if !slices.Equal(fc.cancels, tc.cancels) {
				t.Fatalf("cancelled %v, want %v", fc.cancels, tc.cancels)
			}
			for _, rid := range saw.all() {
				if !strings.HasPrefix(rid, "r-") {
					t.Fatalf("a forwarded create without its reservation: %q", rid)
				}
			}
		})
	}
}

// A create placed here is a direct call with the reservation, not a recorded request.
func TestPlaceCreateHere(t *testing.T) {
	fc := &fakeCluster{nodes: []cluster.NodeInfo{{ID: "a"}}, local: "a"}
	e := New(Config{Cluster: fc, Local: fakeLocal{}})
	var got string
	rec := httptest.NewRecorder()
	e.Serve(rec, httptest.NewRequest(http.MethodPost, "/sandboxes", nil), Target{Kind: Create, TemplateID: "base",
		CreateHere: func(_ context.Context, rid string) ([]byte, error) {
			got = rid
			return nil, &errdefs.StatusError{Status: http.StatusConflict, Message: "taken"}
		}})
	if got != "r-a" || rec.Code != http.StatusConflict || !slices.Equal(fc.cancels, []string{"r-a"}) {
		t.Fatalf("reservation %q, answer %d %s, cancels %v", got, rec.Code, rec.Body, fc.cancels)
	}
}

// A node proof checks only for the request it was made for, within its window.
func TestNodeProof(t *testing.T) {
	secret := []byte("secret")
	signed := func() *http.Request {
		r := httptest.NewRequest(http.MethodPost, "/sandboxes?x=1", nil)
		r.Header.Set(HeaderForwarded, "b")
		r.Header.Set(HeaderReservation, "r1")
		r.Header.Set(HeaderTeam, "team-b")
		Sign(secret, r)
		return r
	}
	if err := Verify(secret, signed()); err != nil {
		t.Fatal(err)
	}
	stale := time.Now().Add(-time.Minute).Unix()
	for name, tc := range map[string]struct {
		mod    func(r *http.Request)
		status int
	}{
		"none":         {func(r *http.Request) { r.Header.Del(HeaderNodeProof) }, http.StatusUnauthorized},
		"malformed":    {func(r *http.Request) { r.Header.Set(HeaderNodeProof, "v2.x") }, http.StatusUnauthorized},
		"other key":    {func(r *http.Request) { r.Header.Set(HeaderReservation, "r2") }, http.StatusForbidden},
		"other path":   {func(r *http.Request) { r.RequestURI = "/sandboxes" }, http.StatusForbidden},
		"other node":   {func(r *http.Request) { r.Header.Set(HeaderForwarded, "c") }, http.StatusForbidden},
		"other team":   {func(r *http.Request) { r.Header.Set(HeaderTeam, "default;admin") }, http.StatusForbidden},
		"wrong secret": {func(r *http.Request) { Sign([]byte("other"), r) }, http.StatusForbidden},
		"stale": {func(r *http.Request) {
			r.Header.Set(HeaderNodeProof, "v1."+strconv.FormatInt(stale, 10)+"."+NodeProof(secret, r.Method, r.RequestURI, stale, r.Header))
		}, http.StatusUnauthorized},
	} {
		r := signed()
		tc.mod(r)
		if err := Verify(secret, r); errdefs.HTTPStatus(err) != tc.status {
			t.Errorf("%s: %v (%d), want %d", name, err, errdefs.HTTPStatus(err), tc.status)
		}
	}
}

// The client's key never leaves the edge; other Authorization schemes pass.
func TestDropClientKey(t *testing.T) {
	h := http.Header{}
	h.Set(headerAPIKey, "k")
	h.Set("Authorization", "Bearer k")
	dropClientKey(h)
	if len(h) != 0 {
		t.Fatalf("left %v", h)
	}
	h.Set("Authorization", "Basic x")
	dropClientKey(h)
	if h.Get("Authorization") != "Basic x" {
		t.Fatal("dropped a non-bearer Authorization")
	}
}

func (c *fakeCluster) Live() []cluster.NodeInfo { return c.nodes }

// A list goes to every other live node, signed and without the client's key; a node's error
// comes back in with its status and message, a node that does not answer lists nothing.
func TestListOthers(t *testing.T) {
	var saw seen
	good := node(t, http.StatusOK, `[{"sandboxID":"x"}]`, &saw)
	bad := node(t, http.StatusBadRequest, `{"code":400,"message":"order must be asc or desc"}`, &saw)
	fc := &fakeCluster{local: "a", nodes: []cluster.NodeInfo{{ID: "a"}, {ID: "b", URL: good.URL}, {ID: "c", URL: bad.URL}, {ID: "d", URL: "http://127.0.0.1:1"}}}
	e := New(Config{Cluster: fc, Local: fakeLocal{}})
	req := httptest.NewRequest(http.MethodGet, "/v2/sandboxes?order=up", nil)
	req.Header.Set(headerAPIKey, "client-key")
	pages, here := e.ListOthers(req, "X-Next-Token")
	if !here || len(pages) != 3 {
		t.Fatalf("here %v, %d pages", here, len(pages))
	}
	if string(pages[0].Body) != `[{"sandboxID":"x"}]` || pages[0].Err != nil {
		t.Fatalf("b: %+v", pages[0])
	}
	if err := pages[1].Err; !errors.Is(err, errdefs.ErrInvalid) || errdefs.HTTPStatus(err) != http.StatusBadRequest || err.Error() != "order must be asc or desc" {
		t.Fatalf("c: %v", err)
	}
	if pages[2].Body != nil || pages[2].Err != nil {
		t.Fatalf("d (down): %+v", pages[2])
	}
}

// The caller travels between nodes as the edge checked it; a client's own team header is
// never passed on.
func TestCallerHeader(t *testing.T) {
	for _, c := range []auth.Caller{{Team: "team-b"}, {Team: "default", Admin: true}} {
		h := http.Header{}
		h.Set(HeaderTeam, EncodeCaller(c))
		got, ok := CallerFrom(h)
		if !ok || got.Team != c.Team || got.Admin != c.Admin {
			t.Errorf("%+v came back as %+v", c, got)
		}
	}
	if _, ok := CallerFrom(http.Header{}); ok {
		t.Error("no header, a caller")
	}
	e := &Edge{cl: &fakeCluster{local: "a"}}
	out := httptest.NewRequest(http.MethodGet, "/sandboxes", nil)
	out.Header.Set(HeaderTeam, "default;admin") // the client's
	e.sign(out)
	if v := out.Header.Get(HeaderTeam); v != "" {
		t.Errorf("a request without a caller went on with the client's team header %q", v)
	}
	out = httptest.NewRequest(http.MethodGet, "/sandboxes", nil).WithContext(auth.WithCaller(context.Background(), auth.Caller{Team: "team-b"}))
	out.Header.Set(HeaderTeam, "default;admin")
	e.sign(out)
	if v := out.Header.Get(HeaderTeam); v != "team-b" {
		t.Errorf("team header %q, want the checked caller's", v)
	}
}

// holdingLocal holds some sandboxes and records the forwarded requests it serves.
type holdingLocal struct {
	fakeLocal
	held   map[string]bool
	served []string
}

func (l *holdingLocal) Holds(_ context.Context, id string) bool { return l.held[id] }
func (l *holdingLocal) ServeForwarded(w http.ResponseWriter, r *http.Request) {
	l.served = append(l.served, r.URL.Path)
	w.WriteHeader(http.StatusOK)
}

// A request forwarded to the node that stored a paused sandbox, after another node adopted it
// and before this one dropped its copy (its next reconcile): "not here", so that the sending
// edge goes to the adopter, and never served from the copy (a fork there answered "sandbox is
// paused": TestClusterPausedSandboxesMove, 2 runs in 4). The node's own, and one it does not
// hold, go on as before.
func TestForwardedToTheOldHolderOfAnAdoptedSandbox(t *testing.T) {
	fc := &fakeCluster{local: "b", locs: map[string]cluster.Location{
		"moved": {Node: "a", URL: "http://a.test"}, "mine": {Node: "b", Local: true}}}
	l := &holdingLocal{held: map[string]bool{"moved": true, "mine": true}}
	e := New(Config{Cluster: fc, Local: l})
	for _, tc := range []struct {
		id              string
		served, notHere bool
	}{{"moved", false, true}, {"mine", true, false}, {"other", true, true}} {
		l.served = nil
		req := httptest.NewRequest(http.MethodPost, "/sandboxes/"+tc.id+"/fork", strings.NewReader(`{"count":1}`))
		e.sign(req)
		rec := httptest.NewRecorder()
		e.ServeForwarded(rec, req)
		if served := len(l.served) == 1; served != tc.served {
			t.Errorf("%s: served here %v, want %v", tc.id, served, tc.served)
		}
		if notHere := rec.Header().Get(HeaderNotHere) != ""; notHere != tc.notHere {
			t.Errorf("%s: not-here %v, want %v (answer %d %s)", tc.id, notHere, tc.notHere, rec.Code, rec.Body)
		}
		if !tc.served && rec.Code != http.StatusNotFound {
			t.Errorf("%s: answer %d %s, want 404", tc.id, rec.Code, rec.Body)
		}
	}
}
