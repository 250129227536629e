package envd

import (
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// account is a resolved sandbox user.
type account struct {
	Name   string
	UID    uint32
	GID    uint32
	Groups []uint32
	Home   string
}

// lookupAccount returns the user named name, from /etc/passwd and /etc/group. Answers are
// cached while both files stay as they were: every command and file request names its user,
// and under gVisor parsing both files costs several times the two stats that check them.
func lookupAccount(name string) (*account, error) {
	stamp := accountFilesStamp()
	accounts.mu.Lock()
	if accounts.stamp != stamp || stamp == (filesStamp{}) {
		accounts.stamp, accounts.byName = stamp, map[string]*account{}
	}
	a := accounts.byName[name]
	accounts.mu.Unlock()
	if a == nil {
		var err error
		if a, err = readAccount(name); err != nil {
			return nil, err
		}
		accounts.mu.Lock()
		if accounts.stamp == stamp {
			accounts.byName[name] = a
		}
		accounts.mu.Unlock()
	}
	c := *a
	c.Groups = slices.Clone(a.Groups)
	return &c, nil
}

// accounts is lookupAccount's cache, valid for the account files' stamp.
var accounts struct {
	mu     sync.Mutex
	stamp  filesStamp
	byName map[string]*account
}

// fileStamp identifies one version of a file: tools that edit /etc/passwd write a new file
// and rename it over the old one (a new inode), and any write changes its mtime.
type fileStamp struct {
	ino, size int64
	mtime     time.Time
}

type filesStamp [2]fileStamp

// accountFilesStamp stamps /etc/passwd and /etc/group; the zero value when either cannot be
// read (nothing is cached then).
func accountFilesStamp() filesStamp {
	var st filesStamp
	for i, path := range []string{"/etc/passwd", "/etc/group"} {
		fi, err := os.Stat(path)
		if err != nil {
			return filesStamp{}
		}
		st[i] = fileStamp{size: fi.Size(), mtime: fi.ModTime()}
		if sys, ok := fi.Sys().(*syscall.Stat_t); ok {
			st[i].ino = int64(sys.Ino)
		}
	}
	return st
}

// readAccount reads the user from /etc/passwd and /etc/group (os/user; pure Go without cgo).
func readAccount(name string) (*account, error) {
	u, err := user.Lookup(name)
	if err != nil {
		return nil, errorf(errdefs.ErrInvalid, "user %q does not exist", name)
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, errorf(errdefs.ErrInvalid, "user %q has invalid uid %q", name, u.Uid)
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, errorf(errdefs.ErrInvalid, "user %q has invalid gid %q", name, u.Gid)
	}
	a := &account{Name: u.Username, UID: uint32(uid), GID: uint32(gid), Home: u.HomeDir}
	if a.Home == "" {
		a.Home = "/"
	}
	if ids, err := u.GroupIds(); err == nil {
		for _, id := range ids {
			if g, err := strconv.ParseUint(id, 10, 32); err == nil {
				a.Groups = append(a.Groups, uint32(g))
			}
		}
	}
	return a, nil
}

// resolvePath makes p absolute: relative paths (and "~") resolve against the user's home.
func (a *account) resolvePath(p string) string {
	if p == "~" {
		return a.Home
	}
	if len(p) >= 2 && p[:2] == "~/" {
		p = p[2:]
	}
	if !filepath.IsAbs(p) {
		p = filepath.Join(a.Home, p)
	}
	return filepath.Clean(p)
}

// nameCache maps uids/gids to names, for one listing.
type nameCache struct {
	users  map[uint32]string
	groups map[uint32]string
}

func newNameCache() *nameCache {
	return &nameCache{users: map[uint32]string{}, groups: map[uint32]string{}}
}

func (c *nameCache) user(uid uint32) string {
	if n, ok := c.users[uid]; ok {
		return n
	}
	n := strconv.FormatUint(uint64(uid), 10)
	if u, err := user.LookupId(n); err == nil {
		n = u.Username
	}
	c.users[uid] = n
	return n
}

func (c *nameCache) group(gid uint32) string {
	if n, ok := c.groups[gid]; ok {
		return n
	}
	n := strconv.FormatUint(uint64(gid), 10)
	if g, err := user.LookupGroupId(n); err == nil {
		n = g.Name
	}
	c.groups[gid] = n
	return n
}
