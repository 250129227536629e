package dockerfile

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"errors"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// writeTree creates files under dir: a value "->target" makes a symlink, a key ending in /
// a directory.
func writeTree(t *testing.T, dir string, files map[string]string) {
	t.Helper()
	for name, body := range files {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		switch {
		case strings.HasSuffix(name, "/"):
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
		case strings.HasPrefix(body, "->"):
			if err := os.Symlink(body[2:], p); err != nil {
				t.Fatal(err)
			}
		default:
			if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
}

func translate(t *testing.T, dockerfile string, files map[string]string, args map[string]string) (*Result, error) {
	t.Helper()
	dir := t.TempDir()
	writeTree(t, dir, files)
	return Translate(Options{Dockerfile: []byte(dockerfile), Context: dir, BuildArgs: args})
}

func st(typ string, args ...string) Step { return Step{Type: typ, Args: args} }

var (
	asRoot  = []Step{st("USER", "root"), st("WORKDIR", "/")}
	asUser  = []Step{st("USER", "user"), st("WORKDIR", "/home/user")}
	withAll = func(mid ...Step) []Step { return append(append(append([]Step{}, asRoot...), mid...), asUser...) }
)

func TestTranslate(t *testing.T) {
	for _, tc := range []struct {
		name       string
		dockerfile string
		args       map[string]string
		from       string
		steps      []Step
		startCmd   string
	}{
		{name: "run env workdir user",
			dockerfile: "FROM base\nRUN apt-get update &&   apt-get install -y curl\nENV A=1 B=\"x y\"\nWORKDIR /app\nUSER nobody\n",
			from:       "base",
			steps: append(append([]Step{}, asRoot...), st("RUN", "apt-get update &&   apt-get install -y curl"),
				st("ENV", "A", "1", "B", "x y"), st("WORKDIR", "/app"), st("USER", "nobody"))},
		{name: "defaults of the SDK when USER and WORKDIR are absent",
			dockerfile: "FROM e2bdev/base\nRUN true\n", from: "e2bdev/base", steps: withAll(st("RUN", "true"))},
		{name: "continuation lines and comments",
			dockerfile: "# syntax comment\nFROM base\nRUN echo a \\\n    && echo b\n", from: "base",
			steps: withAll(st("RUN", "echo a     && echo b"))},
		{name: "exec form RUN is quoted",
			dockerfile: "FROM base\nRUN [\"sh\", \"-c\", \"echo 'hi there'\"]\n", from: "base",
			steps: withAll(st("RUN", `sh -c 'echo '\''hi there'\'''`))},
		{name: "ENV legacy form",
			dockerfile: "FROM base\nENV GREETING hello world\n", from: "base",
			steps: withAll(st("ENV", "GREETING", "hello world"))},
		{name: "ARG default, ARG as ENV, substitution in ENV and WORKDIR",
			dockerfile: "FROM base\nARG VER=1.2\nARG NOVAL\nENV APP_VER=v$VER DIR=/opt/${VER}\nWORKDIR /srv/$VER\n",
			from:       "base",
			steps: append(append([]Step{}, asRoot...), st("ENV", "VER", "1.2"), st("ENV", "NOVAL", ""),
				st("ENV", "APP_VER", "v1.2", "DIR", "/opt/1.2"), st("WORKDIR", "/srv/1.2"), st("USER", "user"))},
		{name: "build arg overrides the default",
			dockerfile: "FROM base\nARG VER=1.2\nRUN echo $VER\n", args: map[string]string{"VER": "9"},
			from: "base", steps: withAll(st("ENV", "VER", "9"), st("RUN", "echo $VER"))},
		{name: "ARG before FROM names the base",
			dockerfile: "ARG BASE=base\nFROM ${BASE}\n", args: map[string]string{"BASE": "python:3.12"},
			from: "python:3.12", steps: append(append([]Step{}, asRoot...), append([]Step{st("ENV", "BASE", "python:3.12")}, asUser...)...)},
		{name: "variables the Dockerfile does not define are left for the build's shell",
			dockerfile: "FROM base\nENV PATH=/opt/bin:$PATH X=${UNSET:-d} Y=${HOME}/y\n", from: "base",
			steps: withAll(st("ENV", "PATH", "/opt/bin:$PATH", "X", "${UNSET:-d}", "Y", "${HOME}/y"))},
		{name: "ENV sees values set before the instruction",
			dockerfile: "FROM base\nENV A=1\nENV A=2 B=$A\n", from: "base",
			steps: withAll(st("ENV", "A", "1"), st("ENV", "A", "2", "B", "1"))},
		{name: "CMD exec form is the start command",
			dockerfile: "FROM base\nCMD [\"python3\", \"-m\", \"http.server\", \"8000\"]\n", from: "base",
			steps: withAll(), startCmd: "python3 -m http.server 8000"},
		{name: "CMD shell form",
			dockerfile: "FROM base\nCMD node server.js > /tmp/log 2>&1\n", from: "base",
			steps: withAll(), startCmd: "node server.js > /tmp/log 2>&1"},
		{name: "ENTRYPOINT exec form takes CMD as arguments",
			dockerfile: "FROM base\nCMD [\"--port\", \"80\"]\nENTRYPOINT [\"/usr/bin/app\", \"serve\"]\n", from: "base",
			steps: withAll(), startCmd: "/usr/bin/app serve --port 80"},
		{name: "ENTRYPOINT shell form ignores CMD",
			dockerfile: "FROM base\nENTRYPOINT /usr/bin/app serve\nCMD [\"x\"]\n", from: "base",
			steps: withAll(), startCmd: "/usr/bin/app serve"},
		{name: "the last CMD wins",
			dockerfile: "FROM base\nCMD [\"a\"]\nCMD [\"b c\"]\n", from: "base", steps: withAll(), startCmd: "'b c'"},
		{name: "harmless instructions are ignored",
			dockerfile: "FROM base\nLABEL a=b\nEXPOSE 80\nMAINTAINER me\nSTOPSIGNAL SIGTERM\nVOLUME /data\n", from: "base",
			steps: withAll()},
		{name: "lower-case instructions",
			dockerfile: "from base\nrun true\n", from: "base", steps: withAll(st("RUN", "true"))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res, err := translate(t, tc.dockerfile, nil, tc.args)
			if err != nil {
				t.Fatal(err)
			}
			r := res.Request
			if r.FromImage != tc.from || r.FromTemplate != "" {
				t.Errorf("from: got image %q template %q, want image %q", r.FromImage, r.FromTemplate, tc.from)
			}
			if !reflect.DeepEqual(r.Steps, tc.steps) {
				t.Errorf("steps:\n got %+v\nwant %+v", r.Steps, tc.steps)
			}
			if r.StartCmd != tc.startCmd {
				t.Errorf("startCmd: got %q, want %q", r.StartCmd, tc.startCmd)
			}
		})
	}
}

func TestTranslateErrors(t *testing.T) {
	files := map[string]string{"a.txt": "a", "sub/b.txt": "b", "out": "->/etc", "deep/out": "->../../", "lnk": "->sub"}
	for _, tc := range []struct{ dockerfile, want string }{
		{"FROM base\nRUN true\nHEALTHCHECK CMD curl -f http://localhost/\n", "Dockerfile:3: HEALTHCHECK is not supported"},
		{"FROM base\nONBUILD RUN true\n", "Dockerfile:2: ONBUILD is not supported"},
		{"FROM base\nSHELL [\"/bin/bash\", \"-c\"]\n", "Dockerfile:2: SHELL is not supported"},
		{"FROM base AS build\nRUN true\nFROM base\nCOPY --from=build /x /x\n", "Dockerfile:3: multi-stage builds are not supported (a second FROM)"},
		{"FROM base\nCOPY --from=other:1 /x /x\n", "Dockerfile:2: COPY --from is not supported (multi-stage builds)"},
		{"FROM base\nRUN --mount=type=cache,target=/root/.cache pip install x\n", "Dockerfile:2: RUN --mount is not supported"},
		{"FROM base\nRUN --network=none true\n", "Dockerfile:2: RUN --network is not supported"},
		{"FROM base\nRUN <<EOF\necho hi\nEOF\n", "Dockerfile:2: heredocs are not supported"},
		{"FROM base\n\nADD https://example.com/x.tgz /x\n", "Dockerfile:3: ADD of a URL (https://example.com/x.tgz) is not supported: download it in a RUN step"},
		{"FROM base\nCOPY ../secret /x\n", `Dockerfile:2: COPY: source "../secret" is outside the build context`},
		{"FROM base\nCOPY sub/../../x /x\n", `Dockerfile:2: COPY: source "sub/../../x" is outside the build context`},
		{"FROM base\nCOPY /etc/passwd /x\n", `Dockerfile:2: COPY: source "/etc/passwd" must be a path inside the build context`},
		{"FROM base\nCOPY out/passwd /x\n", `Dockerfile:2: COPY: source "out/passwd": its path leaves the build context through a symlink (to /etc)`},
		{"FROM base\nCOPY out/pass* /x/\n", `Dockerfile:2: COPY: source "out/pass*": its path leaves the build context through a symlink (to /etc)`},
		{"FROM base\nCOPY missing.txt /x\n", `Dockerfile:2: COPY: no files found for source "missing.txt" in the build context`},
		{"FROM base\nCOPY a.txt sub/b.txt /x\n", "Dockerfile:2: COPY with several sources needs a destination ending in /"},
		{"FROM base\nCOPY --chmod=rwx a.txt /x\n", "Dockerfile:2: COPY --chmod=rwx: want an octal mode such as 0755"},
		{"FROM base\nCOPY --exclude=*.md . /x\n", "Dockerfile:2: COPY --exclude is not supported"},
		{"RUN true\nFROM base\n", "Dockerfile:1: RUN before FROM"},
		{"# nothing\nARG X=1\n", "Dockerfile: no FROM instruction"},
		{"FROM scratch\n", `Dockerfile:1: FROM "scratch" is not supported: a template needs a base with a shell`},
		{"FROM --platform=linux/arm64 base\n", "Dockerfile:1: FROM --platform is not supported"},
		{"FROM base\nFROBNICATE x\n", "Dockerfile:2: unknown instruction: FROBNICATE"},
		{"FROM base\nCOPY onlyone\n", "Dockerfile:2: COPY requires at least two arguments"},
		{"", "Dockerfile: file with no instructions"},
	} {
		t.Run(strings.SplitN(tc.want, ": ", 3)[len(strings.SplitN(tc.want, ": ", 3))-1], func(t *testing.T) {
			_, err := translate(t, tc.dockerfile, files, nil)
			if err == nil {
				t.Fatalf("no error, want %q", tc.want)
			}
			if !strings.HasPrefix(err.Error(), tc.want) {
				t.Errorf("error:\n got %q\nwant %q", err, tc.want)
			}
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Errorf("%v is not ErrInvalid", err)
			}
		})
	}
}

