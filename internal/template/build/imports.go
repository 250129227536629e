package build

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Image archives (`docker save`, OCI layout tarballs) a template is built from live in the
// import directory, <data-dir>/imports: a build request's `archive:NAME` names a file there,
// never a path elsewhere on the host (an API key holder must not make the daemon open any host
// file). Files get there by upload (ImportArchive; the CLI's --from-archive streams the local
// file) or by the node's operator.

// DefaultMaxImportBytes bounds an uploaded archive (Config.MaxImportBytes).
const DefaultMaxImportBytes = 16 << 30

var importNameRe = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

func (m *Manager) importDir() string { return datadir.Imports(m.cfg.DataDir) }

// ImportArchive stores the archive read from r in the import directory and returns the name a
// build request refers to it by (`archive:NAME`) and its size.
// Its name carries team (importTeamTag): another team's builds cannot use it.
func (m *Manager) ImportArchive(ctx context.Context, team string, r io.Reader) (string, int64, error) {
	ctx, done, err := m.op(ctx)
	if err != nil {
		return "", 0, err
	}
	defer done()
	dir := m.importDir()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", 0, err
	}
	f, err := os.CreateTemp(dir, ".upload-")
	if err != nil {
		return "", 0, err
	}
	defer os.Remove(f.Name()) // after the rename: nothing
	defer f.Close()
	limit := m.cfg.MaxImportBytes
	if limit <= 0 {
		limit = DefaultMaxImportBytes
	}
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(f, h), io.LimitReader(ctxReader{ctx, r}, limit+1))
	if err != nil {
		return "", 0, fmt.Errorf("import archive: %w", err)
	}
	if n > limit {
		return "", 0, fmt.Errorf("import archive: over the limit of %d bytes: %w", limit, errdefs.ErrExhausted)
	}
	if n == 0 {
		return "", 0, fmt.Errorf("import archive: empty: %w", errdefs.ErrInvalid)
	}
	if err := f.Sync(); err != nil {
		return "", 0, err
	}
	name := "sha256-" + hex.EncodeToString(h.Sum(nil))[:16] + "-" + randomHex(4)
	if team != "" && team != auth.DefaultTeamID {
		name += importTeamTag + team
	}
	name += ".tar"
	if err := os.Rename(f.Name(), filepath.Join(dir, name)); err != nil {
		return "", 0, err
	}
	m.log.Info("image archive imported", "name", name, "bytes", n)
	return name, n, nil
}

// importTeamTag comes before the team in the name of an import a team made; an import without
// one (made by the operator, or before teams) is the first team's.
const importTeamTag = ".team-"

// importTeam is the team whose import name is.
func importTeam(name string) string {
	i := strings.LastIndex(name, importTeamTag)
	if i < 0 {
		return auth.DefaultTeamID
	}
	return strings.TrimSuffix(name[i+len(importTeamTag):], ".tar")
}

// DeleteImport removes team's archive from the import directory.
func (m *Manager) DeleteImport(ctx context.Context, team, name string) error {
	if !importNameRe.MatchString(name) || importTeam(name) != auth.Owner(team) {
		return fmt.Errorf("import %q: %w", name, errdefs.ErrNotFound)
	}
	if err := os.Remove(filepath.Join(m.importDir(), name)); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("import %q: %w", name, errdefs.ErrNotFound)
		}
		return err
	}
	return nil
}

// importPath is the file an `archive:` source names: a regular file (not a symlink) directly in
// the import directory.
func (m *Manager) importPath(name, team string) (string, error) {
	bad := func(why string) error {
		return fmt.Errorf("archive %q: %s; an archive must be a file in the import directory %s (upload it: `ember template build --from-archive FILE`, or POST /ember/imports): %w",
			name, why, m.importDir(), errdefs.ErrInvalid)
	}
	if !importNameRe.MatchString(name) {
		return "", bad("not a file name")
	}
	if importTeam(name) != auth.Owner(team) {
		return "", bad("no such import") // another team's: as a missing one
	}
	p := filepath.Join(m.importDir(), name)
	fi, err := os.Lstat(p)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return "", bad("no such import")
	case err != nil:
		return "", err
	case !fi.Mode().IsRegular():
		return "", bad("not a regular file")
	}
	return p, nil
}

// CheckBuild validates a build request without building: its name and its source (an
// `archive:` must be an import). BuildTemplate does the same first.
func (m *Manager) CheckBuild(req BuildRequest) error {
	_, err := m.checkBuild(req)
	return err
}

// checkBuild validates req and returns it with an archive source resolved to its path.
func (m *Manager) checkBuild(req BuildRequest) (BuildRequest, error) {
	if !nameRe.MatchString(req.Name) {
		return req, fmt.Errorf("template name %q: must match %s: %w", req.Name, nameRe, errdefs.ErrInvalid)
	}
	if !validFrom(req) {
		return req, fmt.Errorf("from %q: use debian:bookworm, docker://IMAGE, docker+http://IMAGE or archive:NAME: %w", req.From, errdefs.ErrInvalid)
	}
	var err error
	if name, ok := strings.CutPrefix(req.From, "archive:"); ok {
		if req.From, err = m.importPath(name, req.Team); err != nil {
			return req, err
		}
		req.From = "archive:" + req.From
	}
	if req.FromArchive != "" {
		if req.FromArchive, err = m.importPath(req.FromArchive, req.Team); err != nil {
			return req, err
		}
	}
	return req, nil
}

type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}
