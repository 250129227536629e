package codeinterp

import (
	"bytes"
	"encoding/base64"
	"regexp"
	"strings"
	"testing"
)

// TestTemplateInstallsTheServerAndPackages: the definition is a step build from base whose
// steps point APT at the given mirror, install every package, and write server.py verbatim.
func TestTemplateInstallsTheServerAndPackages(t *testing.T) {
	def := Template("http://mirror.test/debian", "bookworm")
	if def.Build.FromTemplate != "base" || def.Build.FromImage != "" {
		t.Fatalf("built from %+v, want base", def.Build)
	}
	if len(def.Build.Steps) != 2 {
		t.Fatalf("steps %+v", def.Build.Steps)
	}
	apt := def.Build.Steps[0]
	if apt.Type != "RUN" || apt.Args[1] != "root" || !strings.Contains(apt.Args[0], "deb http://mirror.test/debian bookworm main") {
		t.Fatalf("apt step %q", apt.Args)
	}
	for _, p := range Packages {
		if !strings.Contains(apt.Args[0], " "+p) {
			t.Fatalf("package %s is not installed: %q", p, apt.Args[0])
		}
	}
	inst := def.Build.Steps[1]
	m := regexp.MustCompile(`echo ([A-Za-z0-9+/=]+) \| base64 -d > ` + regexp.QuoteMeta(ServerPath)).FindStringSubmatch(inst.Args[0])
	if m == nil {
		t.Fatalf("install step %q", inst.Args[0])
	}
	got, err := base64.StdEncoding.DecodeString(m[1])
	if err != nil || !bytes.Equal(got, Server()) {
		t.Fatalf("the installed server differs from server.py (%v)", err)
	}
	if !strings.Contains(def.Build.StartCmd, ServerPath) || !strings.Contains(def.Build.ReadyCmd, "49999/health") {
		t.Fatalf("start %q, ready %q", def.Build.StartCmd, def.Build.ReadyCmd)
	}
	if d := Template("", ""); !strings.Contains(d.Build.Steps[0].Args[0], "deb http://deb.debian.org/debian bookworm main") {
		t.Fatalf("default mirror: %q", d.Build.Steps[0].Args[0])
	}
}
