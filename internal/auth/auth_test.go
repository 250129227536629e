package auth

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

func TestCreateVerifyRevoke(t *testing.T) {
	ctx := context.Background()
	b := NewMemoryBackend()
	keys := NewKeys(b)

	plain, key, err := keys.Create(ctx, "ci")
	if err != nil {
		t.Fatal(err)
	}
	if !ValidKeyFormat(plain) {
		t.Fatalf("key %q is not e2b_<40 hex>", plain)
	}
	if key.Hash == plain || strings.Contains(key.Hash, plain[4:]) {
		t.Fatalf("stored hash leaks the plaintext")
	}
	if want := "e2b_" + plain[4:6] + "…" + plain[len(plain)-4:]; key.Mask != want {
		t.Fatalf("mask = %q, want %q", key.Mask, want)
	}
	if key.Name != "ci" || key.ID == "" || key.CreatedAt.IsZero() {
		t.Fatalf("key fields not set: %+v", key)
	}

	other, _, err := keys.Create(ctx, "")
	if err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name string
		key  string
		ok   bool
	}{
		{"issued key", plain, true},
		{"second key", other, true},
		{"empty", "", false},
		{"wrong prefix", "e2c_" + plain[4:], false},
		{"uppercase hex", strings.ToUpper(plain), false},
		{"well formed but unknown", "e2b_" + strings.Repeat("0", 40), false},
		{"trailing space", plain + " ", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := keys.Verify(ctx, tt.key)
			if tt.ok && err != nil {
				t.Fatalf("Verify: %v", err)
			}
			if !tt.ok && !errors.Is(err, errdefs.ErrUnauthorized) {
				t.Fatalf("Verify = %v, want ErrUnauthorized", err)
			}
		})
	}

	if err := keys.Revoke(ctx, key.ID, ""); err != nil {
		t.Fatal(err)
	}
	if _, err := keys.Verify(ctx, plain); !errors.Is(err, errdefs.ErrUnauthorized) {
		t.Fatalf("revoked key still verifies: %v", err)
	}
	if err := keys.Revoke(ctx, key.ID, ""); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("second revoke = %v, want ErrNotFound", err)
	}
	list, _ := keys.List(ctx, "")
	if len(list) != 1 {
		t.Fatalf("list has %d keys, want 1", len(list))
	}
	if err := keys.Revoke(ctx, list[0].ID, ""); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("revoking the last key = %v, want ErrConflict", err)
	}
}

func TestCreateRejectsLongName(t *testing.T) {
	keys := NewKeys(NewMemoryBackend())
	if _, _, err := keys.Create(context.Background(), strings.Repeat("x", MaxNameLen+1)); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("err = %v, want ErrInvalid", err)
	}
}

func TestEnsureInitialKey(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	b := NewMemoryBackend()
	keys := NewKeys(b)

	plain, created, err := keys.EnsureInitialKey(ctx, dir)
	if err != nil || !created {
		t.Fatalf("first start: created=%v err=%v", created, err)
	}
	if _, err := keys.Verify(ctx, plain); err != nil {
		t.Fatalf("initial key does not verify: %v", err)
	}
	path := datadir.APIKey(dir)
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Fatalf("key file mode %v, want 0600", st.Mode().Perm())
	}
	b2, _ := os.ReadFile(path)
	if strings.TrimSpace(string(b2)) != plain {
		t.Fatalf("key file holds %q, want %q", b2, plain)
	}

	again, created, err := keys.EnsureInitialKey(ctx, dir)
	if err != nil || created || again != "" {
		t.Fatalf("second start: %q created=%v err=%v, want nothing new", again, created, err)
	}

	// A wiped store re-registers the key the user already configured.
	fresh := NewKeys(NewMemoryBackend())
	same, created, err := fresh.EnsureInitialKey(ctx, dir)
	if err != nil || !created || same != plain {
		t.Fatalf("after store wipe: %q created=%v err=%v, want the same key back", same, created, err)
	}
}

func TestFileSignature(t *testing.T) {
	// Vectors computed with Node's crypto exactly as the E2B JS SDK does.
	tests := []struct {
		name                  string
		path, op, user, token string
		exp                   int64
		want                  string
	}{
		{"read no user no expiry", "/home/user/a.txt", OpRead, "", "tok-abc", 0, "v1_shr9/90N2wWSS66f1qgDcvlx1JHMJsE3NbhNt/Eyd6c"},
		{"write root expiring", "/home/user/a.txt", OpWrite, "root", "tok-abc", 1700000000, "v1_dpva/oXn6TCqp3HK0AbRYI/GGrWsS2HEXLL9viHSnqk"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := FileSignature(tt.path, tt.op, tt.user, tt.token, tt.exp); got != tt.want {
				t.Fatalf("FileSignature = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestVerifyFileSignature(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	good := FileSignature("/a", OpRead, "", "tok", 0)
	exp := now.Unix() + 60
	goodExp := FileSignature("/a", OpRead, "", "tok", exp)
	tests := []struct {
		name      string
		sig, path string
		op, user  string
		token     string
		exp       int64
		at        time.Time
		ok        bool
	}{
		{"valid", good, "/a", OpRead, "", "tok", 0, now, true},
		{"valid with expiry", goodExp, "/a", OpRead, "", "tok", exp, now, true},
		{"expired", goodExp, "/a", OpRead, "", "tok", exp, now.Add(2 * time.Minute), false},
		{"expiry stripped", goodExp, "/a", OpRead, "", "tok", 0, now, false},
		{"other path", good, "/b", OpRead, "", "tok", 0, now, false},
		{"write with read signature", good, "/a", OpWrite, "", "tok", 0, now, false},
		{"other user", good, "/a", OpRead, "root", "tok", 0, now, false},
		{"other token", good, "/a", OpRead, "", "tok2", 0, now, false},
		{"no token", FileSignature("/a", OpRead, "", "", 0), "/a", OpRead, "", "", 0, now, false},
		{"garbage", "v1_xyz", "/a", OpRead, "", "tok", 0, now, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := verifyFileSignatureAt(tt.at, tt.sig, tt.path, tt.op, tt.user, tt.token, tt.exp)
			if tt.ok && err != nil {
				t.Fatalf("verify: %v", err)
			}
			if !tt.ok && !errors.Is(err, errdefs.ErrUnauthorized) {
				t.Fatalf("verify = %v, want ErrUnauthorized", err)
			}
		})
	}
}

// Keys of an ember without teams become the default team's admin keys at start; the default
// team is made.
func TestEnsureInitialKeyMovesKeysIntoTheDefaultTeam(t *testing.T) {
	ctx := context.Background()
	b := NewMemoryBackend()
	if err := b.PutKey(ctx, &Key{ID: "old", Name: "old", Hash: HashKey("e2b_" + strings.Repeat("a", 40))}); err != nil {
		t.Fatal(err)
	}
	keys := NewKeys(b)
	if _, created, err := keys.EnsureInitialKey(ctx, t.TempDir()); err != nil || created {
		t.Fatalf("created=%v err=%v", created, err)
	}
	k, err := keys.Verify(ctx, "e2b_"+strings.Repeat("a", 40))
	if err != nil || k.Team != DefaultTeamID || !k.Admin {
		t.Fatalf("migrated key %+v, %v", k, err)
	}
	if _, err := b.GetTeam(ctx, DefaultTeamID); err != nil {
		t.Fatalf("default team: %v", err)
	}
}
