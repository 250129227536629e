// Package network owns ember's per-sandbox network slots: one fresh network namespace per
// sandbox holding the guest end ("eth0") of a veth pair whose host end keeps a unique /30 in the
// host namespace, the allocation of those slots (lowest free index, an optional pool of
// pre-created slots), and the one nftables table that isolates them (no slot-to-slot or
// slot-to-host traffic, private ranges always denied, masqueraded egress filtered by each
// slot's allow/deny rules: egress.go). It must not touch any other nftables table, netns or
// interface than those carrying its own name prefix, and knows nothing of sandboxes or runtimes.
//
// A slot is single-use: gVisor (runsc --network=sandbox) takes over the guest interface and
// strips its kernel addresses, so Release deletes the namespace and the next sandbox gets a
// new one.
package network

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// GuestIfName is the name of the slot's interface inside its namespace.
const GuestIfName = "eth0"

// NetNSDir is where named network namespaces are bind-mounted (the same place as `ip netns`).
const NetNSDir = "/run/netns"

// Defaults applied by New to zero fields of Config.
const (
	DefaultCIDR          = "10.11.0.0/16"
	DefaultNamePrefix    = "emb"
	DefaultTable         = "ember"
	DefaultInternetGroup = 0x656d62 // "emb"
)

// Config configures a Manager. Zero fields take the defaults above.
type Config struct {
	// CIDR is carved into /30 slots: slot i gets base+4i, host .1, guest .2.
	CIDR netip.Prefix
	// NamePrefix names everything the manager owns: netns "<prefix>-<i>", host veth
	// "<prefix><i>h". The host is assumed to have no other interface starting with it.
	NamePrefix string
	// Table is the nftables table (family inet) that Init installs or replaces.
	Table string
	// PoolSize slots are kept pre-created in the background so Acquire does no netlink work;
	// 0 disables the pool.
	PoolSize int
	// InternetGroup is no longer used: egress is decided by each slot's rules (egress.go).
	// Kept so configurations that set it still load.
	InternetGroup uint32
	// Resolvers are the DNS servers sandboxes use (the nameservers of the template rootfs's
	// /etc/resolv.conf, a copy of the host's). A slot reaches them on port 53, even in an
	// always-denied range, when its own rules would let it reach their address (so: when
	// internet access is on). Nil means the IPv4, non-loopback nameservers of the host's
	// /etc/resolv.conf.
	Resolvers []netip.Addr
	// HostMark, when non-zero, lets only host sockets carrying this mark (SO_MARK) reach the
	// slots: the daemon dials with MarkedDialer(HostMark); every other host process is cut off.
	HostMark uint32
	// ProxyPort, when non-zero, is the host port of the node's egress proxy: the TCP of slots
	// with SlotOptions.Proxy is redirected there.
	ProxyPort uint16
	// Logger receives background events (pool failures); nil means slog.Default().
	Logger *slog.Logger
}

// Slot is one sandbox's network: a named netns whose "eth0" has GuestIP/30 and a default route
// via HostIP, the address of HostVeth in the host namespace.
type Slot struct {
	Index     int
	NetNS     string // name under NetNSDir, as `ip netns` shows it
	NetNSPath string // path to hand to the runtime (OCI spec network namespace path)
	HostVeth  string
	HostIP    netip.Addr
	GuestIP   netip.Addr
	Subnet    netip.Prefix
	// Options are the slot's egress rules (read them through Manager.Rules while it is held).
	Options SlotOptions
}

// Manager allocates, creates, adopts and deletes slots. It is safe for concurrent use.
type Manager struct {
	cfg     Config
	log     *slog.Logger
	maxSlot int // number of /30 slots in cfg.CIDR
	nsRe    *regexp.Regexp
	vethRe  *regexp.Regexp
	links   linkOps

	// fwMu serialises nftables transactions; rules mirrors the slot chains installed in the
	// table (by index), valid once Init has installed the table (fwReady).
	fwMu    sync.Mutex
	fwReady bool
	nft     string
	rules   map[int]SlotOptions
	nftRuns atomic.Int64 // nft invocations (tests check the pool's fast path)

	mu          sync.Mutex
	used        []bool        // index reserved: acquired, pooled, adopted, being created or deleted
	active      map[int]*Slot // handed out by Acquire/Adopt
	pool        []*Slot       // pre-created, not handed out
	poolStarted bool
	closed      bool
	kick        chan struct{}
	stop        chan struct{}
	wg          sync.WaitGroup
}

