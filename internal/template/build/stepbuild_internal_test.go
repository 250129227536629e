package build

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

type tarEntry struct {
	name, body, link string
	typ              byte
	mode             int64
}

func makeTar(t *testing.T, gz bool, entries ...tarEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	var w io.Writer = &buf
	var zw *gzip.Writer
	if gz {
		zw = gzip.NewWriter(&buf)
		w = zw
	}
	tw := tar.NewWriter(w)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Mode: e.mode, Linkname: e.link, Size: int64(len(e.body))}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Typeflag != tar.TypeReg {
			h.Size = 0
		}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			io.WriteString(tw, e.body)
		}
	}
	tw.Close()
	if zw != nil {
		zw.Close()
	}
	return buf.Bytes()
}

func listTar(t *testing.T, b []byte) []string {
	t.Helper()
	tr := tar.NewReader(bytes.NewReader(b))
	var out []string
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		s := h.Name
		if h.Linkname != "" {
			s += "->" + h.Linkname
		}
		if h.Typeflag == tar.TypeReg {
			s += "=" + strconv.FormatInt(h.Mode, 8)
		}
		out = append(out, s)
	}
	sort.Strings(out)
	return out
}

// COPY archives map as Docker's COPY does: a file by its name, a directory's contents, glob
// matches by name.
func TestNormalizeCopyMapsSources(t *testing.T) {
	archive := makeTar(t, true,
		tarEntry{name: "hello.txt", body: "hi"},
		tarEntry{name: "dir/", typ: tar.TypeDir, mode: 0o755},
		tarEntry{name: "dir/a.txt", body: "a"},
		tarEntry{name: "dir/sub/", typ: tar.TypeDir, mode: 0o755},
		tarEntry{name: "dir/sub/b.txt", body: "b"},
		tarEntry{name: "dir/link", typ: tar.TypeSymlink, link: "/etc/passwd"},
		tarEntry{name: "dir/hard", typ: tar.TypeLink, link: "dir/a.txt"},
	)
	for _, tc := range []struct {
		src    string
		mode   int64
		single string
		want   string
	}{
		{src: "hello.txt", mode: -1, single: "hello.txt", want: "hello.txt=644"},
		{src: "./hello.txt", mode: 0o600, single: "hello.txt", want: "hello.txt=600"},
		{src: "dir", mode: -1, want: "a.txt=644,hard->a.txt,link->/etc/passwd,sub,sub/b.txt=644"},
		{src: "dir/*.txt", mode: -1, want: "a.txt=644"},
		{src: "dir/s*", mode: -1, want: "b.txt=644"},
	} {
		var out bytes.Buffer
		plan, err := normalizeCopy(bytes.NewReader(archive), tc.src, tc.mode, &out)
		if err != nil {
			t.Fatalf("%s: %v", tc.src, err)
		}
		if got := strings.Join(listTar(t, out.Bytes()), ","); got != tc.want || plan.single != tc.single {
			t.Errorf("%s: got %s single %q, want %s single %q", tc.src, got, plan.single, tc.want, tc.single)
		}
	}
}

// Hostile archives are refused before anything reaches the sandbox: names outside the
// destination, entries beneath a symlink of the archive, hard links to what is not in it.
func TestNormalizeCopyRefusesEscapes(t *testing.T) {
	for name, entries := range map[string][]tarEntry{
		"dotdot":       {{name: "../../etc/passwd", body: "x"}},
		"absolute":     {{name: "/etc/passwd", body: "x"}},
		"inner dotdot": {{name: "dir/../../x", body: "x"}},
		"through symlink": {
			{name: "dir/", typ: tar.TypeDir},
			{name: "dir/out", typ: tar.TypeSymlink, link: "/etc"},
			{name: "dir/out/passwd", body: "x"},
		},
		"hard link outside": {{name: "dir/", typ: tar.TypeDir}, {name: "dir/h", typ: tar.TypeLink, link: "etc/shadow"}},
		"nothing matches":   {{name: "other.txt", body: "x"}},
	} {
		var out bytes.Buffer
		_, err := normalizeCopy(bytes.NewReader(makeTar(t, false, entries...)), "dir", -1, &out)
		if name == "dotdot" || name == "absolute" {
			_, err = normalizeCopy(bytes.NewReader(makeTar(t, false, entries...)), ".", -1, &out)
		}
		if err == nil || !errors.Is(err, errInvalidCopy) {
			t.Errorf("%s: err = %v, want a refusal", name, err)
		}
	}
}

