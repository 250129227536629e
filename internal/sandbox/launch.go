package sandbox

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/ember-sandbox/ember/internal/admission"
	"github.com/ember-sandbox/ember/internal/envdclient"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// The one launch path. Every runtime instance ember runs — a sandbox created from a
// checkpoint or by a boot, a pool instance, a fork child, a resumed sandbox, a template being
// warmed up — is started by launch and released by teardown, and its state lives where
// instanceDir says: under the directory of the sandbox that owns it. A pool instance is owned
// by the sandbox id it will have once assigned, so an assigned sandbox's layer is already
// where every later start-up expects it, and nothing is ever moved under a running instance.

// launchSpec says what to launch.
type launchSpec struct {
	// owner is the id of the sandbox the instance belongs to (for pool instances the id it will
	// be assigned; for template warm-ups a throw-away id).
	owner string
	tpl   *Template
	// image to restore; "" boots the template's rootfs.
	image string
	// layerFrom boots (image "") on the writable layer of this image (filesystem-only resume).
	layerFrom string
	// consume: the image is not used again (resume): the driver may move its contents.
	consume bool
	// prestart stops once the runtime has created the instance with image's layer (and its
	// slot): nothing is restored, envd is not waited for. The placement goes to the
	// pre-started pool; a later launch with into restores image into it.
	prestart bool
	// into is a pre-started instance's placement (owned by owner) to restore image into
	// instead of creating an instance; on failure it is torn down like any other.
	into *Placement
	// init gives the instance sb's identity through envd /init; initToken authenticates against
	// an image whose envd already holds a token.
	init      *Sandbox
	initToken string
	// deferInit: the launch ends once the runtime runs the instance; the caller sends init
	// itself (identify), alongside other work (a rollback's record: rollbackinit.go).
	deferInit bool
	// guest: the instance serves a sandbox (or a pool instance) from now on. Its guest
	// transport is opened before envd's /health and /init, which go through it, so the
	// connection they leave idle carries the sandbox's first request.
	guest bool
	// busyDir is an instance state directory of owner's still in use (a rollback's old
	// instance): the new instance gets another.
	busyDir string
	// Resources and network.
	cpu, memMB, diskMB int
	egress             Egress
	// mounts: the sandbox's volumes (volumemounts.go).
	mounts []VolumeMount
}

// instanceDir is the one place that decides where an instance's state lives.
func (m *Manager) instanceDir(owner, instance string) string {
	return filepath.Join(m.sandboxDir(owner), "run-"+instance[len(instance)-4:])
}

// noSlot marks a Placement without a network slot.
const noSlot = -1

