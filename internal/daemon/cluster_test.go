package daemon

import (
	"context"
	"errors"
	"testing"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Cluster mode needs a node id, and an address other nodes can reach: a wildcard --listen
// without --advertise-url is refused before anything starts.
func TestClusterFlagsChecked(t *testing.T) {
	for _, cfg := range []Config{
		{EtcdEndpoints: []string{"http://127.0.0.1:1"}, Listen: "127.0.0.1:3000"},
		{EtcdEndpoints: []string{"http://127.0.0.1:1"}, Listen: "0.0.0.0:3000", NodeID: "n1"},
		{EtcdEndpoints: []string{"http://127.0.0.1:1"}, Listen: ":3000", NodeID: "n1"},
	} {
		if _, err := openCluster(context.Background(), cfg, nil, nil, nil, nil, nil, nil); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%+v: %v, want invalid", cfg, err)
		}
	}
}
