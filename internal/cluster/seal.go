package cluster

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"strings"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// The records of etcd that hold secrets (the cluster secret, the snapshot signing key, stored
// sandboxes with their envd tokens and env vars, templates with their init tokens and env) are
// sealed with the cluster sealing key: AES-256-GCM, the record's etcd key as additional data
// (a sealed value copied under another key does not open). The sealing key is given to every
// node in a file (--cluster-key-file; `ember cluster certs` makes one) and is never written to
// etcd, so a copy of etcd's data, a backup, or a reader with etcd credentials alone learns none
// of those secrets. Without a key (only allowed with --etcd-insecure) records are plain.

// sealedPrefix starts every sealed value; a plain JSON value never does.
const sealedPrefix = "ember-sealed-v1:"

// SealKey seals and opens etcd records.
type SealKey struct{ aead cipher.AEAD }

// NewSealKey makes a key of 32 bytes.
func NewSealKey(key []byte) (*SealKey, error) {
	if len(key) != 32 {
		return nil, fmt.Errorf("cluster sealing key: %d bytes, 32 needed: %w", len(key), errdefs.ErrInvalid)
	}
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, err
	}
	return &SealKey{aead: aead}, nil
}

// LoadSealKey reads a sealing key file: 64 hex digits (whitespace around them ignored).
func LoadSealKey(path string) (*SealKey, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("cluster-key-file: %w: %w", err, errdefs.ErrInvalid)
	}
	if fi, err := os.Stat(path); err == nil && fi.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("cluster-key-file: %s is readable by others (mode %v): chmod 600 it: %w", path, fi.Mode().Perm(), errdefs.ErrInvalid)
	}
	key, err := hex.DecodeString(strings.TrimSpace(string(b)))
	if err != nil || len(key) != 32 {
		return nil, fmt.Errorf("cluster-key-file: %s must hold 64 hex digits (32 bytes; ember cluster certs makes one): %w", path, errdefs.ErrInvalid)
	}
	return NewSealKey(key)
}

// Seal returns plain sealed for etcd key k.
func (s *SealKey) Seal(k string, plain []byte) []byte {
	nonce := make([]byte, s.aead.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	out := append([]byte(sealedPrefix), nonce...)
	return s.aead.Seal(out, nonce, plain, []byte(k))
}

// Open returns the plain text of v, sealed for etcd key k.
func (s *SealKey) Open(k string, v []byte) ([]byte, error) {
	rest, ok := bytes.CutPrefix(v, []byte(sealedPrefix))
	if !ok || len(rest) < s.aead.NonceSize() {
		return nil, fmt.Errorf("%s is not sealed with the cluster key: %w", k, errdefs.ErrCorrupt)
	}
	plain, err := s.aead.Open(nil, rest[:s.aead.NonceSize()], rest[s.aead.NonceSize():], []byte(k))
	if err != nil {
		return nil, fmt.Errorf("%s does not open with this node's cluster key (is --cluster-key-file the same file on every node?): %w", k, errdefs.ErrCorrupt)
	}
	return plain, nil
}

// seal is the value to store under etcd key k: sealed with the cluster key, or plain without
// one.
func (cl *Cluster) seal(k string, plain []byte) string {
	if cl.cfg.SealKey == nil {
		return string(plain)
	}
	return string(cl.cfg.SealKey.Seal(k, plain))
}

// open is the plain text of the value v under etcd key k. A node with a key refuses a plain
// value (someone who can write etcd but has no key must not plant secrets or routes there); a
// node without one refuses a sealed value.
func (cl *Cluster) open(k string, v []byte) ([]byte, error) {
	if cl.cfg.SealKey == nil {
		if bytes.HasPrefix(v, []byte(sealedPrefix)) {
			return nil, fmt.Errorf("%s is sealed, and this node has no --cluster-key-file: %w", k, errdefs.ErrCorrupt)
		}
		return v, nil
	}
	return cl.cfg.SealKey.Open(k, v)
}

// sealJSON marshals v and seals it for etcd key k.
func (cl *Cluster) sealJSON(k string, v any) (string, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return "", err
	}
	return cl.seal(k, b), nil
}

// openJSON opens the value under etcd key k into v.
func (cl *Cluster) openJSON(k string, b []byte, v any) error {
	plain, err := cl.open(k, b)
	if err != nil {
		return err
	}
	return json.Unmarshal(plain, v)
}