var prefixRe = regexp.MustCompile(`^[a-z][a-z0-9]*$`)
var tableRe = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// New validates cfg and returns a Manager. It creates nothing; call Init, then Adopt and
// Reconcile at start-up. The pool (if any) starts filling after Reconcile or the first Acquire,
// so it never takes an index a not-yet-adopted sandbox still owns.
func New(cfg Config) (*Manager, error) {
	if !cfg.CIDR.IsValid() {
		cfg.CIDR = netip.MustParsePrefix(DefaultCIDR)
	}
	if cfg.NamePrefix == "" {
		cfg.NamePrefix = DefaultNamePrefix
	}
	if cfg.Table == "" {
		cfg.Table = DefaultTable
	}
	if cfg.InternetGroup == 0 {
		cfg.InternetGroup = DefaultInternetGroup
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Resolvers == nil {
		cfg.Resolvers = hostResolvers("/etc/resolv.conf")
	}
	cfg.Resolvers = slices.Clone(cfg.Resolvers)
	for i, r := range cfg.Resolvers {
		if !r.Unmap().Is4() {
			return nil, fmt.Errorf("network.resolvers: %s: must be an IPv4 address: %w", r, errdefs.ErrInvalid)
		}
		cfg.Resolvers[i] = r.Unmap()
	}
	cfg.CIDR = cfg.CIDR.Masked()
	if !cfg.CIDR.Addr().Is4() || cfg.CIDR.Bits() > 30 || cfg.CIDR.Bits() < 8 {
		return nil, fmt.Errorf("network.cidr: %s: must be an IPv4 prefix between /8 and /30: %w", cfg.CIDR, errdefs.ErrInvalid)
	}
	if !prefixRe.MatchString(cfg.NamePrefix) {
		return nil, fmt.Errorf("network.name_prefix: %q: must be lowercase letters and digits, starting with a letter: %w", cfg.NamePrefix, errdefs.ErrInvalid)
	}
	if !tableRe.MatchString(cfg.Table) {
		return nil, fmt.Errorf("network.table: %q: must be letters, digits and underscores: %w", cfg.Table, errdefs.ErrInvalid)
	}
	if cfg.PoolSize < 0 {
		return nil, fmt.Errorf("network.pool_size: %d: must not be negative: %w", cfg.PoolSize, errdefs.ErrInvalid)
	}
	maxSlot := 1 << (30 - cfg.CIDR.Bits())
	if n := len(cfg.NamePrefix) + len(strconv.Itoa(maxSlot-1)) + 1; n > 15 {
		return nil, fmt.Errorf("network.name_prefix: %q: host veth names would be %d characters, the kernel allows 15: %w", cfg.NamePrefix, n, errdefs.ErrInvalid)
	}
	if cfg.PoolSize > maxSlot {
		return nil, fmt.Errorf("network.pool_size: %d: larger than the %d slots of %s: %w", cfg.PoolSize, maxSlot, cfg.CIDR, errdefs.ErrInvalid)
	}
	links, err := newLinkOps()
	if err != nil {
		return nil, err
	}
	q := regexp.QuoteMeta(cfg.NamePrefix)
	return &Manager{
		cfg:     cfg,
		log:     cfg.Logger.With("component", "network"),
		maxSlot: maxSlot,
		nsRe:    regexp.MustCompile(`^` + q + `-(0|[1-9][0-9]*)$`),
		vethRe:  regexp.MustCompile(`^` + q + `(0|[1-9][0-9]*)h$`),
		links:   links,
		active:  map[int]*Slot{},
		rules:   map[int]SlotOptions{},
		kick:    make(chan struct{}, 1),
		stop:    make(chan struct{}),
	}, nil
}

// Config returns the effective configuration (defaults applied).
func (m *Manager) Config() Config { return m.cfg }

// MaxSlots is the number of slots the CIDR holds.
func (m *Manager) MaxSlots() int { return m.maxSlot }

// slotFor computes the names and addresses of slot index (no system state).
func (m *Manager) slotFor(index int) *Slot {
	base := m.cfg.CIDR.Addr().As4()
	off := uint32(index) * 4
	v := uint32(base[0])<<24 | uint32(base[1])<<16 | uint32(base[2])<<8 | uint32(base[3])
	v += off
	at := func(d uint32) netip.Addr {
		x := v + d
		return netip.AddrFrom4([4]byte{byte(x >> 24), byte(x >> 16), byte(x >> 8), byte(x)})
	}
	name := m.cfg.NamePrefix + "-" + strconv.Itoa(index)
	return &Slot{
		Index:     index,
		NetNS:     name,
		NetNSPath: filepath.Join(NetNSDir, name),
		HostVeth:  m.cfg.NamePrefix + strconv.Itoa(index) + "h",
		HostIP:    at(1),
		GuestIP:   at(2),
		Subnet:    netip.PrefixFrom(at(0), 30),
	}
}

// reserveLocked marks the lowest free index used.
func (m *Manager) reserveLocked() (int, error) {
	for i, u := range m.used {
		if !u && i < m.maxSlot { // indexes past maxSlot only appear while Reconcile removes them
			m.used[i] = true
			return i, nil
		}
	}
	if len(m.used) >= m.maxSlot {
		return 0, fmt.Errorf("all %d network slots of %s are in use: %w", m.maxSlot, m.cfg.CIDR, errdefs.ErrExhausted)
	}
	m.used = append(m.used, true)
	return len(m.used) - 1, nil
}

func (m *Manager) markLocked(index int) {
	for len(m.used) <= index {
		m.used = append(m.used, false)
	}
	m.used[index] = true
}

func (m *Manager) free(index int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if index < len(m.used) {
		m.used[index] = false
	}
}

func (m *Manager) isUsedLocked(index int) bool { return index < len(m.used) && m.used[index] }

// Acquire returns a ready slot: one from the pool when available, else a freshly created one at
// the lowest free index.
func (m *Manager) Acquire(ctx context.Context, opts SlotOptions) (*Slot, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil, fmt.Errorf("network manager closed: %w", errdefs.ErrUnavailable)
	}
	m.startPoolLocked()
	var s *Slot
	for len(m.pool) > 0 && s == nil {
		s = m.pool[0]
		m.pool = m.pool[1:]
		if !isNetNSMount(s.NetNSPath) { // deleted behind our back (ip netns del)
			m.mu.Unlock()
			m.log.Warn("pooled network slot vanished; dropping it", "index", s.Index)
			_ = m.destroyAndFree(ctx, s.Index)
			s = nil
			m.mu.Lock()
		}
	}
	if s != nil {
		m.mu.Unlock()
		m.kickPool()
	} else {
		index, err := m.reserveLocked()
		m.mu.Unlock()
		if err != nil {
			return nil, err
		}
		s, err = m.create(index)
		if err != nil {
			m.free(index)
			return nil, err
		}
	}
	s.Options = opts.normalized()
	if err := m.installRules(ctx, s.Index, s.Options); err != nil {
		m.destroyAndFree(ctx, s.Index)
		return nil, err
	}
	m.mu.Lock()
	m.active[s.Index] = s
	m.mu.Unlock()
	return s, nil
}

