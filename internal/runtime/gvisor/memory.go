package gvisor

import (
	"fmt"
	"strconv"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// GCConfig is the Go garbage collector setting of one kind of runsc process. runsc starts the
// sentry with an empty environment and has no flag for its GC, so GOGC and GOMEMLIMIT cannot
// reach it; ember's runsc (scripts/setup.sh adds tools/runscmem to runsc's build) reads them from
// the bundle's annotations at process start and logs "ember: sentry gc-percent N (was M)" to
// the instance's runsc log. A runsc without that addition ignores the annotations.
type GCConfig struct {
	// Percent is debug.SetGCPercent's argument (GOGC): the heap may grow this many percent over
	// the live heap before a collection. 0 leaves Go's default (100); -1 turns the GC off.
	Percent int
	// MemoryLimit is debug.SetMemoryLimit's argument in bytes (GOMEMLIMIT); 0 leaves none.
	MemoryLimit int64
}

// Annotation names read by tools/runscmem (dev.ember.<sentry|gofer>.<setting>).
const (
	annotationGCPercent   = ".gc-percent"
	annotationMemoryLimit = ".memory-limit"
	annotationPrefix      = "dev.ember."
)

// gcAnnotations are the OCI annotations carrying Config.SentryGC and Config.GoferGC (nil if both
// are zero). runsc does not compare them on restore (it validates only dev.gvisor.* keys), so
// an image restores under other settings.
func (d *Driver) gcAnnotations() map[string]string {
	var a map[string]string
	for _, k := range []struct {
		kind string
		gc   GCConfig
	}{{"sentry", d.cfg.SentryGC}, {"gofer", d.cfg.GoferGC}} {
		if k.gc.Percent != 0 {
			if a == nil {
				a = map[string]string{}
			}
			a[annotationPrefix+k.kind+annotationGCPercent] = strconv.Itoa(k.gc.Percent)
		}
		if k.gc.MemoryLimit > 0 {
			if a == nil {
				a = map[string]string{}
			}
			a[annotationPrefix+k.kind+annotationMemoryLimit] = strconv.FormatInt(k.gc.MemoryLimit, 10)
		}
	}
	return a
}

func validateGC(gcs ...GCConfig) error {
	for _, gc := range gcs {
		if gc.Percent < -1 || gc.MemoryLimit < 0 {
			return fmt.Errorf("gvisor: config GC %+v: percent must be -1 or more, memory limit 0 or more: %w", gc, errdefs.ErrInvalid)
		}
	}
	return nil
}
