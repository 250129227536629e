package api

import (
	"log/slog"
	"net/http"
	"sort"
	"strings"
)

// A tiny router: E2B's paths are few and fixed, and the edge needs JSON 404/405 bodies, which
// http.ServeMux does not give.

type params map[string]string

type handlerFunc func(w http.ResponseWriter, r *http.Request, p params) error

type route struct {
	method string
	segs   []string // literal segments, or "{name}" captures
	h      handlerFunc
}

type router struct {
	routes []route
	// guard wraps every route's handler with the lookup of the object it names (teams.go).
	guard func(method, pattern string, h handlerFunc) handlerFunc
}

func (rt *router) handle(method, pattern string, h handlerFunc) {
	if rt.guard != nil {
		h = rt.guard(method, pattern, h)
	}
	switch {
	case strings.HasPrefix(pattern, "/sandboxes/{id}") || strings.HasPrefix(pattern, "/v2/sandboxes/{id}"):
		h = sandboxNotFoundAsE2B(h)
	case method == http.MethodPost && (pattern == "/sandboxes" || pattern == "/v2/sandboxes"):
		h = templateNotFoundAsE2B(h)
	}
	rt.routes = append(rt.routes, route{method: method, segs: splitPath(pattern), h: h})
}

func splitPath(p string) []string {
	return strings.Split(strings.TrimPrefix(p, "/"), "/")
}

func (rt *router) serve(w http.ResponseWriter, r *http.Request, log *slog.Logger) {
	segs := splitPath(r.URL.Path)
	var allowed []string
	for _, rte := range rt.routes {
		p, ok := match(rte.segs, segs)
		if !ok {
			continue
		}
		if rte.method != r.Method {
			allowed = append(allowed, rte.method)
			continue
		}
		if err := rte.h(w, r, p); err != nil {
			writeError(w, log, r, err)
		}
		return
	}
	if len(allowed) > 0 {
		sort.Strings(allowed)
		w.Header().Set("Allow", strings.Join(allowed, ", "))
		writeJSONError(w, http.StatusMethodNotAllowed, "method "+r.Method+" not allowed")
		return
	}
	writeJSONError(w, http.StatusNotFound, "no route for "+r.URL.Path)
}

func match(pattern, segs []string) (params, bool) {
	if len(pattern) != len(segs) {
		return nil, false
	}
	var p params
	for i, ps := range pattern {
		if strings.HasPrefix(ps, "{") && strings.HasSuffix(ps, "}") {
			if segs[i] == "" {
				return nil, false
			}
			if p == nil {
				p = params{}
			}
			p[ps[1:len(ps)-1]] = segs[i]
			continue
		}
		if ps != segs[i] {
			return nil, false
		}
	}
	return p, true
}
