package api

import (
	"context"
	"crypto/subtle"
	"net/http"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/envdclient"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// E2B's network options: the `network` object of create (SandboxNetworkConfig), PUT
// /sandboxes/{id}/network (SandboxNetworkUpdateConfig, the SDK's updateNetwork), and the
// guest-port controls of the sandbox plane (traffic access token, Host masking).

// networkJSON is SandboxNetworkConfig as the SDK sends it. allowOut host names, rules and
// egressProxy are enforced by the node's egress proxy (internal/egress); httpsPorts by the
// sandbox plane (TLS to those guest ports).
type networkJSON struct {
	AllowOut           []string                         `json:"allowOut"`
	DenyOut            []string                         `json:"denyOut"`
	AllowPublicTraffic *bool                            `json:"allowPublicTraffic"`
	MaskRequestHost    *string                          `json:"maskRequestHost"`
	Rules              map[string][]sandbox.NetworkRule `json:"rules"`
	EgressProxy        *sandbox.EgressProxy             `json:"egressProxy"`
	HTTPSPorts         []int                            `json:"httpsPorts"`
}

// networkUpdateJSON is SandboxNetworkUpdateConfig (an omitted field is cleared, as E2B does).
type networkUpdateJSON struct {
	AllowInternetAccess *bool                            `json:"allow_internet_access"`
	AllowOut            []string                         `json:"allowOut"`
	DenyOut             []string                         `json:"denyOut"`
	Rules               map[string][]sandbox.NetworkRule `json:"rules"`
	EgressProxy         *sandbox.EgressProxy             `json:"egressProxy"`
}

// toConfig validates the create request's network object (nil = E2B's defaults); owner is
// whose secrets the rules name.
func (n *networkJSON) toConfig(owner string) (*sandbox.NetworkConfig, error) {
	if n == nil {
		return nil, nil
	}
	c := &sandbox.NetworkConfig{AllowOut: n.AllowOut, DenyOut: n.DenyOut, AllowPublicTraffic: n.AllowPublicTraffic,
		Rules: n.Rules, EgressProxy: n.EgressProxy, HTTPSPorts: n.HTTPSPorts}
	if len(n.Rules) > 0 {
		c.SecretsOwner = owner
	}
	if n.MaskRequestHost != nil {
		c.MaskRequestHost = *n.MaskRequestHost
	}
	if err := sandbox.ValidateNetwork(c); err != nil {
		return nil, err
	}
	return c, nil
}

// networkUpdater is the part of sandbox.Service that changes egress rules at runtime
// (sandbox.Manager implements it).
type networkUpdater interface {
	UpdateNetwork(ctx context.Context, id string, u sandbox.NetworkUpdate) error
}

// updateNetwork is PUT /sandboxes/{id}/network: 204, 400 for bad entries, 404 unknown, 409 not
// running.
func (s *server) updateNetwork(w http.ResponseWriter, r *http.Request, p params) error {
	id, err := sandboxIDParam(p)
	if err != nil {
		return err
	}
	var req networkUpdateJSON
	if err := s.decodeJSON(w, r, &req, false); err != nil {
		return err
	}
	if err := sandbox.ValidateEgress(req.AllowOut, req.DenyOut); err != nil {
		return err
	}
	if err := sandbox.ValidateRules(req.Rules, req.EgressProxy, nil); err != nil {
		return err
	}
	up, ok := s.node.(networkUpdater)
	if !ok {
		return &httpError{status: http.StatusNotImplemented, msg: "updating the network of a sandbox is not supported by this server"}
	}
	if err := up.UpdateNetwork(r.Context(), id, sandbox.NetworkUpdate{
		AllowInternet: req.AllowInternetAccess, AllowOut: req.AllowOut, DenyOut: req.DenyOut,
		Rules: req.Rules, EgressProxy: req.EgressProxy, SecretsOwner: auth.TeamOf(r.Context()),
	}); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// trafficToken is the trafficAccessToken of create/connect responses (null when none).
func trafficToken(sb *sandbox.Sandbox) *string {
	if sb.Network == nil || sb.Network.TrafficAccessToken == "" {
		return nil
	}
	t := sb.Network.TrafficAccessToken
	return &t
}

// networkInfo is SandboxDetail.network (getInfo).
func networkInfo(sb *sandbox.Sandbox) map[string]any {
	out := map[string]any{}
	n := sb.Network
	if n == nil {
		return out
	}
	if len(n.AllowOut) > 0 {
		out["allowOut"] = n.AllowOut
	}
	if len(n.DenyOut) > 0 {
		out["denyOut"] = n.DenyOut
	}
	if n.AllowPublicTraffic != nil {
		out["allowPublicTraffic"] = *n.AllowPublicTraffic
	}
	if n.MaskRequestHost != "" {
		out["maskRequestHost"] = n.MaskRequestHost
	}
	if len(n.Rules) > 0 {
		out["rules"] = n.Rules // headers as given: placeholders, never a secret's value
	}
	if n.EgressProxy != nil { // never the password
		px := map[string]any{"address": n.EgressProxy.Address}
		if n.EgressProxy.Username != "" {
			px["username"] = n.EgressProxy.Username
		}
		out["egressProxy"] = px
	}
	if len(n.HTTPSPorts) > 0 {
		out["httpsPorts"] = n.HTTPSPorts
	}
	return out
}

type proxyHostKey struct{}

// guestAccess applies a sandbox's guest-port controls to a request for port (E2B's proxy does
// the same, and leaves envd's port to envd's own token): it answers 403 when the sandbox wants a
// traffic access token the request lacks (ok false), else returns ctx carrying the Host the
// guest should see, if masked.
func (s *server) guestAccess(ctx context.Context, w http.ResponseWriter, r *http.Request, id string, port int) (context.Context, bool) {
	if port == envdclient.Port {
		return ctx, true
	}
	sbx, err := s.svc.Get(ctx, id)
	if err != nil {
		if st := statusOf(err); st != http.StatusNotFound && st != http.StatusConflict {
			s.log.Warn("guest access", "sandbox_id", id, "err", err)
		}
		writeNotRunningTo(w, r, id, err)
		return ctx, false
	}
	if want := sbx.Network.GuestToken(port); want != "" {
		got := r.Header.Get(sandbox.TrafficAccessTokenHeader)
		msg := ""
		switch {
		case got == "":
			msg = "Sandbox is secured with traffic access token. Token header '" + sandbox.TrafficAccessTokenHeader + "' is missing"
		case subtle.ConstantTimeCompare([]byte(got), []byte(want)) != 1:
			msg = "Sandbox is secured with traffic access token. Provided token in header '" + sandbox.TrafficAccessTokenHeader + "' is invalid"
		}
		if msg != "" {
			writeJSON(w, http.StatusForbidden, notRunningBody{SandboxID: id, Message: msg, Code: http.StatusForbidden})
			return ctx, false
		}
	}
	if h := sbx.Network.GuestHost(port); h != "" {
		ctx = context.WithValue(ctx, proxyHostKey{}, h)
	}
	return ctx, true
}

// guestHost is the Host header to send upstream for the proxied request in.
func guestHost(in *http.Request) string {
	if h, ok := in.Context().Value(proxyHostKey{}).(string); ok && h != "" {
		return h
	}
	return in.Host
}
