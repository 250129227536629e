package edge

import (
	"io"
	"net/http"
	"strings"
	"sync"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Page is one node's page of a list: its JSON body and next token, or its error.
type Page struct {
	Node string
	Body []byte
	Next string
	Err  error
}

// ListOthers sends list request r to every other live node (each filters and pages the same
// way) and returns their pages; a node that does not answer lists nothing. here says whether
// this node is live, and so lists its own: the caller adds its page and merges them.
func (e *Edge) ListOthers(r *http.Request, nextHeader string) (pages []Page, here bool) {
	var nodes []string
	var urls []string
	for _, n := range e.cl.Live() {
		if n.ID == e.cl.NodeID() {
			here = true
		} else {
			nodes, urls = append(nodes, n.ID), append(urls, n.URL)
		}
	}
	pages = make([]Page, len(nodes))
	var wg sync.WaitGroup
	for i := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := &pages[i]
			p.Node = nodes[i]
			out, err := http.NewRequestWithContext(r.Context(), r.Method, strings.TrimSuffix(urls[i], "/")+r.URL.RequestURI(), nil)
			if err != nil {
				return
			}
			out.Header = r.Header.Clone()
			dropClientKey(out.Header)
			e.sign(out)
			resp, err := e.transport.RoundTrip(out)
			if err != nil {
				e.log.Warn("cluster: list: node unreachable", "node", nodes[i], "err", err)
				return
			}
			defer resp.Body.Close()
			if p.Err = errdefs.FromHTTP(resp); p.Err != nil {
				return
			}
			p.Next = resp.Header.Get(nextHeader)
			if p.Body, err = io.ReadAll(io.LimitReader(resp.Body, 64<<20)); err != nil {
				p.Err = &errdefs.StatusError{Status: http.StatusBadGateway, Message: "bad list from node " + nodes[i]}
			}
		}()
	}
	wg.Wait()
	return pages, here
}
