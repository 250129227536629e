// Package volume is ember's persistent volumes (E2B's Volume API): named directories that
// outlive sandboxes, are mounted read-write into any number of them (volumeMounts at create),
// and are read and written from outside through the content API with a per-volume token.
//
// It owns <data-dir>/volumes/. Each volume is <dir>/<id>/: disk.img, a sparse ext4 image of
// the volume's size limit, loop-mounted (nosuid,nodev) at <id>/mnt while the daemon runs; the
// volume's root is <id>/mnt/data (so ext4's lost+found stays out of sight). A write past the
// limit fails with ENOSPC, inside a sandbox as through the content API. The records (id, name,
// token, owner, size) are kept in the daemon's embedded store and survive a restart; Open
// mounts every image again.
//
// Why an image and not a project quota: this host's kernel has no CONFIG_QUOTA (ext4 and xfs
// refuse prjquota), the same reason the sandbox layers' disk limits are images.
package volume

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"sync"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// DefaultSizeMB is a volume's disk limit when Config.SizeMB is 0.
const DefaultSizeMB = 1024

// Volume is one volume's record.
type Volume struct {
	ID   string `json:"id"`
	Name string `json:"name"`
	// Token authenticates the content API (Authorization: Bearer <token>). The SDKs get it back
	// from GET /volumes/{id}, so it is stored as is (the store file is root's, 0600).
	Token string `json:"token"`
	// Owner is who made the volume (the team, once ember has teams; "" today).
	Owner     string    `json:"owner,omitempty"`
	SizeMB    int       `json:"sizeMB"`
	CreatedAt time.Time `json:"createdAt"`
}

// Store keeps volume records (internal/store implements it).
type Store interface {
	PutVolume(ctx context.Context, v *Volume) error
	GetVolume(ctx context.Context, id string) (*Volume, error)
	DeleteVolume(ctx context.Context, id string) error
	ListVolumes(ctx context.Context) ([]*Volume, error)
}

// Claims is a Store shared by the nodes of a cluster (etcd), where a mount being set up on one
// node meets a destroy on another: a sandbox's create claims its volumes before the record that
// names them (its route) is written and releases them after, and a destroy deletes the volume
// only if nothing claimed it since it read its users, so that a sandbox whose record the destroy
// could not see yet is never left mounting a destroyed volume.
type Claims interface {
	// ClaimVolume records that a sandbox being made mounts volume id until release is called;
	// refused (not found) once the volume is deleted.
	ClaimVolume(ctx context.Context, id string) (release func(), err error)
	// VolumeVersion is volume id's claim version, read before its users.
	VolumeVersion(ctx context.Context, id string) (int64, error)
	// DeleteVolumeIf deletes volume id unless it is claimed or was claimed since version
	// (errdefs.ErrConflict).
	DeleteVolumeIf(ctx context.Context, id string, version int64) error
}

// UsersFunc lists the sandboxes (live or paused) that mount volume id.
type UsersFunc func(ctx context.Context, id string) ([]string, error)

// Config configures a Manager.
type Config struct {
	// Dir is <data-dir>/volumes.
	Dir   string
	Store Store
	// SizeMB is each new volume's disk limit (DefaultSizeMB when 0).
	SizeMB int
	// Users, when set, refuses a destroy while a sandbox mounts the volume.
	Users UsersFunc
	// NoDiskLimit keeps volumes as plain directories (hosts that cannot loop-mount; tests).
	NoDiskLimit bool
	// Shared, when set, is the directory of a filesystem every node of a cluster mounts (the
	// cluster's S3 bucket through s3fs: shared.go): each volume is a directory <Shared>/<id>
	// there, no image, and Store is the cluster's. Open mounts nothing: the caller mounted it.
	Shared string
	// LimitDir, on the one node of a cluster that runs on the S3 server's host, is the directory
	// of the volumes in the server's posix backend (<bucket>/<prefix>volumes): this node holds
	// every volume's disk limit there (limit.go). Needs Shared and a LimitStore.
	LimitDir string
	Logger   *slog.Logger
}

// Manager creates, finds and destroys volumes and serves their content.
type Manager struct {
	cfg Config
	log *slog.Logger
	// mu serialises create, destroy and Resolve (names are unique per owner; a destroy never
	// races a sandbox being created with the volume).
	mu sync.Mutex
	// pending counts the mounts Resolve handed out whose sandbox may not be recorded yet.
	pending map[string]int
	// users is Config.Users; SetUsers sets it later (the sandbox manager is made after).
	usersMu sync.RWMutex
	users   UsersFunc
	// The holder's loop (Config.LimitDir): stop ends it, held is closed when it has, kick
	// runs it at once.
	stop, held chan struct{}
	kick       chan struct{}
	unlimited  map[string]bool // volumes the loop leaves without a limit (logged once)
}