// launch starts an instance as spec says: a network slot, a runtime instance booted or
// restored, envd up, and (with spec.init) /init. It returns the placement; on failure
// everything it acquired is released by teardown before it returns.
func (m *Manager) launch(ctx context.Context, spec launchSpec) (p Placement, err error) {
	p = Placement{Driver: m.cfg.Driver.Name(), SlotIndex: noSlot}
	inst := instanceID(spec.owner)
	for spec.busyDir != "" && m.instanceDir(spec.owner, inst) == spec.busyDir {
		inst = instanceID(spec.owner)
	}
	if spec.into != nil {
		// Admitted, with its slot and instance, when it was pre-started.
		p, inst = *spec.into, spec.into.InstanceID
	}
	defer func() {
		if err != nil {
			m.teardown(context.WithoutCancel(ctx), spec.owner, p)
			m.release(inst)
			p = Placement{SlotIndex: noSlot}
		}
	}()
	if err := m.faults.hit("launch.start"); err != nil {
		return p, err
	}
	// Nothing boots on a stack of directories that are not ember's layers (layerid.go).
	if err := m.checkStack(spec.tpl.RootFS, spec.tpl.Lowers); err != nil {
		return p, err
	}
	t0 := time.Now()
	if spec.into != nil {
		if err := m.startSlot(ctx); err != nil {
			return p, err
		}
		defer m.startDone()
		return p, m.restoreInto(ctx, spec, p, t0)
	}
	if err := m.admit(ctx, inst); err != nil {
		return p, err
	}
	if !spec.prestart {
		if err := m.startSlot(ctx); err != nil {
			return p, err
		}
		defer m.startDone()
	}
	slot, err := m.cfg.Network.Acquire(ctx, spec.egress)
	if err != nil {
		return p, fmt.Errorf("network slot: %w", err)
	}
	p.SlotIndex, p.GuestIP = slot.Index, slot.GuestIP.String()
	if err := m.faults.hit("launch.slot"); err != nil {
		return p, err
	}
	rs := runtime.Spec{
		ID:           inst,
		RootFS:       spec.tpl.RootFS,
		Lowers:       spec.tpl.Lowers,
		StateDir:     m.instanceDir(spec.owner, inst),
		NetNSPath:    slot.NetNSPath,
		Hostname:     "sandbox",
		Args:         []string{m.cfg.EnvdPath},
		Env:          []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root"},
		Cwd:          "/",
		CPUCount:     spec.cpu,
		MemoryMB:     spec.memMB,
		DiskMB:       spec.diskMB,
		ConsumeImage: spec.consume,
		LayerFrom:    spec.layerFrom,
		Binds:        binds(spec.mounts, m.cfg.VolumeDir),
	}
	p.StateDir = rs.StateDir
	if err := os.MkdirAll(rs.StateDir, 0o700); err != nil {
		return p, err
	}
	t1 := time.Now()
	p.InstanceID = inst // from here on teardown deletes the instance, whatever state it reached
	if spec.prestart {
		ps, ok := m.cfg.Driver.(runtime.Prestarter)
		if !ok {
			return p, fmt.Errorf("driver %s cannot pre-start instances: %w", m.cfg.Driver.Name(), errdefs.ErrInvalid)
		}
		if err := ps.Prestart(ctx, rs, spec.image); err != nil {
			return p, fmt.Errorf("pre-start instance: %w", err)
		}
		if err := m.faults.hit("launch.prestart"); err != nil {
			return p, err
		}
		m.logger(spec.owner).Debug("pre-start timings", "instance", inst, "slot_ms", ms(t1.Sub(t0)), "runtime_ms", ms(time.Since(t1)))
		return p, nil
	}
	if spec.image == "" {
		err = m.cfg.Driver.Start(ctx, rs)
	} else {
		err = m.cfg.Driver.Restore(ctx, rs, spec.image)
	}
	if err != nil {
		return p, fmt.Errorf("start instance: %w", err)
	}
	return p, m.launched(ctx, spec, p, t0, t1)
}

// startSlot waits for one of the node's MaxStarting tokens (startDone gives it back).
func (m *Manager) startSlot(ctx context.Context) error {
	if m.starting == nil {
		return nil
	}
	select {
	case m.starting <- struct{}{}:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("waiting to start an instance (%d are starting): %w", cap(m.starting), context.Cause(ctx))
	}
}

func (m *Manager) startDone() {
	if m.starting != nil {
		<-m.starting
	}
}

// restoreInto is launch's path for a pre-started instance: spec.image is restored into the
// instance of p, then envd and /init as for any launch.
func (m *Manager) restoreInto(ctx context.Context, spec launchSpec, p Placement, t0 time.Time) error {
	ps, ok := m.cfg.Driver.(runtime.Prestarter)
	if !ok {
		return fmt.Errorf("driver %s cannot restore into pre-started instances: %w", m.cfg.Driver.Name(), errdefs.ErrInvalid)
	}
	if err := ps.RestoreInto(ctx, p.InstanceID, spec.image); err != nil {
		return fmt.Errorf("restore into pre-started instance: %w", err)
	}
	return m.launched(ctx, spec, p, t0, t0)
}

// launched completes a launch once the runtime runs the instance: the fault point, envd's
// health, /init and the timings line.
func (m *Manager) launched(ctx context.Context, spec launchSpec, p Placement, t0, t1 time.Time) error {
	inst := p.InstanceID
	if err := m.faults.hit("launch.runtime"); err != nil {
		return err
	}
	t2 := time.Now()
	base := envdBase(p.GuestIP)
	client := m.initClient
	if spec.guest {
		m.guestT.open(p.GuestIP, inst, false) // closed by teardown, like every guest transport
		client = m.guest
	}
	if spec.init == nil {
		// Nothing to send: wait for envd's health (with an identity to give, /init is sent
		// once envd is up and its answer says so: envdinit.go).
		if err := m.waitEnvd(ctx, client, base); err != nil {
			return err
		}
	}
	t3 := time.Now()
	if spec.init != nil && !spec.deferInit {
		if err := m.identify(ctx, client, base, spec); err != nil {
			return err
		}
	}
	if err := m.faults.hit("launch.envd"); err != nil {
		return err
	}
	m.logger(spec.owner).Debug("launch timings", "instance", inst, "restore", spec.image != "", "prestarted", spec.into != nil,
		"slot_ms", ms(t1.Sub(t0)), "runtime_ms", ms(t2.Sub(t1)), "envd_ms", ms(t3.Sub(t2)), "init_ms", ms(time.Since(t3)))
	return nil
}

