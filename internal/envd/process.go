package envd

import (
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/creack/pty"
	"google.golang.org/protobuf/proto"

	pb "github.com/ember-sandbox/ember/api/gen/process"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// outputGrace is how long, after a command exits, envd keeps waiting for its output pipes to
// close. A background child that inherited stdout would otherwise hold the stream open forever.
const outputGrace = time.Second

// processManager owns the commands envd started, by pid.
type processManager struct {
	log    *slog.Logger
	reaper *reaper   // nil unless envd reaps orphans
	oom    *oomGuard // nil unless envd guards the guest's memory

	mu    sync.Mutex
	procs map[uint32]*proc
}

func newProcessManager(log *slog.Logger) *processManager {
	return &processManager{log: log, procs: map[uint32]*proc{}}
}

// startSpec is a validated Start request.
type startSpec struct {
	acct      *account
	config    *pb.ProcessConfig
	path      string // resolved executable
	cwd       string
	env       []string
	pty       *pb.PTY_Size // nil: pipes
	stdinOpen bool
	tag       *string
	deadline  time.Time // zero: none
}

// proc is one running command and the streams following it.
type proc struct {
	pid    uint32
	tag    *string
	config *pb.ProcessConfig
	cmd    *exec.Cmd
	tty    *os.File // pty master, nil for pipes

	stdinMu sync.Mutex
	stdin   *os.File // write end of stdin; nil when closed or absent

	exited   chan struct{} // closed once the process has been reaped
	timedOut atomic.Bool

	mu   sync.Mutex
	subs map[*subscriber]struct{}
	end  *pb.ProcessEvent // set once the end event was sent
}

// subscriber is one stream following a process.
type subscriber = queue[*pb.ProcessEvent]

func (p *proc) subscribe() *subscriber {
	sub := newQueue[*pb.ProcessEvent]()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.end != nil {
		sub.push(p.end)
		return sub
	}
	if p.subs == nil {
		p.subs = map[*subscriber]struct{}{}
	}
	p.subs[sub] = struct{}{}
	return sub
}

func (p *proc) unsubscribe(sub *subscriber) {
	p.mu.Lock()
	delete(p.subs, sub)
	p.mu.Unlock()
}

func (p *proc) broadcast(ev *pb.ProcessEvent) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.end != nil {
		return
	}
	for sub := range p.subs {
		sub.push(ev)
	}
	if _, ok := ev.Event.(*pb.ProcessEvent_End); ok {
		p.end = ev
		p.subs = nil
	}
}

// signal sends sig to the command's process group (and the process itself, should it have left
// the group). It fails with ErrNotFound once the process has exited.
func (p *proc) signal(sig syscall.Signal) error {
	select {
	case <-p.exited:
		return errorf(errdefs.ErrNotFound, "process with pid %d not found", p.pid)
	default:
	}
	gerr := syscall.Kill(-int(p.pid), sig)
	perr := syscall.Kill(int(p.pid), sig)
	if gerr != nil && perr != nil {
		if errors.Is(perr, syscall.ESRCH) {
			return errorf(errdefs.ErrNotFound, "process with pid %d not found", p.pid)
		}
		return perr
	}
	return nil
}

func (p *proc) writeInput(data []byte, toPTY bool) error {
	if toPTY || p.tty != nil {
		if p.tty == nil {
			return errorf(errdefs.ErrConflict, "process %d has no pty", p.pid)
		}
		_, err := p.tty.Write(data)
		return err
	}
	p.stdinMu.Lock()
	defer p.stdinMu.Unlock()
	if p.stdin == nil {
		return errorf(errdefs.ErrConflict, "stdin of process %d is closed", p.pid)
	}
	_, err := p.stdin.Write(data)
	return err
}

func (p *proc) closeStdin() error {
	if p.tty != nil {
		return errorf(errdefs.ErrConflict, "process %d uses a pty; send Ctrl+D instead", p.pid)
	}
	p.stdinMu.Lock()
	defer p.stdinMu.Unlock()
	if p.stdin != nil {
		err := p.stdin.Close()
		p.stdin = nil
		return err
	}
	return nil
}