var nameRe = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9._-]{0,127}$`)

// Open opens the volume directory, mounting every known volume's image.
func Open(ctx context.Context, cfg Config) (*Manager, error) {
	if cfg.SizeMB <= 0 {
		cfg.SizeMB = DefaultSizeMB
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("volumes dir: %w", err)
	}
	m := &Manager{cfg: cfg, log: cfg.Logger, users: cfg.Users, pending: map[string]int{}, kick: make(chan struct{}, 1), unlimited: map[string]bool{}}
	vols, err := cfg.Store.ListVolumes(ctx)
	if err != nil {
		return nil, err
	}
	for _, v := range vols {
		if err := m.attach(v.ID); err != nil {
			m.log.Error("mount volume", "volume", v.ID, "err", err)
		}
	}
	ls, limits := cfg.Store.(LimitStore)
	switch {
	case cfg.LimitDir != "" && (cfg.Shared == "" || !limits):
		return nil, errors.New("volume limit dir: only for a cluster's volumes in S3")
	case cfg.LimitDir != "":
		if err := os.MkdirAll(cfg.LimitDir, 0o755); err != nil {
			return nil, fmt.Errorf("volume limit dir: %w", err)
		}
		if err := ls.HoldLimits(ctx); err != nil {
			return nil, err
		}
		m.reconcileLimits(ctx)
		m.stop, m.held = make(chan struct{}), make(chan struct{})
		go m.holdLimits(2 * time.Second)
	case limits && cfg.Shared != "":
		if err := ls.LetGoLimits(ctx); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Close stops the holder's loop (Config.LimitDir); the images stay mounted.
func (m *Manager) Close() {
	if m != nil && m.stop != nil {
		close(m.stop)
		<-m.held
		m.stop = nil
	}
}

// SetUsers sets the function that lists a volume's sandboxes.
func (m *Manager) SetUsers(f UsersFunc) {
	m.usersMu.Lock()
	m.users = f
	m.usersMu.Unlock()
}

func (m *Manager) volDir(id string) string { return filepath.Join(m.cfg.Dir, id) }

// DataDir is the host directory that is the volume's root.
func (m *Manager) DataDir(id string) string {
	if m.cfg.Shared != "" {
		return filepath.Join(m.cfg.Shared, id)
	}
	return filepath.Join(m.volDir(id), "mnt", "data")
}

// Create makes a volume named name for owner. A name already used by the owner is a
// conflict.
func (m *Manager) Create(ctx context.Context, owner, name string) (*Volume, error) {
	if !nameRe.MatchString(name) {
		return nil, errorf(errdefs.ErrInvalid, "invalid volume name %q: 1-128 characters of letters, digits, '.', '_' and '-', starting with a letter or digit", name)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if v, err := m.byName(ctx, owner, name); err == nil && v != nil {
		return nil, errorf(errdefs.ErrConflict, "volume with name '%s' already exists", name)
	} else if err != nil {
		return nil, err
	}
	v := &Volume{ID: newID(), Name: name, Token: "vol_" + randomHex(24), Owner: owner, SizeMB: m.cfg.SizeMB, CreatedAt: time.Now().UTC()}
	if err := m.provision(v); err != nil {
		_ = m.remove(v.ID)
		return nil, err
	}
	if err := m.cfg.Store.PutVolume(ctx, v); err != nil {
		_ = m.remove(v.ID)
		return nil, err
	}
	// In a cluster whose volumes have disk limits, nothing is written before the holder has
	// mounted the volume's image; its root is then made open to every user again (s3fs sets
	// the mode on the image's directory).
	if held, err := m.waitLimited(ctx, v.ID); err != nil || held {
		if err == nil {
			err = mkdirOpen(m.DataDir(v.ID))
		}
		if err != nil {
			_ = m.cfg.Store.DeleteVolume(context.WithoutCancel(ctx), v.ID)
			return nil, err
		}
	}
	m.log.Info("volume created", "volume", v.ID, "name", v.Name, "size_mb", v.SizeMB)
	return v, nil
}

func (m *Manager) byName(ctx context.Context, owner, name string) (*Volume, error) {
	vols, err := m.cfg.Store.ListVolumes(ctx)
	if err != nil {
		return nil, err
	}
	for _, v := range vols {
		if v.Owner == owner && v.Name == name {
			return v, nil
		}
	}
	return nil, nil
}

// Volumes returns owner's volumes, oldest first.
func (m *Manager) Volumes(ctx context.Context, owner string) ([]*Volume, error) {
	vols, err := m.cfg.Store.ListVolumes(ctx)
	if err != nil {
		return nil, err
	}
	out := vols[:0]
	for _, v := range vols {
		if v.Owner == owner {
			out = append(out, v)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, nil
}

// Get finds owner's volume by id, else by name.
func (m *Manager) Get(ctx context.Context, owner, idOrName string) (*Volume, error) {
	v, err := m.cfg.Store.GetVolume(ctx, idOrName)
	if err == nil && v.Owner == owner {
		return v, nil
	}
	if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return nil, err
	}
	if v, err = m.byName(ctx, owner, idOrName); err != nil {
		return nil, err
	}
	if v == nil {
		return nil, errorf(errdefs.ErrNotFound, "volume '%s' not found", idOrName)
	}
	return v, nil
}

// Destroy deletes owner's volume and its content; refused (conflict) while a live or paused
// sandbox mounts it.
func (m *Manager) Destroy(ctx context.Context, owner, idOrName string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	v, err := m.Get(ctx, owner, idOrName)
	if err != nil {
		return err
	}
	claims, shared := m.cfg.Store.(Claims)
	var version int64
	if shared {
		if version, err = claims.VolumeVersion(ctx, v.ID); err != nil {
			return err
		}
	}
	m.usersMu.RLock()
	users := m.users
	m.usersMu.RUnlock()
	var ids []string
	if users != nil {
		if ids, err = users(ctx, v.ID); err != nil {
			return err
		}
	}
	if len(ids) == 0 && m.pending[v.ID] > 0 {
		ids = []string{"being created"}
	}
	if len(ids) > 0 {
		return inUse(v, ids[0])
	}
	if shared {
		err = claims.DeleteVolumeIf(ctx, v.ID, version)
	} else {
		err = m.cfg.Store.DeleteVolume(ctx, v.ID)
	}
	if errors.Is(err, errdefs.ErrConflict) {
		return inUse(v, "being created")
	}
	if err != nil {
		return err
	}
	if err := m.remove(v.ID); err != nil {
		m.log.Warn("remove volume files", "volume", v.ID, "err", err)
	}
	m.log.Info("volume destroyed", "volume", v.ID, "name", v.Name)
	return nil
}

func inUse(v *Volume, sandboxID string) error {
	return errorf(errdefs.ErrConflict, "volume '%s' is in use by sandbox %s and cannot be deleted", v.Name, sandboxID)
}

// Resolve finds owner's volume by name for a mount: its id and host directory. Until release
// is called (once the sandbox that mounts it is recorded, or its create failed), a destroy of
// the volume is refused, on every node when the Store is a cluster's (Claims).
func (m *Manager) Resolve(ctx context.Context, owner, name string) (id, hostDir string, release func(), err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	v, err := m.byName(ctx, owner, name)
	if err != nil {
		return "", "", nil, err
	}
	if v == nil {
		return "", "", nil, errorf(errdefs.ErrNotFound, "volume '%s' not found", name)
	}
	unclaim := func() {}
	if claims, ok := m.cfg.Store.(Claims); ok {
		if unclaim, err = claims.ClaimVolume(ctx, v.ID); errors.Is(err, errdefs.ErrNotFound) {
			return "", "", nil, errorf(errdefs.ErrNotFound, "volume '%s' not found", name)
		} else if err != nil {
			return "", "", nil, err
		}
	}
	m.pending[v.ID]++
	var once sync.Once
	release = func() {
		once.Do(func() {
			unclaim()
			m.mu.Lock()
			defer m.mu.Unlock()
			if m.pending[v.ID]--; m.pending[v.ID] <= 0 {
				delete(m.pending, v.ID)
			}
		})
	}
	return v.ID, m.DataDir(v.ID), release, nil
}

// Authorize finds volume id for the content API: the token must be the volume's.
func (m *Manager) Authorize(ctx context.Context, id, token string) (*Volume, error) {
	v, err := m.cfg.Store.GetVolume(ctx, id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil, errorf(errdefs.ErrNotFound, "volume '%s' not found", id)
	}
	if err != nil {
		return nil, err
	}
	if token == "" || subtle.ConstantTimeCompare([]byte(token), []byte(v.Token)) != 1 {
		return nil, errorf(errdefs.ErrUnauthorized, "invalid volume token")
	}
	return v, nil
}

func newID() string {
	const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, 20)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	for i := range b {
		b[i] = alphabet[int(b[i])%len(alphabet)]
	}
	return string(b)
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// Error is a volume error the caller may see: its message is E2B's wording as is, and it
// unwraps to its errdefs kind (which the API turns into the status).
type Error struct {
	Msg  string
	Kind error
}

func (e *Error) Error() string { return e.Msg }
func (e *Error) Unwrap() error { return e.Kind }

func errorf(kind error, format string, args ...any) error {
	return &Error{Msg: fmt.Sprintf(format, args...), Kind: kind}
}