// teardown releases what placement p holds: the runtime instance, the network slot, the
// instance's state directory and its guest transport. It copes with partial placements (a
// launch that failed half-way) and is idempotent, so failure paths, kill, pause, pool discard
// and reconcile all use it.
func (m *Manager) teardown(ctx context.Context, owner string, p Placement) {
	log := m.logger(owner)
	defer m.release(p.InstanceID)
	if p.GuestIP != "" {
		m.guestT.close(p.GuestIP)
	}
	if p.InstanceID != "" {
		if err := m.cfg.Driver.Delete(ctx, p.InstanceID); err != nil {
			log.Warn("delete instance", "instance", p.InstanceID, "err", err)
		}
	}
	if p.SlotIndex >= 0 && p.GuestIP != "" {
		if err := m.cfg.Network.Release(ctx, p.SlotIndex); err != nil {
			log.Warn("release slot", "slot", p.SlotIndex, "err", err)
		}
	}
	if p.StateDir != "" {
		// Only after the instance is gone: its layer and mounts live here.
		if err := m.cfg.Driver.Release(ctx, p.StateDir); err != nil {
			// It may still hold a layer owed to a pause image: keep it for reconcile, which
			// releases it again at the next start, rather than remove the sandbox's files.
			log.Warn("release instance dir; kept for the next start", "dir", p.StateDir, "err", err)
			return
		}
		if err := os.RemoveAll(p.StateDir); err != nil {
			log.Warn("remove instance dir", "dir", p.StateDir, "err", err)
		}
	}
}

// teardownSandbox is the teardown of a sandbox that ends (a kill, an end, a create or a pool
// instance given up, a build sandbox closed): its instance p (teardown), then its directory,
// with whatever is still mounted in it (removeSandboxDir). Idempotent, like both halves.
func (m *Manager) teardownSandbox(ctx context.Context, owner string, p Placement) {
	m.teardown(ctx, owner, p)
	m.removeSandboxDir(owner)
}

// removeSandboxDir removes a sandbox's directory and detaches what is mounted in it (call it
// only once no instance runs there). Idempotent.
func (m *Manager) removeSandboxDir(id string) {
	if err := overlayfs.RemoveTree(m.sandboxDir(id), overlayfs.DetachMounts); err != nil {
		m.logger(id).Warn("remove sandbox dir", "err", err)
	}
}

// admit counts instance against the node's MaxSandboxes. A launch over it waits in the
// node's fair admission queue as long as ctx's admission.Ticket allows (creates through the
// API: internal/api), else it is refused at once. Waiting holds nothing: admit is the first
// thing a launch acquires.
func (m *Manager) admit(ctx context.Context, instance string) error {
	t := admission.TicketOf(ctx)
	if t.Waited != nil {
		defer func(start time.Time) { t.Waited(time.Since(start)) }(time.Now())
	}
	err := m.admission.Admit(ctx, t.Tenant, t.Wait, func() bool {
		m.mu.Lock()
		defer m.mu.Unlock()
		if len(m.instances) >= m.cfg.MaxSandboxes {
			return false
		}
		m.instances[instance] = true
		return true
	})
	var ref *admission.Refusal
	if errors.As(err, &ref) {
		return fmt.Errorf("this node runs its maximum of %d sandboxes: %w", m.cfg.MaxSandboxes, err)
	}
	return err
}

// release stops counting instance (idempotent); its room goes to the queue's next waiter.
func (m *Manager) release(instance string) {
	m.mu.Lock()
	_, held := m.instances[instance]
	delete(m.instances, instance)
	m.mu.Unlock()
	if held {
		m.admission.Kick()
	}
}

func envdBase(guestIP string) string {
	ip, err := netip.ParseAddr(guestIP)
	if err != nil {
		return "http://invalid"
	}
	return "http://" + netip.AddrPortFrom(ip, envdclient.Port).String()
}

