// Package cluster makes ember nodes one cluster on etcd: membership and liveness under leases
// (a node that cannot renew for a whole TTL fences itself), watch-fed caches of the nodes and
// of the sandbox → node routes, placement with atomic reservations (transactions that compare
// revisions, so that two edges never overcommit one node), the cluster's API keys, and node
// loss (a dead node's sandboxes are marked lost, its capacity released). It knows nothing of
// HTTP or of the runtime: the daemon gives it a Local view of the node's sandboxes, and the API
// consults it through small methods (Locate, Place, Claim, Release, Nodes).
//
// Keys under the prefix (default "/ember/"):
//
//	nodes/<id>          NodeInfo, under the node's lease (its epoch)
//	alloc/<id>          Alloc (what is reserved or running there), under the node's lease
//	drain/<id>          present while the node is drained (no lease)
//	resv/<id>/<rid>     a reservation made by an edge, under the edge's lease
//	sandboxes/<sid>     Route (which node and epoch hold the sandbox), no lease
//	lost/<sid>          Lost (the sandbox died with its node), under a one-day lease
//	down/<id>           the time a node was found dead, under a one-day lease
//	reaping/<id>/<ep>   the live node marking a dead epoch's sandboxes lost, under its lease
//	apikeys/<id>        the cluster's API keys (auth.Key), no lease
//	templates/<id>      SharedTemplate: a template every node can load from the image store, no lease
//	secret              the key nodes sign their requests to each other with (no lease)
package cluster

import "time"

// Capacity is what a node offers.
type Capacity struct {
	CPU        int   `json:"cpu"`        // cores
	MemoryMB   int64 `json:"memoryMB"`   // memory for sandboxes
	Slots      int   `json:"slots"`      // sandboxes at once
	DiskFreeMB int64 `json:"diskFreeMB"` // free disk of the data directory
}

// TemplateSize is what one sandbox of a template takes.
type TemplateSize struct {
	CPU      int `json:"cpu"`
	MemoryMB int `json:"memoryMB"`
}

// NodeInfo is a node's record, published under its lease.
type NodeInfo struct {
	ID        string                  `json:"nodeID"`
	URL       string                  `json:"url"`
	Capacity  Capacity                `json:"capacity"`
	Runsc     string                  `json:"runscVersion"`
	CPUClass  string                  `json:"cpuClass"`
	Templates map[string]TemplateSize `json:"templates,omitempty"`
	// Builtins are the built-in templates the node builds itself on first use (E2B's
	// code-interpreter-v1), with the size of a sandbox of each: placement sends a create of
	// one that no node has yet to a node that can build it.
	Builtins map[string]TemplateSize `json:"builtins,omitempty"`
	Started  time.Time               `json:"startedAt"`
	// Epoch is the lease the record is under (not stored: from etcd).
	Epoch int64 `json:"-"`
}

// Alloc is what is reserved or running on a node.
type Alloc struct {
	Slots    int   `json:"slots"`
	CPU      int   `json:"cpu"`
	MemoryMB int64 `json:"memoryMB"`
}

func (a Alloc) add(s TemplateSize, sign int) Alloc {
	a.Slots += sign
	a.CPU += sign * s.CPU
	a.MemoryMB += int64(sign * s.MemoryMB)
	return a
}

// Route says which node (and which of its epochs) holds a sandbox.
type Route struct {
	Node string `json:"node"`
	// Team owns the sandbox ("" : the default team): every edge answers another team's
	// sandbox as a missing one without asking its node.
	Team       string    `json:"team,omitempty"`
	Epoch      int64     `json:"epoch"`
	TemplateID string    `json:"templateID,omitempty"`
	CPU        int       `json:"cpu,omitempty"`
	MemoryMB   int       `json:"memoryMB,omitempty"`
	Since      time.Time `json:"since"`
	// Stored: the sandbox is paused and its pause image is in the image store (stored/<sid>):
	// any node may resume it once its node is gone or drained (moves.go).
	Stored bool `json:"stored,omitempty"`
	// Volumes are the ids of the volumes the sandbox mounts: a volume is not destroyed while a
	// route names it (volumes.go).
	Volumes []string `json:"volumes,omitempty"`
	modRev  int64
	gen     uint64 // when this node cached it (cache.go)
}

// Lost records a sandbox that died with its node.
type Lost struct {
	Node   string    `json:"node"`
	Team   string    `json:"team,omitempty"` // from the route it replaced
	At     time.Time `json:"at"`
	Reason string    `json:"reason"`
	// From the route it replaced (absent in records written before they were kept).
	TemplateID string    `json:"templateID,omitempty"`
	CPU        int       `json:"cpu,omitempty"`
	MemoryMB   int       `json:"memoryMB,omitempty"`
	Since      time.Time `json:"since,omitzero"`
}

// Node states in NodeView.
const (
	StateActive   = "active"
	StateDraining = "draining"
	StateFenced   = "fenced" // this node, cut off from etcd: it serves nothing until it is back
	StateLost     = "lost"   // its lease expired: its sandboxes are lost
)

// NodeView is a node as GET /nodes shows it.
type NodeView struct {
	ID        string    `json:"nodeID"`
	State     string    `json:"state"`
	URL       string    `json:"url,omitempty"`
	Capacity  Capacity  `json:"capacity"`
	Allocated Alloc     `json:"allocated"`
	Runsc     string    `json:"runscVersion,omitempty"`
	CPUClass  string    `json:"cpuClass,omitempty"`
	Templates []string  `json:"templates,omitempty"`
	Sandboxes []string  `json:"sandboxes"`
	Since     time.Time `json:"since,omitzero"` // started, or found dead
	// Routes counts the sandboxes routed to the node (len(Sandboxes)).
	Routes int `json:"routes"`
	// LeaseTTL is the node's lease as granted, LeaseAge the time since it was last renewed
	// (seconds, as etcd counts them; absent for a node found dead).
	LeaseTTL float64 `json:"leaseTTLSeconds,omitempty"`
	LeaseAge float64 `json:"leaseAgeSeconds"`
	epoch    int64
}

// LocalSandbox is one sandbox this node holds (running or paused).
type LocalSandbox struct {
	ID         string
	Team       string
	TemplateID string
	Running    bool
	CPU        int
	MemoryMB   int
	Volumes    []string // ids of the volumes it mounts
}
