// Command seccompgen precompiles runsc's seccomp-bpf programs for the configurations ember runs,
// so that a runsc built from the Go module loads them instead of compiling its filters at every
// start and again inside every restore.
//
// gVisor's Bazel build embeds precompiled programs by generating the filter_precompiled.go files
// of runsc/boot/filter (the sentry) and runsc/fsgofer/filter (the gofer); `go install` of the
// module gets stubs that register none. seccompgen writes replacements for those two files from
// gVisor's exported API (config.PrecompiledPrograms, config.Options.ConfigKey) and an overlay.json
// for `go build -overlay` that puts them in place of the stubs. It must be built with the GOARCH,
// build tags and CGO_ENABLED=0 of the runsc it feeds, and linked against the gvisor.dev/gvisor
// version runsc is built from (checked against -gvisor-version): program keys and bytecode come
// from the code linked in. scripts/setup.sh runs it on a copy of the module's source (the go
// command refuses overlays of files in the module cache). A configuration left out still works: runsc then
// compiles its filters at start and logs "No precompiled program found".
//
// Usage: seccompgen -gvisor-dir SRC -gvisor-version VERSION -out DIR
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"go/format"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"sort"
	"strings"

	"gvisor.dev/gvisor/pkg/seccomp/precompiledseccomp"
	"gvisor.dev/gvisor/pkg/sentry/platform"
	bootfilter "gvisor.dev/gvisor/runsc/boot/filter/config"
	goferfilter "gvisor.dev/gvisor/runsc/fsgofer/filter/config"

	// The platforms whose filters can be precompiled register themselves.
	_ "gvisor.dev/gvisor/pkg/sentry/platform/platforms"
)

const gvisorModule = "gvisor.dev/gvisor"

// The stubs replaced, relative to the module directory, and the files written in their place.
var targets = []struct{ stub, out string }{
	{"runsc/boot/filter/filter_precompiled.go", "boot_filter_precompiled.go"},
	{"runsc/fsgofer/filter/filter_precompiled.go", "fsgofer_filter_precompiled.go"},
}

func main() {
	if os.Getenv(dumpEnv) != "" {
		os.Exit(dumpSentry())
	}
	gvisorDir := flag.String("gvisor-dir", "", "source of the gvisor.dev/gvisor module runsc is built from (outside the module cache)")
	version := flag.String("gvisor-version", "", "version of that module (must be the one this binary links)")
	outDir := flag.String("out", "", "directory for the generated files and overlay.json")
	platforms := flag.String("platforms", "systrap", "comma-separated sentry platforms to precompile")
	var adds addFlag
	flag.Var(&adds, "add", "REL=FILE: the overlay also adds FILE to the module as REL (a path inside it that must not exist); repeatable")
	flag.Parse()
	if *gvisorDir == "" || *version == "" || *outDir == "" || flag.NArg() != 0 {
		flag.Usage()
		os.Exit(2)
	}
	n, err := run(*gvisorDir, *version, *outDir, strings.Split(*platforms, ","))
	if err == nil {
		err = addToOverlay(*gvisorDir, *outDir, adds)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "seccompgen:", err)
		os.Exit(1)
	}
	fmt.Printf("seccompgen: %d sentry and %d gofer programs; overlay %s\n", n[0], n[1], filepath.Join(*outDir, "overlay.json"))
}

