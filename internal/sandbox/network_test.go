package sandbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/envdclient"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

func TestValidateEgress(t *testing.T) {
	for _, tc := range []struct {
		name        string
		allow, deny []string
		msg         string // "" = valid; else the exact message (prefix match with "…")
	}{
		{"empty", nil, nil, ""},
		{"ips and cidrs", []string{"1.1.1.1", "8.8.8.0/24"}, []string{"0.0.0.0/0", "9.9.9.9"}, ""},
		{"allow ALL_TRAFFIC", []string{"0.0.0.0/0"}, nil, ""},
		{"deny domain", nil, []string{"example.com"}, "invalid denied CIDR example.com"},
		{"deny garbage", nil, []string{"1.2.3.4/99"}, "invalid denied CIDR 1.2.3.4/99"},
		{"deny ipv6", nil, []string{"::1"}, "invalid denied CIDR ::1: only IPv4 addresses and CIDRs are supported"},
		{"allow unspecified", []string{"0.0.0.0"}, nil, "invalid allowed address 0.0.0.0"},
		{"allow unspecified /8", []string{"0.0.0.0/8"}, nil, "invalid allowed address 0.0.0.0/8"},
		{"allow ipv6", []string{"2001:db8::/32"}, nil, "invalid allowed address 2001:db8::/32: only IPv4 addresses and CIDRs are supported"},
		{"domain needs ALL_TRAFFIC", []string{"example.com"}, []string{"8.8.8.8"}, ErrMsgDomainsRequireBlockAll},
		{"too many", make([]string, MaxEgressEntries+1), nil, "allow out and deny out may hold at most 1024 entries each"},
		{"port rule", []string{"1.1.1.1:443"}, []string{"0.0.0.0/0"}, "invalid entry 1.1.1.1:443: port-specific rules are not supported…"},
		{"domains", []string{"1.1.1.1", "*.example.com", "api.example.org"}, []string{"0.0.0.0/0"}, ""},
		{"internal name", []string{"db.internal"}, []string{"0.0.0.0/0"}, "invalid allowed address db.internal: internal names cannot be reached from a sandbox"},
		{"bad name", []string{"a_b!"}, []string{"0.0.0.0/0"}, "invalid allowed address a_b!: not a host name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := ValidateEgress(tc.allow, tc.deny)
			if tc.msg == "" {
				if err != nil {
					t.Fatalf("ValidateEgress: %v", err)
				}
				return
			}
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("err = %v, want ErrInvalid", err)
			}
			want, prefix := strings.CutSuffix(tc.msg, "…")
			if got := err.Error(); (prefix && !strings.HasPrefix(got, want)) || (!prefix && got != want) {
				t.Fatalf("message %q, want %q", got, tc.msg)
			}
		})
	}
}

func TestEgressOfSandbox(t *testing.T) {
	p := netip.MustParsePrefix
	sb := &Sandbox{AllowInternet: false, Network: &NetworkConfig{AllowOut: []string{"1.1.1.1"}, DenyOut: []string{"8.8.8.8/24"}}}
	e := sb.Egress()
	if e.AllowInternet || fmt.Sprint(e.AllowOut) != fmt.Sprint([]netip.Prefix{p("1.1.1.1/32")}) || fmt.Sprint(e.DenyOut) != fmt.Sprint([]netip.Prefix{p("8.8.8.0/24")}) {
		t.Fatalf("Egress = %+v", e)
	}
	if !(&Sandbox{AllowInternet: true}).Egress().IsDefault() {
		t.Fatal("no network config must be the default egress")
	}
	broken := &Sandbox{AllowInternet: true, Network: &NetworkConfig{DenyOut: []string{"example.com"}}}
	if e := broken.Egress(); e.AllowInternet || len(e.AllowOut) != 0 {
		t.Fatalf("an unparsable stored rule must deny everything, got %+v", e)
	}
	f := false
	for _, tc := range []struct {
		req  CreateRequest
		want bool
	}{
		{CreateRequest{}, true},
		{CreateRequest{AllowInternet: &f}, false},
		{CreateRequest{Network: &NetworkConfig{MaskRequestHost: "x"}}, true},
		{CreateRequest{Network: &NetworkConfig{DenyOut: []string{"1.1.1.1"}}}, false},
	} {
		if got := tc.req.IsDefaultEgress(); got != tc.want {
			t.Errorf("IsDefaultEgress(%+v) = %v", tc.req, got)
		}
	}
}