// The cache key of a step depends on everything before it: the parent, earlier steps, the
// files' hash and the state; a later step does not change an earlier key.
func TestStepKeysChain(t *testing.T) {
	keys := func(parent string, steps ...Step) []string {
		st := initialState(&Template{})
		k := chainKey(stepKeyVersion, parent)
		var out []string
		for _, s := range steps {
			st = st.after(s)
			k = chainKey(k, s.Type, s.Args, s.FilesHash, st)
			out = append(out, k)
		}
		return out
	}
	run := Step{Type: "RUN", Args: []string{"make"}}
	cp := Step{Type: "COPY", Args: []string{"a", "/b"}, FilesHash: strings.Repeat("a", 64)}
	a := keys("template:base@1", run, cp)
	if b := keys("template:base@1", run, cp); strings.Join(a, ",") != strings.Join(b, ",") {
		t.Fatal("keys are not deterministic")
	}
	if b := keys("template:base@2", run, cp); b[0] == a[0] {
		t.Fatal("a rebuilt parent keeps the key")
	}
	cp2 := cp
	cp2.FilesHash = strings.Repeat("b", 64)
	if b := keys("template:base@1", run, cp2); b[0] != a[0] || b[1] == a[1] {
		t.Fatal("changed files must change the COPY step's key only")
	}
	env := Step{Type: "ENV", Args: []string{"A", "1"}}
	if b := keys("template:base@1", env, run); b[1] == a[0] {
		t.Fatal("the env before a step is not in its key")
	}
	st := initialState(&Template{}).after(Step{Type: "WORKDIR", Args: []string{"app"}}).after(Step{Type: "USER", Args: []string{"root"}})
	if st.Workdir != "/home/user/app" || st.User != "root" {
		t.Fatalf("state %+v", st)
	}
}

// A build that was running when the daemon stopped is reported as failed after a restart,
// with its log lines kept; finished builds stay as they were.
func TestInterruptedBuildsFailOnRestart(t *testing.T) {
	dir := t.TempDir()
	running := TemplateBuild{ID: newBuildID(), TemplateID: "x", Status: BuildBuilding, Logs: []BuildLogEntry{{Message: "step 1"}}}
	done := TemplateBuild{ID: newBuildID(), TemplateID: "x", Status: BuildReady}
	for _, b := range []TemplateBuild{running, done} {
		data, _ := json.Marshal(b)
		if err := os.WriteFile(filepath.Join(dir, b.ID+".json"), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	bs, err := openBuilds(dir, func(string, ...any) {})
	if err != nil {
		t.Fatal(err)
	}
	r := bs.recs[running.ID].b
	if r.Status != BuildError || r.Reason == nil || !strings.Contains(r.Reason.Message, "interrupted") || len(r.Logs) != 2 || r.FinishedAt.IsZero() {
		t.Fatalf("interrupted build after restart: %+v", r)
	}
	if bs.recs[done.ID].b.Status != BuildReady {
		t.Fatal("a finished build changed")
	}
	// And the failure is on disk: a second restart reads it back as it is.
	bs2, err := openBuilds(dir, func(string, ...any) {})
	if err != nil {
		t.Fatal(err)
	}
	if got := bs2.recs[running.ID].b; got.Status != BuildError || got.FinishedAt.Sub(r.FinishedAt) > time.Second {
		t.Fatalf("second restart: %+v", got)
	}
}