// run generates both files and the overlay; it returns the number of programs in each file.
func run(gvisorDir, version, outDir string, platforms []string) ([2]int, error) {
	var n [2]int
	gvisorDir, err := filepath.Abs(gvisorDir)
	if err != nil {
		return n, err
	}
	if err := checkVersion(version); err != nil {
		return n, err
	}
	sentry, err := pidFreeSentryPrograms(platforms)
	if err != nil {
		return n, err
	}
	gofer, err := goferfilter.PrecompiledPrograms()
	if err != nil {
		return n, fmt.Errorf("gofer programs: %w", err)
	}
	n = [2]int{len(sentry), len(gofer)}
	if err := os.MkdirAll(outDir, 0o755); err != nil {
		return n, err
	}
	outDir, err = filepath.Abs(outDir)
	if err != nil {
		return n, err
	}
	overlay := map[string]string{}
	for i, progs := range [][]precompiledseccomp.Program{sentry, gofer} {
		t := targets[i]
		stub := filepath.Join(gvisorDir, t.stub)
		if err := checkStub(stub); err != nil {
			return n, err
		}
		src, err := source(progs)
		if err != nil {
			return n, fmt.Errorf("%s: %w", t.out, err)
		}
		out := filepath.Join(outDir, t.out)
		if err := os.WriteFile(out, src, 0o644); err != nil {
			return n, err
		}
		overlay[stub] = out
	}
	js, err := json.MarshalIndent(struct{ Replace map[string]string }{overlay}, "", "\t")
	if err != nil {
		return n, err
	}
	return n, os.WriteFile(filepath.Join(outDir, "overlay.json"), append(js, '\n'), 0o644)
}

// addFlag collects the -add flags.
type addFlag []string

func (a *addFlag) String() string     { return strings.Join(*a, ",") }
func (a *addFlag) Set(v string) error { *a = append(*a, v); return nil }

// addToOverlay adds files of ember's own to the overlay.json in outDir: each of adds is REL=FILE,
// FILE compiled into the module at gvisorDir as REL (e.g. a new file of runsc's package main).
// REL must not exist in the module: the overlay adds files, it never replaces gVisor's.
func addToOverlay(gvisorDir, outDir string, adds []string) error {
	if len(adds) == 0 {
		return nil
	}
	gvisorDir, err := filepath.Abs(gvisorDir)
	if err != nil {
		return err
	}
	path := filepath.Join(outDir, "overlay.json")
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var ov struct{ Replace map[string]string }
	if err := json.Unmarshal(b, &ov); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	for _, a := range adds {
		rel, file, ok := strings.Cut(a, "=")
		if !ok || rel == "" || file == "" || filepath.IsAbs(rel) || strings.HasPrefix(filepath.Clean(rel), "..") {
			return fmt.Errorf("-add %q: want REL=FILE with REL relative to the module", a)
		}
		dst := filepath.Join(gvisorDir, rel)
		if _, err := os.Stat(dst); err == nil {
			return fmt.Errorf("-add %q: %s exists in the module (the overlay only adds files)", a, rel)
		}
		src, err := filepath.Abs(file)
		if err != nil {
			return err
		}
		if _, err := os.Stat(src); err != nil {
			return fmt.Errorf("-add %q: %w", a, err)
		}
		ov.Replace[dst] = src
	}
	js, err := json.MarshalIndent(ov, "", "\t")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(js, '\n'), 0o644)
}

// checkVersion fails unless this binary links gvisor.dev/gvisor at version.
func checkVersion(version string) error {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return fmt.Errorf("no build information in this binary")
	}
	linked := ""
	for _, m := range bi.Deps {
		if m.Path == gvisorModule {
			linked = m.Version
			if m.Replace != nil {
				linked = m.Replace.Version
			}
		}
	}
	if linked != version {
		return fmt.Errorf("linked with %s %q, not %q: set go.mod's requirement to scripts/versions.env's RUNSC_VERSION", gvisorModule, linked, version)
	}
	return nil
}

// checkStub fails unless path is the stub the generated file replaces (same package and
// registration function), so that a moved or renamed upstream file is noticed here rather than
// as a build with no precompiled programs.
func checkStub(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	for _, want := range []string{"\npackage filter\n", "\nfunc registerPrograms() {\n", "PrecompilationDisabledAtBuildTime"} {
		if !bytes.Contains(b, []byte(want)) {
			return fmt.Errorf("%s: not the expected stub (no %q)", path, strings.TrimSpace(want))
		}
	}
	return nil
}