func TestNetworkConfigForNew(t *testing.T) {
	f := false
	n := &NetworkConfig{AllowPublicTraffic: &f, AllowOut: []string{"1.1.1.1"}, TrafficAccessToken: "old", MaskRequestHost: "h:${PORT}"}
	a, b := n.ForNew(), n.ForNew()
	if a.TrafficAccessToken == "" || a.TrafficAccessToken == "old" || a.TrafficAccessToken == b.TrafficAccessToken {
		t.Fatalf("tokens %q %q: want fresh, distinct ones", a.TrafficAccessToken, b.TrafficAccessToken)
	}
	a.AllowOut[0] = "9.9.9.9"
	if n.AllowOut[0] != "1.1.1.1" {
		t.Fatal("ForNew shares the allow list")
	}
	if a.GuestToken(8080) != a.TrafficAccessToken || a.GuestToken(envdclient.Port) != "" {
		t.Fatalf("GuestToken: %q / %q", a.GuestToken(8080), a.GuestToken(envdclient.Port))
	}
	if a.GuestHost(8080) != "h:8080" || a.GuestHost(envdclient.Port) != "" {
		t.Fatalf("GuestHost: %q / %q", a.GuestHost(8080), a.GuestHost(envdclient.Port))
	}
	if (&NetworkConfig{}).ForNew().TrafficAccessToken != "" || (*NetworkConfig)(nil).ForNew() != nil {
		t.Fatal("public traffic must not get a token")
	}
}

// netStub records Update calls; it fails the test on calls it does not expect.
type netStub struct {
	t       *testing.T
	updates []string
	fail    error
}

func (n *netStub) Acquire(context.Context, Egress) (Slot, error) {
	n.t.Error("unexpected Acquire")
	return Slot{}, errors.New("unexpected")
}
func (n *netStub) Adopt(int, Egress) (Slot, error) {
	n.t.Error("unexpected Adopt")
	return Slot{}, errors.New("unexpected")
}
func (n *netStub) Release(context.Context, int) error { n.t.Error("unexpected Release"); return nil }
func (n *netStub) Reconcile(context.Context, []int) error {
	n.t.Error("unexpected Reconcile")
	return nil
}
func (n *netStub) Update(_ context.Context, index int, e Egress) error {
	if n.fail != nil {
		return n.fail
	}
	n.updates = append(n.updates, fmt.Sprintf("%d %v %v %v", index, e.AllowInternet, e.AllowOut, e.DenyOut))
	return nil
}

type storeStub struct {
	Store
	puts []*Sandbox
}

func (s *storeStub) PutSandbox(_ context.Context, sb *Sandbox) error {
	c := *sb
	s.puts = append(s.puts, &c)
	return nil
}

func TestUpdateNetwork(t *testing.T) {
	net := &netStub{t: t}
	st := &storeStub{}
	m := &Manager{cfg: Config{Network: net, Store: st}, log: slog.New(slog.DiscardHandler), live: map[string]*entry{}}
	f := false
	run := &Sandbox{ID: "srun", State: StateRunning, AllowInternet: true, Runtime: Placement{SlotIndex: 7},
		Network: &NetworkConfig{DenyOut: []string{"9.9.9.9"}, AllowPublicTraffic: &f, TrafficAccessToken: "tok"}}
	m.live["srun"] = &entry{sb: run}
	m.live["spaused"] = &entry{sb: &Sandbox{ID: "spaused", State: StatePaused}}
	ctx := context.Background()

	if err := m.UpdateNetwork(ctx, "srun", NetworkUpdate{AllowOut: []string{"1.1.1.1"}, DenyOut: []string{AllTraffic}}); err != nil {
		t.Fatal(err)
	}
	if err := m.UpdateNetwork(ctx, "srun", NetworkUpdate{AllowInternet: &f}); err != nil {
		t.Fatal(err)
	}
	want := []string{"7 true [1.1.1.1/32] [0.0.0.0/0]", "7 false [] []"}
	if fmt.Sprint(net.updates) != fmt.Sprint(want) {
		t.Fatalf("slot updates %q, want %q", net.updates, want)
	}
	if run.AllowInternet || len(run.Network.AllowOut) != 0 || run.Network.TrafficAccessToken != "tok" {
		t.Fatalf("record after update: %+v %+v", run, run.Network)
	}
	if len(st.puts) != 2 || st.puts[1].AllowInternet {
		t.Fatalf("record not persisted: %d puts", len(st.puts))
	}
	for _, tc := range []struct {
		id   string
		u    NetworkUpdate
		want error
	}{
		{"nosuch", NetworkUpdate{}, errdefs.ErrNotFound},
		{"spaused", NetworkUpdate{}, errdefs.ErrConflict},
		{"srun", NetworkUpdate{DenyOut: []string{"bad"}}, errdefs.ErrInvalid},
	} {
		if err := m.UpdateNetwork(ctx, tc.id, tc.u); !errors.Is(err, tc.want) {
			t.Errorf("UpdateNetwork(%s, %+v) = %v, want %v", tc.id, tc.u, err, tc.want)
		}
	}
	// A failed slot update leaves the record as it was.
	net.fail = fmt.Errorf("nft: %w", errdefs.ErrUnavailable)
	if err := m.UpdateNetwork(ctx, "srun", NetworkUpdate{DenyOut: []string{"1.2.3.4"}}); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("failed update: %v", err)
	}
	if run.AllowInternet || len(run.Network.DenyOut) != 0 {
		t.Fatalf("record changed by a failed update: %+v", run.Network)
	}
}