// Adopt re-registers, after a daemon restart, a slot that a running sandbox still uses. It
// returns an error wrapping errdefs.ErrNotFound if the slot's netns or host veth is gone, and
// errdefs.ErrConflict if the index is already in use in this manager. It (re)installs opts as
// the slot's egress rules.
func (m *Manager) Adopt(index int, opts SlotOptions) (*Slot, error) {
	if index < 0 || index >= m.maxSlot {
		return nil, fmt.Errorf("slot index %d outside 0..%d: %w", index, m.maxSlot-1, errdefs.ErrInvalid)
	}
	s := m.slotFor(index)
	if !isNetNSMount(s.NetNSPath) {
		return nil, fmt.Errorf("adopt slot %d: netns %s: %w", index, s.NetNSPath, errdefs.ErrNotFound)
	}
	if !m.links.exists(s.HostVeth) {
		return nil, fmt.Errorf("adopt slot %d: host veth %s: %w", index, s.HostVeth, errdefs.ErrNotFound)
	}
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil, fmt.Errorf("network manager closed: %w", errdefs.ErrUnavailable)
	}
	if m.isUsedLocked(index) {
		m.mu.Unlock()
		return nil, fmt.Errorf("adopt slot %d: index already in use: %w", index, errdefs.ErrConflict)
	}
	m.markLocked(index)
	m.mu.Unlock()
	s.Options = opts.normalized()
	m.fwMu.Lock()
	delete(m.rules, index) // whatever the table holds for it now, replace it
	err := m.installRulesLocked(context.Background(), index, s.Options)
	m.fwMu.Unlock()
	if err != nil {
		m.free(index)
		return nil, fmt.Errorf("adopt slot %d: %w", index, err)
	}
	m.mu.Lock()
	m.active[index] = s
	m.mu.Unlock()
	return s, nil
}

// Release deletes the slot's host veth (and with it the guest end) and its netns, then frees
// the index. Releasing a slot twice, or a slot this manager no longer holds, does nothing.
func (m *Manager) Release(ctx context.Context, s *Slot) error {
	if s == nil {
		return nil
	}
	m.mu.Lock()
	if m.active[s.Index] != s {
		m.mu.Unlock()
		return nil
	}
	delete(m.active, s.Index)
	m.mu.Unlock()
	err := m.destroyAndFree(ctx, s.Index)
	m.kickPool() // the pool may have stopped on an exhausted CIDR
	return err
}

