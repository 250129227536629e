package auth

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Teams: every key belongs to a team, and every object (sandbox, template, snapshot,
// checkpoint, build, volume, key) to the team whose key made it. A key's team travels in the
// request's context (WithCaller; TeamOf reads it); the API's object lookup compares it with
// the object's, and answers another team's object as a missing one.

// DefaultTeamID is the first team: keys and objects of an ember that had no teams belong to
// it, and the key the daemon prints at first start is its admin key.
const DefaultTeamID = "default"

// MaxTeamNameLen bounds a team's name.
const MaxTeamNameLen = 128

var teamIDFormat = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,62}$`)

// ValidTeamID reports whether s can be a team id.
func ValidTeamID(s string) bool { return teamIDFormat.MatchString(s) }

// Team is a tenant: a set of keys and the objects they made, with its quotas.
type Team struct {
	ID        string    `json:"id"`
	Name      string    `json:"name"`
	CreatedAt time.Time `json:"createdAt"`
	Quota     Quota     `json:"quota"`
}

// Quota bounds what a team holds at once; 0 in a field means no limit.
type Quota struct {
	// Sandboxes: running sandboxes at once.
	Sandboxes int `json:"sandboxes,omitempty"`
	// CPUs and MemoryMB: vCPUs and memory of its running sandboxes together.
	CPUs     int `json:"cpus,omitempty"`
	MemoryMB int `json:"memoryMB,omitempty"`
	// PausedDiskMB: disk of its paused sandboxes together (their disk size).
	PausedDiskMB int `json:"pausedDiskMB,omitempty"`
	// Builds: template builds at once.
	Builds int `json:"builds,omitempty"`
	// TemplateDiskMB: disk of its templates and snapshots together.
	TemplateDiskMB int `json:"templateDiskMB,omitempty"`
}

// TeamBackend persists teams. GetTeam and DeleteTeam return an error wrapping
// errdefs.ErrNotFound when there is no such team.
type TeamBackend interface {
	PutTeam(ctx context.Context, t *Team) error
	GetTeam(ctx context.Context, id string) (*Team, error)
	ListTeams(ctx context.Context) ([]*Team, error)
	DeleteTeam(ctx context.Context, id string) error
}

// Caller is who a request acts for: the team of its key, and whether the key is an admin key
// (admin keys manage teams and the keys of every team; they see the objects of their own
// team only, like any key).
type Caller struct {
	Team  string
	Admin bool
	KeyID string
}

type callerKey struct{}

// WithCaller returns ctx carrying c.
func WithCaller(ctx context.Context, c Caller) context.Context {
	return context.WithValue(ctx, callerKey{}, c)
}

// CallerOf returns the caller ctx carries (ok false: none, an internal call).
func CallerOf(ctx context.Context) (Caller, bool) {
	c, ok := ctx.Value(callerKey{}).(Caller)
	return c, ok
}

// TeamOf is the team id of the request's caller: what every per-team decision (ownership,
// quotas, fair admission) keys on. A context without a caller (an internal call) is the
// default team's.
func TeamOf(ctx context.Context) string {
	if c, ok := CallerOf(ctx); ok && c.Team != "" {
		return c.Team
	}
	return DefaultTeamID
}

// IsAdmin reports whether the request's caller holds an admin key.
func IsAdmin(ctx context.Context) bool {
	c, ok := CallerOf(ctx)
	return ok && c.Admin
}

// Owner is the team an object records (its Team field): "" (an object made before teams) is
// the default team's.
func Owner(team string) string {
	if team == "" {
		return DefaultTeamID
	}
	return team
}

// Owns reports whether the request's caller's team owns an object recording team.
func Owns(ctx context.Context, team string) bool { return Owner(team) == TeamOf(ctx) }

func (k *Keys) teams() (TeamBackend, error) {
	tb, ok := k.b.(TeamBackend)
	if !ok {
		return nil, &errdefs.StatusError{Status: http.StatusNotImplemented, Message: "this key store keeps no teams"}
	}
	return tb, nil
}

func newTeamID() (string, error) {
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("generate team id: %w", err)
	}
	return "team-" + hex.EncodeToString(b), nil
}

// CreateTeam makes a team with its first key, an admin key of the team's (returned in
// plaintext once).
func (k *Keys) CreateTeam(ctx context.Context, name string, q Quota) (*Team, string, *Key, error) {
	tb, err := k.teams()
	if err != nil {
		return nil, "", nil, err
	}
	name = strings.TrimSpace(name)
	if name == "" {
		return nil, "", nil, fmt.Errorf("team name is required: %w", errdefs.ErrInvalid)
	}
	if len(name) > MaxTeamNameLen {
		return nil, "", nil, fmt.Errorf("team name longer than %d bytes: %w", MaxTeamNameLen, errdefs.ErrInvalid)
	}
	if err := q.validate(); err != nil {
		return nil, "", nil, err
	}
	ts, err := tb.ListTeams(ctx)
	if err != nil {
		return nil, "", nil, err
	}
	for _, t := range ts {
		if t.Name == name {
			return nil, "", nil, fmt.Errorf("team %q already exists: %w", name, errdefs.ErrConflict)
		}
	}
	id, err := newTeamID()
	if err != nil {
		return nil, "", nil, err
	}
	t := &Team{ID: id, Name: name, CreatedAt: k.now().UTC(), Quota: q}
	if err := tb.PutTeam(ctx, t); err != nil {
		return nil, "", nil, fmt.Errorf("store team: %w", err)
	}
	plain, key, err := k.CreateFor(ctx, name+"-admin", id, false)
	if err != nil {
		return nil, "", nil, err
	}
	return t, plain, key, nil
}

func (q Quota) validate() error {
	for _, v := range []int{q.Sandboxes, q.CPUs, q.MemoryMB, q.PausedDiskMB, q.Builds, q.TemplateDiskMB} {
		if v < 0 {
			return fmt.Errorf("a quota must be 0 (no limit) or more: %w", errdefs.ErrInvalid)
		}
	}
	return nil
}

// GetTeam returns a team (the default team always exists, stored or not yet).
func (k *Keys) GetTeam(ctx context.Context, id string) (*Team, error) {
	tb, err := k.teams()
	if err != nil {
		return nil, err
	}
	t, err := tb.GetTeam(ctx, id)
	if id == DefaultTeamID && errors.Is(err, errdefs.ErrNotFound) {
		return &Team{ID: DefaultTeamID, Name: DefaultTeamID}, nil
	}
	return t, err
}

// ListTeams returns every team, the default team first.
func (k *Keys) ListTeams(ctx context.Context) ([]*Team, error) {
	tb, err := k.teams()
	if err != nil {
		return nil, err
	}
	ts, err := tb.ListTeams(ctx)
	if err != nil {
		return nil, err
	}
	for _, t := range ts {
		if t.ID == DefaultTeamID {
			return ts, nil
		}
	}
	return append([]*Team{{ID: DefaultTeamID, Name: DefaultTeamID}}, ts...), nil
}

// SetQuota replaces a team's quota.
func (k *Keys) SetQuota(ctx context.Context, id string, q Quota) (*Team, error) {
	tb, err := k.teams()
	if err != nil {
		return nil, err
	}
	if err := q.validate(); err != nil {
		return nil, err
	}
	t, err := k.GetTeam(ctx, id)
	if err != nil {
		return nil, err
	}
	t.Quota = q
	if err := tb.PutTeam(ctx, t); err != nil {
		return nil, fmt.Errorf("store team: %w", err)
	}
	return t, nil
}

// DeleteTeam removes a team and revokes its keys (its objects stay until they end; no key can
// reach them). The default team cannot be removed.
func (k *Keys) DeleteTeam(ctx context.Context, id string) error {
	tb, err := k.teams()
	if err != nil {
		return err
	}
	if id == DefaultTeamID {
		return fmt.Errorf("the default team cannot be removed: %w", errdefs.ErrConflict)
	}
	if _, err := tb.GetTeam(ctx, id); err != nil {
		return err
	}
	keys, err := k.b.ListKeys(ctx)
	if err != nil {
		return err
	}
	for _, key := range keys {
		if key.Team == id {
			if err := k.b.DeleteKey(ctx, key.ID); err != nil {
				return err
			}
		}
	}
	return tb.DeleteTeam(ctx, id)
}

// ensureDefaultTeam makes the default team and moves the keys of an ember that had no teams
// into it, as its admin keys.
func (k *Keys) ensureDefaultTeam(ctx context.Context) error {
	tb, ok := k.b.(TeamBackend)
	if !ok {
		return nil
	}
	if _, err := tb.GetTeam(ctx, DefaultTeamID); err != nil {
		if !errors.Is(err, errdefs.ErrNotFound) {
			return err
		}
		if err := tb.PutTeam(ctx, &Team{ID: DefaultTeamID, Name: DefaultTeamID, CreatedAt: k.now().UTC()}); err != nil {
			return fmt.Errorf("store team: %w", err)
		}
	}
	keys, err := k.b.ListKeys(ctx)
	if err != nil {
		return err
	}
	for _, key := range keys {
		if key.Team == "" {
			key.Team, key.Admin = DefaultTeamID, true
			if err := k.b.PutKey(ctx, key); err != nil {
				return fmt.Errorf("migrate api key %s to the default team: %w", key.ID, err)
			}
		}
	}
	return nil
}

// SortTeams orders teams oldest first (then by id), as every TeamBackend lists them.
func SortTeams(ts []*Team) {
	sort.Slice(ts, func(i, j int) bool {
		if !ts[i].CreatedAt.Equal(ts[j].CreatedAt) {
			return ts[i].CreatedAt.Before(ts[j].CreatedAt)
		}
		return ts[i].ID < ts[j].ID
	})
}
