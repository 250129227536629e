package snapshot

import (
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
)

// cache is the node-local chunk cache in front of a (remote) backend: <dir>/<hh>/<sha256>. It
// is best effort: a failed write is logged and ignored, a bad entry is removed and refetched.
// Entries are not fsynced, since every read verifies them.
type cache struct {
	dir string
	log *slog.Logger
}

func (c *cache) path(hash string) string { return filepath.Join(c.dir, hash[:2], hash) }

// read fills data with the cached chunk if there is a good copy.
func (c *cache) read(ch Chunk, data []byte) bool {
	f, err := os.Open(c.path(ch.Hash))
	if err != nil {
		return false
	}
	err = readExact(f, data)
	f.Close()
	if err == nil {
		if hashIs(data, ch.Hash) {
			return true
		}
		err = errChecksum
	}
	c.log.Warn("snapshot cache: dropping bad chunk", "chunk", ch.Hash, "error", err)
	os.Remove(c.path(ch.Hash))
	return false
}

func (c *cache) write(hash string, data []byte) {
	p := c.path(hash)
	if fi, err := os.Stat(p); err == nil && fi.Size() == int64(len(data)) {
		return
	}
	if err := c.writeFile(p, data); err != nil {
		c.log.Warn("snapshot cache: cannot store chunk", "chunk", hash, "error", err)
	}
}

func (c *cache) writeFile(p string, data []byte) error {
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(p), ".tmp-")
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), p)
	}
	if err != nil {
		os.Remove(f.Name())
	}
	return err
}

// prune removes cached chunks not in keep and returns how many.
func (c *cache) prune(keep map[string]bool) int {
	n := 0
	filepath.WalkDir(c.dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		if name := d.Name(); !keep[name] {
			if os.Remove(p) == nil && validHash(name) {
				n++
			}
		}
		return nil
	})
	return n
}