func TestWarnings(t *testing.T) {
	res, err := translate(t, "FROM base\nLABEL a=b\nEXPOSE 80\nADD app.tar.gz /opt/\n", map[string]string{"app.tar.gz": "x"},
		map[string]string{"UNUSED": "1", "ALSO": "2"})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"Dockerfile:2: LABEL is ignored",
		"Dockerfile:3: EXPOSE is ignored",
		"Dockerfile:4: ADD copies app.tar.gz as a file, it does not extract archives (use RUN tar -x)",
		"Dockerfile: build arguments not consumed by any ARG: ALSO, UNUSED",
	}
	if !reflect.DeepEqual(res.Warnings, want) {
		t.Errorf("warnings:\n got %q\nwant %q", res.Warnings, want)
	}
}

func TestCopySteps(t *testing.T) {
	files := map[string]string{"a.txt": "a", "b.txt": "b", "app/main.py": "print(1)", "app/lib/x.py": "x", "app/.hidden": "h", "c.md": "c"}
	res, err := translate(t, "FROM base\nARG D=/srv\nCOPY --chown=user:user --chmod=755 a.txt b.txt $D/\nADD app ${D}/app\nCOPY *.txt /w/\n", files, nil)
	if err != nil {
		t.Fatal(err)
	}
	var copies []Step
	for _, s := range res.Request.Steps {
		if s.Type == "COPY" {
			if len(s.FilesHash) != 64 {
				t.Errorf("step %v: filesHash %q", s.Args, s.FilesHash)
			}
			s.FilesHash = ""
			copies = append(copies, s)
		}
	}
	want := []Step{
		st("COPY", "a.txt", "/srv/", "user:user", "0755"),
		st("COPY", "b.txt", "/srv/", "user:user", "0755"),
		st("COPY", "app", "/srv/app", "", ""),
		st("COPY", "*.txt", "/w/", "", ""),
	}
	if !reflect.DeepEqual(copies, want) {
		t.Errorf("COPY steps:\n got %+v\nwant %+v", copies, want)
	}
	if len(res.Files) != 4 {
		t.Fatalf("%d file sets, want 4", len(res.Files))
	}
	for i, want := range [][]string{{"a.txt"}, {"b.txt"}, {"app", "app/.hidden", "app/lib", "app/lib/x.py", "app/main.py"}, {"a.txt", "b.txt"}} {
		if got := res.Files[i].Paths(); !reflect.DeepEqual(got, want) {
			t.Errorf("file set %d (%s): got %q, want %q", i, res.Files[i].Src, got, want)
		}
		if res.Files[i].Hash != res.Request.Steps[3+i].FilesHash && i < 2 {
			t.Errorf("file set %d hash differs from its step's", i)
		}
	}
	if res.Files[0].Hash == res.Files[1].Hash {
		t.Error("different files, same hash")
	}
}