// sentryPrograms returns the sentry programs for the given platforms, with netstack or host
// networking and with directfs on or off; without GPU, TPU or RDMA proxies or profiling (ember
// uses none), which gVisor's full set multiplies into several hundred programs.
func sentryPrograms(platforms []string) ([]precompiledseccomp.Program, error) {
	want := map[string]bool{}
	for _, name := range platforms {
		ctor, err := platform.Lookup(strings.TrimSpace(name))
		if err != nil {
			return nil, fmt.Errorf("platform %q: %w", name, err)
		}
		for _, info := range ctor.PrecompiledSeccompInfo() {
			for _, net := range [][2]bool{{false, false}, {true, false}, {true, true}} {
				for _, directfs := range []bool{true, false} {
					opt := bootfilter.Options{Platform: info, HostNetwork: net[0], HostNetworkRawSockets: net[1], HostFilesystem: directfs}
					want[opt.ConfigKey()] = true
				}
			}
		}
	}
	all, err := bootfilter.PrecompiledPrograms()
	if err != nil {
		return nil, fmt.Errorf("sentry programs: %w", err)
	}
	var progs []precompiledseccomp.Program
	for _, p := range all {
		if want[p.Name] {
			progs = append(progs, p)
			delete(want, p.Name)
		}
	}
	if len(want) > 0 {
		var missing []string
		for k := range want {
			missing = append(missing, k)
		}
		sort.Strings(missing)
		return nil, fmt.Errorf("gVisor precompiles no program for %q", missing)
	}
	return progs, nil
}

// source renders package filter's replacement stub registering progs, sorted by name so that
// the output depends on the programs only.
func source(progs []precompiledseccomp.Program) ([]byte, error) {
	progs = append([]precompiledseccomp.Program(nil), progs...)
	sort.Slice(progs, func(i, j int) bool { return progs[i].Name < progs[j].Name })
	var b bytes.Buffer
	b.WriteString(`// Code generated by ember's tools/seccompgen. DO NOT EDIT.

package filter

import (
	"sort"

	"gvisor.dev/gvisor/pkg/seccomp/precompiledseccomp"
	"gvisor.dev/gvisor/pkg/sync"
)

// PrecompilationDisabledAtBuildTime is false: this build registers precompiled programs.
const PrecompilationDisabledAtBuildTime = false

var (
	precompiledPrograms             map[string]precompiledseccomp.Program
	registerPrecompiledProgramsOnce sync.Once
)

// GetPrecompiled returns the precompiled program with the given name, if any.
func GetPrecompiled(programName string) (precompiledseccomp.Program, bool) {
	registerPrecompiledProgramsOnce.Do(registerPrograms)
	p, ok := precompiledPrograms[programName]
	return p, ok
}

// ListPrecompiled returns the names of the precompiled programs, sorted.
func ListPrecompiled() []string {
	registerPrecompiledProgramsOnce.Do(registerPrograms)
	names := make([]string, 0, len(precompiledPrograms))
	for name := range precompiledPrograms {
		names = append(names, name)
	}
	sort.Strings(names)
	return names
}

func registerPrograms() {
	programs := make(map[string]precompiledseccomp.Program)
`)
	for _, p := range progs {
		b.WriteString(p.Registration("\t", "precompiledseccomp", "programs"))
	}
	b.WriteString("\tprecompiledPrograms = programs\n}\n")
	return format.Source(b.Bytes())
}

// The sentry's rules are not all written in terms of variables: systrap allows
// rt_tgsigqueueinfo only to the sentry's own pid, taken from os.Getpid() while the rules are
// built (pkg/sentry/platform/systrap/filters.go). A program precompiled as gVisor does it would
// hold the generator's pid there, and a sentry using that syscall would be killed by its own
// filter. So the sentry programs are built twice, here and in a child process (another pid),
// and the words that differ, each this process's pid in one and the child's in the other, are
// declared as the low 32 bits of gVisor's self_pid variable, which runsc renders with the
// sentry's pid (its high 32 bits are 0 for every pid).

const (
	dumpEnv       = "EMBER_SECCOMPGEN_DUMP_SENTRY" // set: print the sentry programs as JSON and exit
	selfPIDLowVar = "self_pid_low32bits"           // runsc/boot/filter/config's self_pid, low half
)