func (p *proc) resize(size *pb.PTY_Size) error {
	if p.tty == nil {
		return errorf(errdefs.ErrConflict, "process %d has no pty", p.pid)
	}
	return pty.Setsize(p.tty, &pty.Winsize{Rows: uint16(size.GetRows()), Cols: uint16(size.GetCols())})
}

func (p *proc) info() *pb.ProcessInfo {
	return &pb.ProcessInfo{Config: proto.Clone(p.config).(*pb.ProcessConfig), Pid: p.pid, Tag: p.tag}
}

// lookPath finds file in the PATH of env, as the command's own shell would.
func lookPath(file string, env []string) (string, error) {
	if strings.Contains(file, "/") {
		return file, nil
	}
	pathVar := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			pathVar = v
		}
	}
	for _, dir := range filepath.SplitList(pathVar) {
		if dir == "" {
			dir = "."
		}
		cand := filepath.Join(dir, file)
		if fi, err := os.Stat(cand); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
			return cand, nil
		}
	}
	return "", errorf(errdefs.ErrInvalid, "executable %q not found in PATH", file)
}

// start launches the command. The returned subscriber already follows it, so no output is lost.
func (m *processManager) start(spec *startSpec) (*proc, *subscriber, error) {
	cmd := &exec.Cmd{
		Path: spec.path,
		Args: append([]string{spec.config.GetCmd()}, spec.config.GetArgs()...),
		Env:  spec.env,
		Dir:  spec.cwd,
		SysProcAttr: &syscall.SysProcAttr{
			Credential: &syscall.Credential{Uid: spec.acct.UID, Gid: spec.acct.GID, Groups: spec.acct.Groups},
		},
	}
	p := &proc{
		tag:    spec.tag,
		config: spec.config,
		cmd:    cmd,
		exited: make(chan struct{}),
	}

	var childEnds, readEnds []*os.File
	closeAll := func(fs []*os.File) {
		for _, f := range fs {
			f.Close()
		}
	}
	type reader struct {
		f    *os.File
		kind int
	}
	var readers []reader
	if spec.pty != nil {
		master, slave, err := pty.Open()
		if err != nil {
			return nil, nil, fmt.Errorf("open pty: %w", err)
		}
		if err := pty.Setsize(master, &pty.Winsize{Rows: uint16(spec.pty.GetRows()), Cols: uint16(spec.pty.GetCols())}); err != nil {
			master.Close()
			slave.Close()
			return nil, nil, fmt.Errorf("set pty size: %w", err)
		}
		_ = slave.Chown(int(spec.acct.UID), int(spec.acct.GID))
		cmd.Stdin, cmd.Stdout, cmd.Stderr = slave, slave, slave
		cmd.SysProcAttr.Setsid = true
		cmd.SysProcAttr.Setctty = true
		cmd.SysProcAttr.Ctty = 0
		p.tty = master
		childEnds = append(childEnds, slave)
		readers = append(readers, reader{master, dataPTY})
	} else {
		cmd.SysProcAttr.Setpgid = true
		for _, kind := range []int{dataStdout, dataStderr} {
			r, w, err := os.Pipe()
			if err != nil {
				closeAll(childEnds)
				closeAll(readEnds)
				return nil, nil, err
			}
			childEnds = append(childEnds, w)
			readEnds = append(readEnds, r)
			readers = append(readers, reader{r, kind})
			if kind == dataStdout {
				cmd.Stdout = w
			} else {
				cmd.Stderr = w
			}
		}
		if spec.stdinOpen {
			r, w, err := os.Pipe()
			if err != nil {
				closeAll(childEnds)
				closeAll(readEnds)
				return nil, nil, err
			}
			childEnds = append(childEnds, r)
			cmd.Stdin = r
			p.stdin = w
		}
	}
	sub := p.subscribe()

	if m.oom != nil {
		m.oom.Wake() // the guard watches again before the process can allocate
	}
	var err error
	if m.reaper != nil {
		err = m.reaper.startTracked(cmd)
	} else {
		err = cmd.Start()
	}
	closeAll(childEnds)
	if err != nil {
		closeAll(readEnds)
		if p.tty != nil {
			p.tty.Close()
		}
		if p.stdin != nil {
			p.stdin.Close()
		}
		return nil, nil, errorf(errdefs.ErrInvalid, "start %s: %v", spec.config.GetCmd(), err)
	}
	p.pid = uint32(cmd.Process.Pid)
	m.mu.Lock()
	m.procs[p.pid] = p
	m.mu.Unlock()

	var outputs sync.WaitGroup
	for _, r := range readers {
		outputs.Add(1)
		go func() {
			defer outputs.Done()
			p.pump(r.f, r.kind)
		}()
	}
	var timer *time.Timer
	if !spec.deadline.IsZero() {
		timer = time.AfterFunc(time.Until(spec.deadline), func() {
			p.timedOut.Store(true)
			_ = p.signal(syscall.SIGKILL)
		})
	}
	go m.wait(p, &outputs, timer)
	return p, sub, nil
}

