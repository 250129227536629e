package daemon

import (
	"crypto/sha256"
	"encoding/hex"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/ember-sandbox/ember/internal/datadir"
)

// A template's checkpoint holds the envd that was running when it was built, so a new envd
// binary (a fix, the out-of-memory guard) reaches sandboxes only through a rebuild. The daemon
// keeps, per template it builds at start-up (Config.Templates), a stamp naming the build and the
// envd it was built with (<DataDir>/envd-stamps/<name>: "<build id> <sha256>"), and builds
// the template again when the envd binary differs or the stamp is missing or names another
// build.

func envdStampPath(dataDir, name string) string {
	return filepath.Join(datadir.EnvdStamps(dataDir), name)
}

// envdDigest is the SHA-256 of the envd binary at path ("" if unreadable: no stamp then).
func envdDigest(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return ""
	}
	return hex.EncodeToString(h.Sum(nil))
}

// envdChanged reports whether template name (build buildID) was built with an envd other than
// digest (or is not known to have been built with it).
func envdChanged(dataDir, name, buildID, digest string) bool {
	if digest == "" {
		return false
	}
	b, err := os.ReadFile(envdStampPath(dataDir, name))
	if err != nil {
		return true
	}
	id, sum, _ := strings.Cut(strings.TrimSpace(string(b)), " ")
	return id != buildID || sum != digest
}

// stampEnvd records that template name was built (build buildID) with envd digest.
func stampEnvd(dataDir, name, buildID, digest string) error {
	if digest == "" {
		return nil
	}
	p := envdStampPath(dataDir, name)
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return err
	}
	return os.WriteFile(p, []byte(buildID+" "+digest+"\n"), 0o600)
}