// dump is what the child process prints.
type dump struct {
	PID       int
	Platforms []string
	Programs  []precompiledseccomp.Program
}

// dumpSentry is the child's side: the platforms come in the environment variable.
func dumpSentry() int {
	platforms := strings.Split(os.Getenv(dumpEnv), ",")
	progs, err := sentryPrograms(platforms)
	if err != nil {
		fmt.Fprintln(os.Stderr, "seccompgen (child):", err)
		return 1
	}
	if err := json.NewEncoder(os.Stdout).Encode(dump{PID: os.Getpid(), Platforms: platforms, Programs: progs}); err != nil {
		fmt.Fprintln(os.Stderr, "seccompgen (child):", err)
		return 1
	}
	return 0
}

// childSentryPrograms runs this binary again to build the sentry programs under another pid.
func childSentryPrograms(platforms []string) (dump, error) {
	self, err := os.Executable()
	if err != nil {
		return dump{}, err
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), dumpEnv+"="+strings.Join(platforms, ","))
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return dump{}, fmt.Errorf("sentry programs in a child process: %w", err)
	}
	var d dump
	if err := json.Unmarshal(out, &d); err != nil {
		return dump{}, fmt.Errorf("sentry programs in a child process: %w", err)
	}
	return d, nil
}

// pidFreeSentryPrograms returns sentryPrograms with the pid written into them turned into the
// self_pid variable.
func pidFreeSentryPrograms(platforms []string) ([]precompiledseccomp.Program, error) {
	own, err := sentryPrograms(platforms)
	if err != nil {
		return nil, err
	}
	child, err := childSentryPrograms(platforms)
	if err != nil {
		return nil, err
	}
	return pidFree(own, os.Getpid(), child.Programs, child.PID)
}

// pidFree returns a copy of progs (built by process pid) in which every word that differs from
// other (the same programs built by otherPID) is an offset of self_pid's low 32 bits. Any other
// difference is an error: then the programs depend on the process in a way not understood here.
func pidFree(progs []precompiledseccomp.Program, pid int, other []precompiledseccomp.Program, otherPID int) ([]precompiledseccomp.Program, error) {
	if pid == otherPID {
		return nil, fmt.Errorf("both builds ran as pid %d", pid)
	}
	byName := map[string]precompiledseccomp.Program{}
	for _, p := range other {
		byName[p.Name] = p
	}
	out := make([]precompiledseccomp.Program, 0, len(progs))
	for _, p := range progs {
		o, ok := byName[p.Name]
		if !ok {
			return nil, fmt.Errorf("%s: built in one process only", p.Name)
		}
		if len(o.Bytecode32) != len(p.Bytecode32) {
			return nil, fmt.Errorf("%s: %d words under pid %d, %d under pid %d", p.Name, len(p.Bytecode32), pid, len(o.Bytecode32), otherPID)
		}
		if _, ok := p.VarOffsets[selfPIDLowVar]; !ok {
			return nil, fmt.Errorf("%s: no variable %s", p.Name, selfPIDLowVar)
		}
		q := precompiledseccomp.Program{Name: p.Name, Bytecode32: append([]uint32(nil), p.Bytecode32...), VarOffsets: map[string][]int{}}
		for k, v := range p.VarOffsets {
			q.VarOffsets[k] = append([]int(nil), v...)
		}
		for i, w := range p.Bytecode32 {
			if w == o.Bytecode32[i] {
				continue
			}
			if w != uint32(pid) || o.Bytecode32[i] != uint32(otherPID) {
				return nil, fmt.Errorf("%s: word %d is %#x under pid %d and %#x under pid %d", p.Name, i, w, pid, o.Bytecode32[i], otherPID)
			}
			q.Bytecode32[i] = 0 // rendered at run time; 0 keeps the output independent of the pid
			q.VarOffsets[selfPIDLowVar] = append(q.VarOffsets[selfPIDLowVar], i)
		}
		sort.Ints(q.VarOffsets[selfPIDLowVar])
		out = append(out, q)
	}
	return out, nil
}
