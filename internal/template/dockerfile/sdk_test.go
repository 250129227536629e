package dockerfile

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/ember-sandbox/ember/internal/testutil"
)

// sdkDockerfile uses only what the SDK's fromDockerfile and ember agree on (no variable
// substitution, no CMD, .dockerignore patterns with the same meaning in both).
const sdkDockerfile = `FROM e2bdev/base
RUN apt-get update && apt-get install -y curl
ENV A=1 B=2
ARG V=3
WORKDIR /app
COPY app /app/
COPY --chown=user:user . /ctx
COPY app/*.py /py/
COPY ./app/sub /sub
COPY **/*.txt /txt/
COPY run.sh link-to-file link-outside /bin/
COPY dirlink /d
COPY app/ /x
COPY ap* /y/
COPY */ /z/
COPY app/sub/* /w/
COPY ./ /r/
COPY app/?ain.py app/[mu]*.py /m/
COPY **/ /q/
COPY ünïcödé /u
USER user
`

// TestSameStepsAsTheSDK builds the same Dockerfile with the official SDK's
// Template().fromDockerfile() (from test/sdk/node_modules) and with Translate, on one context,
// and wants the same steps: the same encoding and the same filesHash for every COPY, so the
// daemon's caches are shared with SDK builds.
func TestSameStepsAsTheSDK(t *testing.T) {
	sdk := filepath.Join(testutil.RepoRoot(), "test", "sdk", "node_modules", "e2b", "dist", "index.mjs")
	_, err := os.Stat(sdk)
	testutil.Need(t, err == nil, "the e2b SDK is not installed (cd test/sdk && npm ci)")
	node, err := exec.LookPath("node")
	testutil.Need(t, err == nil, "node is not installed")

	ctx := t.TempDir()
	writeTree(t, ctx, map[string]string{
		".dockerignore":       "*.log\n",
		"top.log":             "ignored by both",
		"app/main.py":         "print('hi')\n",
		"app/util.py":         "x = 1\n",
		"app/.env":            "SECRET=1",
		"app/sub/deep/a.txt":  "a",
		"app/sub/empty/":      "",
		"app.txt":             "sorts before app/ in JavaScript's order",
		"app-b/x.txt":         "x",
		"notes.txt":           "n",
		"ünïcödé/ß.txt":       "utf-8 names",
		"run.sh":              "#!/bin/sh\necho run\n",
		"link-to-file":        "->run.sh",
		"link-outside":        "->/etc/hostname",
		"dirlink":             "->app/sub",
		"dangling":            "->nowhere",
		"big/blob.bin":        string(make([]byte, 300000)),
		"nested/keep.log.txt": "not a .log",
	})
	if err := os.Chmod(filepath.Join(ctx, "run.sh"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(ctx, "app", "util.py"), 0o600); err != nil {
		t.Fatal(err)
	}

	script := filepath.Join(t.TempDir(), "sdk.mjs")
	if err := os.WriteFile(script, []byte(`
import { Template } from `+jsString(sdk)+`
const t = Template({ fileContextPath: process.argv[2] }).fromDockerfile(process.argv[3])
console.log(await t.toJSON(true))
`), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(node, script, ctx, sdkDockerfile).Output()
	if err != nil {
		if ee, ok := err.(*exec.ExitError); ok {
			t.Fatalf("node: %v\n%s", err, ee.Stderr)
		}
		t.Fatal(err)
	}
	var want Request
	if err := json.Unmarshal(out, &want); err != nil {
		t.Fatalf("SDK output %s: %v", out, err)
	}

	res, err := Translate(Options{Dockerfile: []byte(sdkDockerfile), Context: ctx})
	if err != nil {
		t.Fatal(err)
	}
	got := res.Request
	if got.FromImage != want.FromImage {
		t.Errorf("fromImage: ember %q, SDK %q", got.FromImage, want.FromImage)
	}
	if len(got.Steps) != len(want.Steps) {
		t.Fatalf("ember has %d steps, the SDK %d:\n ember %+v\n   SDK %+v", len(got.Steps), len(want.Steps), got.Steps, want.Steps)
	}
	copies := 0
	for i := range want.Steps {
		if !reflect.DeepEqual(got.Steps[i], want.Steps[i]) {
			t.Errorf("step %d:\n ember %+v\n   SDK %+v", i, got.Steps[i], want.Steps[i])
		}
		if want.Steps[i].Type == "COPY" {
			copies++
		}
	}
	if copies != 18 {
		t.Errorf("the SDK made %d COPY steps, want 18", copies)
	}
	// The whole body, field by field as JSON (names, omitted fields, types).
	mine, err := json.Marshal(got)
	if err != nil {
		t.Fatal(err)
	}
	var a, b map[string]any
	json.Unmarshal(mine, &a)
	json.Unmarshal(out, &b)
	if !reflect.DeepEqual(a, b) {
		t.Errorf("build request JSON differs:\n ember %s\n   SDK %s", mine, out)
	}
}

func jsString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}