func TestDockerignore(t *testing.T) {
	files := map[string]string{
		".dockerignore":       "# comment\nnode_modules\n*.log\n!keep.log\n/build\n**/*.tmp\n",
		"main.go":             "package main",
		"node_modules/x/i.js": "x",
		"a.log":               "l",
		"keep.log":            "k",
		"sub/a.log":           "nested logs are not matched by *.log",
		"build/out":           "o",
		"sub/deep/x.tmp":      "t",
		"sub/deep/y":          "y",
	}
	res, err := translate(t, "FROM base\nCOPY . /app\n", files, nil)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"", ".dockerignore", "keep.log", "main.go", "sub", "sub/a.log", "sub/deep", "sub/deep/y"}
	if got := res.Files[0].Paths(); !reflect.DeepEqual(got, want) {
		t.Errorf("COPY . with .dockerignore:\n got %q\nwant %q", got, want)
	}
	// An excluded source is not found, as in Docker.
	if _, err := translate(t, "FROM base\nCOPY node_modules /n\n", files, nil); err == nil || !strings.Contains(err.Error(), "no files found") {
		t.Errorf("COPY of an ignored directory: %v", err)
	}
	// Editing an ignored file does not change the hash; editing a sent one does.
	dir := t.TempDir()
	writeTree(t, dir, files)
	hash := func() string {
		r, err := Translate(Options{Dockerfile: []byte("FROM base\nCOPY . /app\n"), Context: dir})
		if err != nil {
			t.Fatal(err)
		}
		return r.Files[0].Hash
	}
	h0 := hash()
	os.WriteFile(filepath.Join(dir, "a.log"), []byte("changed"), 0o644)
	if h1 := hash(); h1 != h0 {
		t.Error("changing an ignored file changed the hash")
	}
	os.WriteFile(filepath.Join(dir, "main.go"), []byte("package main // changed"), 0o644)
	if h2 := hash(); h2 == h0 {
		t.Error("changing a sent file kept the hash")
	}
}

