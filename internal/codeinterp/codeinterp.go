// Package codeinterp defines E2B's Code Interpreter template for ember: `code-interpreter-v1`
// (the template @e2b/code-interpreter and e2b-code-interpreter create by default), built by
// ember itself as an ordinary step build from `base` plus Debian's Jupyter and data packages,
// with ember's own interpreter server (server.py, embedded here) started and its default
// Python kernel warm before the checkpoint, so a create is a restore like any other.
//
// It owns the template's definition only; the build runs in internal/sandbox (builtin.go).
package codeinterp

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/ember-sandbox/ember/internal/template/build"
)

// TemplateName is the template's name and alias, as E2B's.
const TemplateName = "code-interpreter-v1"

// Port is the interpreter server's port inside the sandbox (the SDK's JUPYTER_PORT).
const Port = 49999

// ServerPath is where the server is installed in the template.
const ServerPath = "/opt/ember/code-interpreter/server.py"

//go:embed server.py
var server []byte

// Server returns the interpreter server's source (Python 3).
func Server() []byte { return server }

// Packages are the Debian packages the template adds to base: the kernel and its client, and
// the data stack of E2B's image that Debian bookworm has. No bash or JavaScript Jupyter kernel
// is packaged there: Python runs on a Jupyter kernel, bash on a shell of server.py's own, and
// JavaScript is not offered.
var Packages = []string{
	"python3-ipykernel", "python3-jupyter-client",
	"python3-numpy", "python3-pandas", "python3-matplotlib", "python3-scipy", "python3-seaborn",
	"python3-pil", "python3-requests", "python3-bs4", "python3-openpyxl", "python3-xlrd",
	"python3-sympy", "fonts-dejavu-core",
}

// Template returns the template's definition: a step build from base, with mirror (the Debian
// mirror the daemon builds base from) and suite as the APT source.
func Template(mirror, suite string) build.BuiltinTemplate {
	if mirror == "" {
		mirror = "http://deb.debian.org/debian"
	}
	if suite == "" {
		suite = "bookworm"
	}
	apt := strings.Join([]string{
		fmt.Sprintf("echo 'deb %s %s main' > /etc/apt/sources.list", mirror, suite),
		"rm -f /etc/apt/sources.list.d/*",
		// A pinned mirror snapshot can carry an expired Release date.
		"apt-get -o Acquire::Check-Valid-Until=false -o Acquire::Retries=3 update",
		"DEBIAN_FRONTEND=noninteractive apt-get -o Acquire::Retries=3 install -y --no-install-recommends " + strings.Join(Packages, " "),
		"apt-get clean", "rm -rf /var/lib/apt/lists/*",
	}, " && ")
	files, hash := serverFiles()
	return build.BuiltinTemplate{
		Files: map[string][]byte{hash: files},
		Build: build.StepBuildRequest{
			FromTemplate: "base",
			Steps: []build.Step{
				{Type: "RUN", Args: []string{apt, "root"}},
				{Type: "COPY", Args: []string{"server.py", ServerPath, "root", "0644"}, FilesHash: hash},
			},
			StartCmd: "python3 " + ServerPath,
			// One ready command that waits itself: the default kernel's warm-up (imports, matplotlib's
			// font cache) can outlast the builder's two minutes of retries under gVisor.
			ReadyCmd: fmt.Sprintf("for i in $(seq 1 1200); do curl -sf http://127.0.0.1:%d/health >/dev/null && exit 0; sleep 0.5; done; exit 1", Port),
		},
	}
}

// serverFiles is the COPY step's tarball (server.py alone, as a client uploads the files of a
// COPY) and its hash.
func serverFiles() ([]byte, string) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: "server.py", Mode: 0o644, Size: int64(len(server)), Typeflag: tar.TypeReg})
	tw.Write(server)
	tw.Close()
	sum := sha256.Sum256(buf.Bytes())
	return buf.Bytes(), hex.EncodeToString(sum[:])
}
