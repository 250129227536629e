package api

import "testing"

// TestTemplateListShowsResources: `e2b template list` (@e2b/cli) prints aliases as the
// template's name and cpuCount, memoryMB and diskSizeMB; a template built with the node's
// defaults shows those defaults, not zeros, and its name as its alias.
func TestTemplateListShowsResources(t *testing.T) {
	e := newEnv(t)
	var ts []templateJSON
	e.ctl("GET", "/templates", "").json(t, &ts)
	if len(ts) != 1 {
		t.Fatalf("templates %+v", ts)
	}
	got := ts[0]
	if got.TemplateID != "base" || len(got.Aliases) != 1 || got.Aliases[0] != "base" {
		t.Fatalf("base's aliases: %+v", got)
	}
	// newService's node defaults: 2 vCPUs, 512 MiB, 1024 MiB of disk.
	if got.CPUCount != 2 || got.MemoryMB != 512 || got.DiskSizeMB != 1024 {
		t.Fatalf("base's resources: cpu %d, memory %d MiB, disk %d MiB; want 2, 512, 1024", got.CPUCount, got.MemoryMB, got.DiskSizeMB)
	}
	var one templateWithBuilds
	e.ctl("GET", "/templates/base", "").json(t, &one)
	if len(one.Aliases) != 1 || len(one.Builds) != 1 || one.Builds[0].CPUCount != 2 || one.Builds[0].MemoryMB != 512 {
		t.Fatalf("GET /templates/base: %+v", one)
	}
}