func (m *Manager) destroyAndFree(ctx context.Context, index int) error {
	err := errors.Join(m.uninstallRules(ctx, index), m.destroy(ctx, index))
	// Freed even on error: create() removes leftovers at an index before reusing it.
	m.free(index)
	return err
}

// Reconcile deletes every netns and host veth carrying this manager's prefix whose index is
// neither in keep nor held by this manager (leftovers of a crash). Call it after Adopt at
// start-up; it also starts the pool.
func (m *Manager) Reconcile(ctx context.Context, keep []int) error {
	found := map[int]bool{}
	entries, err := os.ReadDir(NetNSDir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("list %s: %w", NetNSDir, err)
	}
	for _, e := range entries {
		if mm := m.nsRe.FindStringSubmatch(e.Name()); mm != nil {
			if i, err := strconv.Atoi(mm[1]); err == nil {
				found[i] = true
			}
		}
	}
	names, err := m.links.names()
	if err != nil {
		return err
	}
	for _, n := range names {
		if mm := m.vethRe.FindStringSubmatch(n); mm != nil {
			if i, err := strconv.Atoi(mm[1]); err == nil {
				found[i] = true
			}
		}
	}
	var remove []int
	m.mu.Lock()
	for i := range found {
		if !slices.Contains(keep, i) && !m.isUsedLocked(i) {
			m.markLocked(i) // nobody may create here while we delete
			remove = append(remove, i)
		}
	}
	m.mu.Unlock()
	for _, i := range remove {
		m.log.Info("removing leftover network slot", "index", i)
	}
	err = m.destroyAllAndFree(ctx, remove)
	m.mu.Lock()
	m.startPoolLocked()
	m.mu.Unlock()
	return err
}

// destroyAllAndFree destroys slots concurrently, so the kernel tears their namespaces down in
// one batch.
func (m *Manager) destroyAllAndFree(ctx context.Context, indexes []int) error {
	errs := make([]error, len(indexes))
	var wg sync.WaitGroup
	for n, i := range indexes {
		wg.Go(func() { errs[n] = m.destroyAndFree(ctx, i) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Close stops the pool and releases its pre-created slots. Slots handed out stay; the nftables
// table stays.
func (m *Manager) Close(ctx context.Context) error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed = true
	close(m.stop)
	m.mu.Unlock()
	done := make(chan struct{})
	go func() { m.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		return ctx.Err()
	}
	m.mu.Lock()
	pool := m.pool
	m.pool = nil
	m.mu.Unlock()
	indexes := make([]int, len(pool))
	for n, s := range pool {
		indexes[n] = s.Index
	}
	return m.destroyAllAndFree(ctx, indexes)
}

// PoolLen reports how many pre-created slots are ready.
func (m *Manager) PoolLen() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.pool)
}

func (m *Manager) startPoolLocked() {
	if m.poolStarted || m.cfg.PoolSize == 0 || m.closed {
		return
	}
	m.poolStarted = true
	m.wg.Add(1)
	go m.fillPool()
	m.kickPool()
}

func (m *Manager) kickPool() {
	select {
	case m.kick <- struct{}{}:
	default:
	}
}

// fillPool keeps PoolSize slots ready, one creation at a time.
func (m *Manager) fillPool() {
	defer m.wg.Done()
	backoff := time.Duration(0)
	for {
		select {
		case <-m.stop:
			return
		case <-m.kick:
		}
		for {
			m.mu.Lock()
			if m.closed || len(m.pool) >= m.cfg.PoolSize {
				m.mu.Unlock()
				break
			}
			index, err := m.reserveLocked()
			m.mu.Unlock()
			if err != nil {
				break // exhausted: Release kicks nothing, the next Acquire will
			}
			s, err := m.create(index)
			if err != nil {
				m.free(index)
				backoff = min(max(2*backoff, 100*time.Millisecond), 10*time.Second)
				m.log.Warn("pre-creating network slot failed", "index", index, "err", err, "retry_in", backoff)
				select {
				case <-m.stop:
					return
				case <-time.After(backoff):
				}
				continue
			}
			backoff = 0
			// Most sandboxes keep the default rules: install them now, so Acquire needs no nft.
			if err := m.installRules(context.Background(), index, defaultOptions); err != nil {
				m.log.Warn("pre-installing egress rules failed", "index", index, "err", err)
			}
			m.mu.Lock()
			if m.closed {
				m.mu.Unlock()
				m.destroyAndFree(context.Background(), index)
				return
			}
			m.pool = append(m.pool, s)
			m.mu.Unlock()
		}
	}
}
