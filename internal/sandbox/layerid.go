package sandbox

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Layer identities. A stack is mounted into sandboxes and composed from on the host, so only
// directories ember made as layers may be in one; a record (the store, etcd, the image store)
// that names anything else — the data dir itself, "..", a symlink (a guest can make one in its
// own layer), a directory inside a layer's files — is refused wherever a stack is built. The
// layers ember makes, beneath the data directory:
//
//	layers/sha256-<diff id>/root                 an image layer (image.Store)
//	layers/step-<key>/<root of its layer.json>   a step build's captured layer
//	templates/<name>/rootfs-<build>              a template's own top layer
//	templates/.image-<key>/rootfs-<build>        the rootfs of an image a step build starts from
//	forks/<image>/layer/upper                    a fork layer (forklayers.go)
//	remote/<identity, base64url>/<tree-path>     a layer loaded from the image store
//
// Every component beneath the data directory must be a real directory (no symlink anywhere).

var layerIdentityRes = []*regexp.Regexp{
	regexp.MustCompile(`^layers/sha256-[0-9a-f]{64}/root$`),
	regexp.MustCompile(`^templates/([a-z0-9][a-z0-9_.-]{0,62}|\.image-[0-9a-f]{16})/rootfs-[A-Za-z0-9_-]{1,64}$`),
	regexp.MustCompile(`^forks/[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}/layer/upper$`),
}

var stepIdentityRe = regexp.MustCompile(`^layers/step-([0-9a-f]{64})/(.+)$`)

// cleanRel reports whether p is a clean relative slash path of real names: no empty, "." or
// ".." component, no backslash or NUL.
func cleanRel(p string) bool {
	if p == "" || strings.ContainsAny(p, "\\\x00") || path.IsAbs(p) {
		return false
	}
	for _, c := range strings.Split(p, "/") {
		if c == "" || c == "." || c == ".." {
			return false
		}
	}
	return true
}

// checkIdentity checks that name has the form of a layer ember makes (see above). local says
// to check the name against this node's copy where it has one: a step layer's files are where
// its layer.json says. It does not check the directories themselves (realDirs does).
func (m *Manager) checkIdentity(name string, local bool) error {
	bad := fmt.Errorf("layer %q is not a layer ember made: %w", name, errdefs.ErrInvalid)
	if !cleanRel(name) {
		return bad
	}
	for _, re := range layerIdentityRes {
		if re.MatchString(name) {
			return nil
		}
	}
	sm := stepIdentityRe.FindStringSubmatch(name)
	if sm == nil || !cleanRel(sm[2]) {
		return bad
	}
	if !local {
		return nil
	}
	data, err := os.ReadFile(filepath.Join(m.layersDir(), "step-"+sm[1], "layer.json"))
	if os.IsNotExist(err) {
		return nil // not on this node: loaded from the store, where the name is only a key
	}
	var l struct {
		Root string `json:"root"` // a step layer's record (internal/template/build)
	}
	if err != nil || json.Unmarshal(data, &l) != nil || filepath.ToSlash(l.Root) != sm[2] {
		return bad
	}
	return nil
}

// realDirs reports whether every component of rel beneath root is a directory, not a symlink:
// exists false when a component is missing (nothing there yet), an error when one is
// something else.
func realDirs(root, rel string) (exists bool, err error) {
	p := root
	for _, c := range strings.Split(rel, "/") {
		p = filepath.Join(p, c)
		fi, err := os.Lstat(p)
		if os.IsNotExist(err) {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		if !fi.IsDir() { // a symlink's mode is not a directory's
			return false, fmt.Errorf("layer %q: %s is not a directory: %w", rel, p, errdefs.ErrInvalid)
		}
	}
	return true, nil
}

// checkLayerDir checks that host directory dir is a layer ember made on this node.
func (m *Manager) checkLayerDir(dir string) error {
	data := filepath.Clean(m.cfg.DataDir)
	bad := fmt.Errorf("layer directory %q is not a layer ember made: %w", dir, errdefs.ErrInvalid)
	if !filepath.IsAbs(dir) || filepath.Clean(dir) != dir {
		return bad
	}
	rel, ok := strings.CutPrefix(dir, data+string(os.PathSeparator))
	if !ok {
		return bad
	}
	rel = filepath.ToSlash(rel)
	remote := datadir.Remote(data)
	if rest, ok := strings.CutPrefix(dir, remote+string(os.PathSeparator)); ok {
		enc, tree, _ := strings.Cut(filepath.ToSlash(rest), "/")
		ident, err := base64.RawURLEncoding.DecodeString(enc)
		if err != nil || m.checkIdentity(string(ident), false) != nil {
			return bad
		}
		want, err := os.ReadFile(filepath.Join(remote, enc, treeFile))
		if err != nil || string(want) != filepath.FromSlash(tree) || !cleanRel(tree) {
			return bad
		}
	} else if err := m.checkIdentity(rel, true); err != nil {
		return err
	}
	exists, err := realDirs(data, rel)
	if err != nil {
		return err
	}
	if !exists {
		return fmt.Errorf("layer directory %q: %w", dir, errdefs.ErrNotFound)
	}
	return nil
}

// checkStack checks every layer of a stack (its top, then its lowers) before anything boots
// on it or composes from it.
func (m *Manager) checkStack(top string, lowers []string) error {
	for _, d := range append([]string{top}, lowers...) {
		if err := m.checkLayerDir(d); err != nil {
			return err
		}
	}
	return nil
}