const (
	dataStdout = iota
	dataStderr
	dataPTY
)

// pump copies one output stream into data events until EOF (or EIO on a pty).
func (p *proc) pump(f *os.File, kind int) {
	if p.tty == nil { // pipes: the pty master is closed by wait
		defer f.Close()
	}
	buf := make([]byte, 32<<10)
	for {
		n, err := f.Read(buf)
		if n > 0 {
			p.broadcast(dataEvent(kind, append([]byte(nil), buf[:n]...)))
		}
		if err != nil {
			return
		}
	}
}

func (m *processManager) wait(p *proc, outputs *sync.WaitGroup, timer *time.Timer) {
	werr := p.cmd.Wait()
	close(p.exited)
	if m.reaper != nil {
		m.reaper.untrack(int(p.pid))
	}
	if timer != nil {
		timer.Stop()
	}
	done := make(chan struct{})
	go func() { outputs.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(outputGrace):
	}
	if p.tty != nil {
		p.tty.Close()
	}
	_ = p.closeStdin()

	end := &pb.ProcessEvent_EndEvent{ExitCode: -1, Status: "unknown"}
	if st := p.cmd.ProcessState; st != nil {
		end.ExitCode = int32(st.ExitCode())
		end.Exited = st.Exited()
		end.Status = st.String()
	}
	if werr != nil {
		msg := werr.Error()
		end.Error = &msg
	}
	m.mu.Lock()
	delete(m.procs, p.pid)
	m.mu.Unlock()
	p.broadcast(&pb.ProcessEvent{Event: &pb.ProcessEvent_End{End: end}})
}

func dataEvent(kind int, b []byte) *pb.ProcessEvent {
	d := &pb.ProcessEvent_DataEvent{}
	switch kind {
	case dataStdout:
		d.Output = &pb.ProcessEvent_DataEvent_Stdout{Stdout: b}
	case dataStderr:
		d.Output = &pb.ProcessEvent_DataEvent_Stderr{Stderr: b}
	default:
		d.Output = &pb.ProcessEvent_DataEvent_Pty{Pty: b}
	}
	return &pb.ProcessEvent{Event: &pb.ProcessEvent_Data{Data: d}}
}

// get finds a running process by pid or tag.
func (m *processManager) get(sel *pb.ProcessSelector) (*proc, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	switch s := sel.GetSelector().(type) {
	case *pb.ProcessSelector_Pid:
		if p, ok := m.procs[s.Pid]; ok {
			return p, nil
		}
		return nil, errorf(errdefs.ErrNotFound, "process with pid %d not found", s.Pid)
	case *pb.ProcessSelector_Tag:
		for _, p := range m.procs {
			if p.tag != nil && *p.tag == s.Tag {
				return p, nil
			}
		}
		return nil, errorf(errdefs.ErrNotFound, "process with tag %q not found", s.Tag)
	default:
		return nil, errorf(errdefs.ErrInvalid, "process selector is empty")
	}
}

func (m *processManager) list() []*pb.ProcessInfo {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]*pb.ProcessInfo, 0, len(m.procs))
	for _, p := range m.procs {
		out = append(out, p.info())
	}
	return out
}

func (m *processManager) killAll() {
	m.mu.Lock()
	ps := slices.Collect(maps.Values(m.procs))
	m.mu.Unlock()
	for _, p := range ps {
		_ = p.signal(syscall.SIGKILL)
	}
}