// watch notices when a running sandbox's instance stops by itself (killed from outside, out
// of memory, envd exited): the sandbox leaves running with the reason, and everything it held
// is released. It returns when the instance stops or the Manager closes.
func (m *Manager) watch(e *entry, instance string) {
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		ex, err := m.cfg.Driver.Wait(m.bg, instance)
		if err != nil {
			if m.bg.Err() == nil {
				m.log.Warn("wait for instance", "instance", instance, "err", err)
			}
			return
		}
		e.mu.Lock()
		defer e.mu.Unlock()
		if h := e.hot; h != nil && h.inst == instance && e.sb.State == StatePaused {
			// Paused in memory and its instance died: on disk if its state got there, else lost.
			m.logger(e.sb.ID).Warn("instance of a sandbox paused in memory stopped", "instance", instance, "reason", ex.Reason)
			m.hotLostLocked(context.Background(), e)
			return
		}
		if e.sb.State != StateRunning || e.sb.Runtime.InstanceID != instance {
			return // paused, killed or moved on by the Manager itself
		}
		reason := string(ex.Reason)
		if reason == "" {
			reason = string(runtime.ExitKilled)
		}
		m.logger(e.sb.ID).Warn("sandbox stopped by itself", "instance", instance, "reason", reason, "code", ex.Code, "detail", ex.Detail)
		m.endLocked(context.Background(), e, reason)
	}()
}

// ---- envd, from the host ----

// waitEnvd polls envd's /health through client until it answers.
func (m *Manager) waitEnvd(ctx context.Context, client *http.Client, base string) error {
	ctx, cancel := context.WithTimeout(ctx, m.cfg.EnvdTimeout)
	defer cancel()
	envd := envdclient.New(client, base, "")
	delay := 2 * time.Millisecond
	var last error
	for {
		// A short bound per attempt: a lost first SYN on a fresh veth would otherwise cost the
		// kernel's 1 s retransmit.
		actx, acancel := context.WithTimeout(ctx, 250*time.Millisecond)
		err := envd.Health(actx)
		acancel()
		if err == nil {
			return nil
		}
		last = err
		select {
		case <-ctx.Done():
			return fmt.Errorf("envd at %s did not come up: %v: %w", base, last, errdefs.ErrUnavailable)
		case <-time.After(delay):
		}
		if delay < 50*time.Millisecond {
			delay *= 2
		}
	}
}

// identify gives the instance at base spec.init's identity (/init, authenticated with
// spec.initToken) and, when its rules need it, the egress CA.
func (m *Manager) identify(ctx context.Context, client *http.Client, base string, spec launchSpec) error {
	if err := m.initEnvd(ctx, client, base, spec.init, spec.initToken, spec.tpl); err != nil {
		return err
	}
	return m.trustEgressCA(ctx, client, base, spec.init) // egressca.go
}

// initEnvd gives the sandbox its identity through client: env vars and access token. oldToken
// authenticates against an envd that already holds one (template, pool instance, snapshot or
// fork). envd has EnvdTimeout to answer (a wedged guest must not hold a create forever); one
// that does not is the guest's failure to start (503 saying so), not an internal error.
func (m *Manager) initEnvd(ctx context.Context, client *http.Client, base string, sb *Sandbox, oldToken string, tpl *Template) error {
	ictx, cancel := context.WithTimeout(ctx, m.cfg.EnvdTimeout)
	defer cancel()
	user, workdir := "user", "/home/user"
	env := sb.EnvVars
	if tpl != nil {
		if tpl.User != "" {
			user, workdir = tpl.User, ""
		}
		if tpl.Workdir != "" {
			workdir = tpl.Workdir
		}
		if len(tpl.Env) > 0 {
			env = make(map[string]string, len(tpl.Env)+len(sb.EnvVars))
			for k, v := range tpl.Env {
				env[k] = v
			}
			for k, v := range sb.EnvVars {
				env[k] = v
			}
		}
	}
	body := envdclient.InitRequest{
		EnvVars:        env,
		AccessToken:    sb.AccessToken,
		DefaultUser:    user,
		DefaultWorkdir: workdir,
		Hostname:       "sandbox",
		Timestamp:      time.Now().UTC(),
	}
	envd := envdclient.New(client, base, oldToken)
	err := m.sendWhenUp(ictx, func(ctx context.Context) error { return envd.Init(ctx, body) })
	if err != nil && ctx.Err() == nil && ictx.Err() != nil && !errors.Is(err, errdefs.ErrUnavailable) {
		return fmt.Errorf("envd did not answer /init within %s (the node may be overloaded): %v: %w", m.cfg.EnvdTimeout, err, errdefs.ErrUnavailable)
	}
	return err
}

// ---- fault injection (tests) ----

// faults makes named points of the Manager fail on demand, so unit tests can prove that every
// step of a launch releases what it acquired. The zero value injects nothing.
type faults struct {
	fail func(point string) error
}

func (f *faults) hit(point string) error {
	if f == nil || f.fail == nil {
		return nil
	}
	if err := f.fail(point); err != nil {
		return fmt.Errorf("injected fault at %s: %w", point, err)
	}
	return nil
}
