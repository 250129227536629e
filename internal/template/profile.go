package template

import (
	"errors"
	"os"
	"strings"

	"github.com/ember-sandbox/ember/internal/image"
)

// leanRewrites make a login shell's start-up files run no program in the common case, keeping
// what they set. Every command E2B's SDKs run is `bash -l -c CMD`, and under gVisor each fork
// and exec costs milliseconds, so a `$(id -u)` in /etc/profile is a large part of a short
// command's time. bash knows its effective uid ($EUID); other shells (dash as `sh -l`) have no
// EUID and still ask id. root's `mesg n` only means something on a terminal.
var leanRewrites = []struct{ file, old, new string }{
	{"etc/profile", `"$(id -u)"`, `"${EUID:-$(id -u)}"`},
	{"root/.profile", "\nmesg n 2> /dev/null || true", "\nif [ -t 0 ]; then mesg n 2> /dev/null || true; fi"},
}

// leanLoginShell applies leanRewrites to the files of t that have the original text, as new
// files (never writing through a file shared with a layer). Files without it are left alone.
func leanLoginShell(t *image.Tree) error {
	for _, r := range leanRewrites {
		data, err := t.ReadFile(r.file)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return err
		}
		s := string(data)
		if !strings.Contains(s, r.old) {
			continue
		}
		st, err := t.Lstat(r.file)
		if err != nil {
			return err
		}
		if err := t.WriteFile(r.file, []byte(strings.ReplaceAll(s, r.old, r.new)), st.Mode&0o7777, int(st.Uid), int(st.Gid)); err != nil {
			return err
		}
	}
	return nil
}
