package local_test

import (
	"testing"

	"github.com/ember-sandbox/ember/internal/snapshot"
	"github.com/ember-sandbox/ember/internal/snapshot/local"
	"github.com/ember-sandbox/ember/internal/snapshot/snapshottest"
)

func TestConformance(t *testing.T) {
	snapshottest.Run(t, func(t *testing.T) snapshot.Backend {
		b, err := local.New(t.TempDir())
		if err != nil {
			t.Fatal(err)
		}
		return b
	})
}
