package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const e2eDockerfile = `# A template from a Dockerfile, built by ember's CLI through E2B's template build API.
FROM base
ARG GREETING=hello
ENV APP_GREETING=${GREETING}-world APP_HOME=/srv/app
LABEL org.example.ignored=yes
RUN mkdir -p /srv/app && echo built-by-run > /srv/app/built.txt
WORKDIR $APP_HOME
COPY app/ /srv/app/
COPY --chown=user:user data.txt /srv/app/data.txt
USER user
RUN whoami > /home/user/run-as.txt
CMD ["/bin/sh", "-c", "echo started > /tmp/started.txt; exec sleep infinity"]
`

// TestDockerfileTemplate builds a template from a Dockerfile with `ember template build
// --dockerfile` (FROM the base template; RUN, ARG, ENV, WORKDIR, USER, COPY with
// .dockerignore; CMD as the start command), then a sandbox of it sees every step; a rebuild
// with the same files uploads nothing.
//
// The CLI is a client of E2B's template build API (POST /v3/templates, file uploads,
// /v2/templates/{id}/builds/{buildID}, build status); on a daemon without that API this test
// fails at "requesting the build".
func TestDockerfileTemplate(t *testing.T) {
	d := need(t)
	ctxDir := t.TempDir()
	for name, body := range map[string]string{
		"Dockerfile":     e2eDockerfile,
		".dockerignore":  "app/secret.env\n*.log\n",
		"app/main.py":    "print('hello from the context')\n",
		"app/lib/u.py":   "X = 1\n",
		"app/secret.env": "TOKEN=must-not-be-sent\n",
		"debug.log":      "ignored\n",
		"data.txt":       "data for user\n",
	} {
		p := filepath.Join(ctxDir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	const name = "df-e2e"
	build := func() string {
		t.Helper()
		t0 := time.Now()
		cmd := exec.Command(d.bin, "--url", "http://"+d.addr, "template", "build", name,
			"--dockerfile", filepath.Join(ctxDir, "Dockerfile"), "--build-arg", "GREETING=hi")
		cmd.Env = append(os.Environ(), "E2B_API_KEY="+d.key)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("ember template build --dockerfile: %v\n%s\n(the CLI needs the daemon's E2B template build API, /v3/templates and friends)\n%s",
				err, out, d.logLines(d.logs(), 40))
		}
		t.Logf("built in %s:\n%s", time.Since(t0).Round(time.Millisecond), out)
		return string(out)
	}
	out := build()
	t.Cleanup(func() { d.api(t, "DELETE", "/templates/"+name, nil, nil) })
	for _, want := range []string{"warning: Dockerfile:5: LABEL is ignored", "FROM base: the template of that name", "COPY app/: uploaded", "template " + name + " built in"} {
		if !strings.Contains(out, want) {
			t.Errorf("build output lacks %q", want)
		}
	}

	s := d.create(t, map[string]any{"templateID": name})
	for _, c := range []struct{ cmd, want string }{
		{"whoami; pwd", "user\n/srv/app\n"},                                      // USER, WORKDIR
		{"echo $APP_GREETING $APP_HOME $GREETING", "hi-world /srv/app hi\n"},     // ENV, ARG (an env var, as in the SDK)
		{"cat /srv/app/built.txt /home/user/run-as.txt", "built-by-run\nuser\n"}, // RUN as root, then as user
		{"cat /srv/app/main.py /srv/app/lib/u.py", "print('hello from the context')\nX = 1\n"},
		{"stat -c '%U %a' /srv/app/data.txt; cat /srv/app/data.txt", "user 644\ndata for user\n"},              // COPY --chown
		{"ls -A /srv/app | sort | tr '\\n' ' '", "built.txt data.txt lib main.py "},                            // .dockerignore
		{"cat /tmp/started.txt; cat /proc/[0-9]*/comm | grep -qx sleep && echo running", "started\nrunning\n"}, // CMD
	} {
		if r := d.run(t, s, c.cmd); r.stdout != c.want || r.exitCode != 0 {
			t.Errorf("%s: got %q (exit %d, stderr %q), want %q", c.cmd, r.stdout, r.exitCode, r.stderr, c.want)
		}
	}

	// Unchanged files: every COPY is already on the daemon (the same filesHash as before).
	out = build()
	if strings.Contains(out, "uploaded") || strings.Count(out, "already on the daemon") != 2 {
		t.Errorf("a rebuild with unchanged files uploaded again:\n%s", out)
	}
}