func TestSymlinksInContext(t *testing.T) {
	files := map[string]string{
		"app/real.txt":  "real",
		"app/to-passwd": "->/etc/passwd", // points outside: sent as a link, its target never read
		"app/rel":       "->real.txt",
		"app/up":        "->../..",
		"linkdir":       "->app", // a symlink to a directory inside the context
	}
	res, err := translate(t, "FROM base\nCOPY app /app\nCOPY linkdir/real.txt /r\nCOPY linkdir /l\n", files, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := res.Files[0].Paths(), []string{"app", "app/real.txt", "app/rel", "app/to-passwd", "app/up"}; !reflect.DeepEqual(got, want) {
		t.Errorf("got %q, want %q", got, want)
	}
	var buf bytes.Buffer
	if err := res.Files[0].WriteTar(&buf); err != nil {
		t.Fatal(err)
	}
	type ent struct {
		name string
		typ  byte
		link string
		body string
	}
	var got []ent
	zr, err := gzip.NewReader(&buf)
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(zr)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(tr)
		got = append(got, ent{h.Name, h.Typeflag, h.Linkname, string(b)})
	}
	want := []ent{
		{"app/", tar.TypeDir, "", ""},
		{"app/real.txt", tar.TypeReg, "", "real"},
		{"app/rel", tar.TypeSymlink, "real.txt", ""},
		{"app/to-passwd", tar.TypeSymlink, "/etc/passwd", ""},
		{"app/up", tar.TypeSymlink, "../..", ""},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("tarball:\n got %v\nwant %v", got, want)
	}
	// Through a symlinked directory that stays inside: the file; the link itself: a link.
	if got := res.Files[1].Paths(); !reflect.DeepEqual(got, []string{"linkdir/real.txt"}) {
		t.Errorf("COPY linkdir/real.txt: %q", got)
	}
	if got := res.Files[2].Paths(); !reflect.DeepEqual(got, []string{"linkdir"}) {
		t.Errorf("COPY linkdir: %q", got)
	}
}

func TestTarballOfContext(t *testing.T) {
	res, err := translate(t, "FROM base\nCOPY . /app\n", map[string]string{"x/y": "y", "z": "zz"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := res.Files[0].WriteTar(&buf); err != nil {
		t.Fatal(err)
	}
	zr, _ := gzip.NewReader(&buf)
	tr := tar.NewReader(zr)
	var names []string
	for {
		h, err := tr.Next()
		if err != nil {
			break
		}
		names = append(names, h.Name)
	}
	if want := []string{"./", "x/", "x/y", "z"}; !reflect.DeepEqual(names, want) {
		t.Errorf("got %q, want %q (the SDK's layout: paths relative to the context)", names, want)
	}
}
