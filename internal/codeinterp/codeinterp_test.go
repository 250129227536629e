package codeinterp

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"strings"
	"testing"
)

// TestTemplateInstallsTheServerAndPackages: the definition is a step build from base whose
// steps point APT at the given mirror, install every package, and copy server.py verbatim.
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
	cp := def.Build.Steps[1]
	if cp.Type != "COPY" || cp.Args[0] != "server.py" || cp.Args[1] != ServerPath {
		t.Fatalf("copy step %+v", cp)
	}
	data, ok := def.Files[cp.FilesHash]
	if sum := sha256.Sum256(data); !ok || hex.EncodeToString(sum[:]) != cp.FilesHash {
		t.Fatalf("the COPY step's files are not under their hash %s", cp.FilesHash)
	}
	tr := tar.NewReader(bytes.NewReader(data))
	h, err := tr.Next()
	if err != nil || h.Name != "server.py" {
		t.Fatalf("tarball: %v %+v", err, h)
	}
	got, _ := io.ReadAll(tr)
	if !bytes.Equal(got, Server()) {
		t.Fatal("the installed server differs from server.py")
	}
	if !strings.Contains(def.Build.StartCmd, ServerPath) || !strings.Contains(def.Build.ReadyCmd, "49999/health") {
		t.Fatalf("start %q, ready %q", def.Build.StartCmd, def.Build.ReadyCmd)
	}
	if d := Template("", ""); !strings.Contains(d.Build.Steps[0].Args[0], "deb http://deb.debian.org/debian bookworm main") {
		t.Fatalf("default mirror: %q", d.Build.Steps[0].Args[0])
	}
}
