package main

import (
	"encoding/json"
	"github.com/ember-sandbox/ember/internal/testutil"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"

	"gvisor.dev/gvisor/pkg/seccomp"
	"gvisor.dev/gvisor/pkg/seccomp/precompiledseccomp"
	"gvisor.dev/gvisor/pkg/sentry/platform"
	bootfilter "gvisor.dev/gvisor/runsc/boot/filter/config"
	goferfilter "gvisor.dev/gvisor/runsc/fsgofer/filter/config"
)

// goferPrograms are gVisor's gofer programs, compiled once for the tests.
var goferPrograms = sync.OnceValues(goferfilter.PrecompiledPrograms)

func TestMain(m *testing.M) {
	if os.Getenv(dumpEnv) != "" { // the child process of childSentryPrograms
		os.Exit(dumpSentry())
	}
	os.Exit(m.Run())
}

// The precompiled sentry program runsc loads must be the program it would otherwise compile at
// start for the same options and run-time values, in another process than the generator's; a
// difference would let through, or kill the sandbox on, a syscall the filters decide otherwise.
// The programs compared here are built by a child process and rendered with this process's
// values (before the pid was made a variable, systrap's rt_tgsigqueueinfo rule kept the child's
// pid and this test failed).
func TestSentryProgramsEqualRunTimeCompilation(t *testing.T) {
	testutil.SkipShort(t, "compiles gVisor's several hundred sentry programs twice (~1 min)")
	platforms := []string{"systrap"}
	own, err := sentryPrograms(platforms)
	if err != nil {
		t.Fatal(err)
	}
	child, err := childSentryPrograms(platforms)
	if err != nil {
		t.Fatal(err)
	}
	progs, err := pidFree(child.Programs, child.PID, own, os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]int{}
	for i, p := range progs {
		byName[p.Name] = i
	}
	ctor, err := platform.Lookup("systrap")
	if err != nil {
		t.Fatal(err)
	}
	infos := ctor.PrecompiledSeccompInfo()
	// What ember runs (netstack, directfs), and host networking, each with directfs on and off.
	for _, hostnet := range []bool{false, true} {
		for _, directfs := range []bool{true, false} {
			opt := bootfilter.Options{Platform: infos[0], HostNetwork: hostnet, HostFilesystem: directfs, ControllerFD: 7}
			i, ok := byName[opt.ConfigKey()]
			if !ok {
				t.Fatalf("no program for %s", opt.ConfigKey())
			}
			got, err := progs[i].RenderInstructions(opt.Vars())
			if err != nil {
				t.Fatal(err)
			}
			rules, deny := bootfilter.Rules(opt)
			p := seccomp.Program{
				RuleSets: []seccomp.RuleSet{{Rules: deny}, {Rules: rules, Action: seccomp.Allow}},
				Options:  bootfilter.SeccompOptions(opt),
			}
			want, _, err := p.Build()
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("hostnet=%v directfs=%v: precompiled program (%d instructions) differs from the compiled one (%d)", hostnet, directfs, len(got), len(want))
			}
		}
	}
}

func TestPidFreeRefusesOtherDifferences(t *testing.T) {
	mk := func(words ...uint32) []precompiledseccomp.Program {
		return []precompiledseccomp.Program{{Name: "p", Bytecode32: words, VarOffsets: map[string][]int{selfPIDLowVar: {0}}}}
	}
	got, err := pidFree(mk(0x13371337, 100, 7), 100, mk(0x13371337, 200, 7), 200)
	if err != nil {
		t.Fatal(err)
	}
	if off := got[0].VarOffsets[selfPIDLowVar]; !reflect.DeepEqual(off, []int{0, 1}) {
		t.Fatalf("self_pid offsets %v, want [0 1]", off)
	}
	if got[0].Bytecode32[1] != 0 {
		t.Fatalf("the pid stayed in the output: %#x", got[0].Bytecode32[1])
	}
	if _, err := pidFree(mk(0x13371337, 100, 7), 100, mk(0x13371337, 200, 8), 200); err == nil {
		t.Fatal("a difference other than the pid was accepted")
	}
}

func TestGoferProgramsEqualRunTimeCompilation(t *testing.T) {
	progs, err := goferPrograms()
	if err != nil {
		t.Fatal(err)
	}
	for _, directfs := range []bool{true, false} {
		opt := goferfilter.Options{DirectFS: directfs}
		var found bool
		for _, p := range progs {
			if p.Name != opt.ConfigKey() {
				continue
			}
			found = true
			got, err := p.RenderInstructions(opt.Vars())
			if err != nil {
				t.Fatal(err)
			}
			rules, deny := goferfilter.Rules(opt)
			prog := seccomp.Program{
				RuleSets: []seccomp.RuleSet{{Rules: deny}, {Rules: rules, Action: seccomp.Allow}},
				Options:  seccomp.ProgramOptions{}, // as runsc/fsgofer/filter.Install
			}
			want, _, err := prog.Build()
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("directfs=%v: precompiled gofer program differs from the compiled one", directfs)
			}
		}
		if !found {
			t.Fatalf("no gofer program for %s", opt.ConfigKey())
		}
	}
}

func TestRefusesAnotherGvisorVersion(t *testing.T) {
	_, err := run(t.TempDir(), "v0.0.0-20200101000000-000000000000", t.TempDir(), []string{"systrap"})
	if err == nil || !strings.Contains(err.Error(), "RUNSC_VERSION") {
		t.Fatalf("got %v, want a version mismatch", err)
	}
}

func TestRefusesUnexpectedStub(t *testing.T) {
	p := filepath.Join(t.TempDir(), "filter_precompiled.go")
	if err := os.WriteFile(p, []byte("package other\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := checkStub(p); err == nil {
		t.Fatal("a file without the stub's registration function was accepted")
	}
}

func TestSourceIsDeterministic(t *testing.T) {
	progs, err := goferPrograms()
	if err != nil {
		t.Fatal(err)
	}
	a, err := source(progs)
	if err != nil {
		t.Fatal(err)
	}
	rev := append([]precompiledseccomp.Program(nil), progs...)
	for i, j := 0, len(rev)-1; i < j; i, j = i+1, j-1 {
		rev[i], rev[j] = rev[j], rev[i]
	}
	b, err := source(rev)
	if err != nil {
		t.Fatal(err)
	}
	if string(a) != string(b) {
		t.Fatal("generated source depends on the programs' order")
	}
	if !strings.Contains(string(a), "const PrecompilationDisabledAtBuildTime = false") {
		t.Fatal("generated source does not enable precompiled programs")
	}
}

// -add puts files of ember's own into the overlay next to the generated ones, and never lets one
// replace a file of the module.
func TestAddToOverlay(t *testing.T) {
	mod, out := t.TempDir(), t.TempDir()
	if err := os.MkdirAll(filepath.Join(mod, "runsc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(mod, "runsc", "main.go"), []byte("package main\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ours := filepath.Join(t.TempDir(), "ember_memory.go")
	if err := os.WriteFile(ours, []byte("package main\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	gen := map[string]string{filepath.Join(mod, "runsc/boot/filter/filter_precompiled.go"): filepath.Join(out, "boot_filter_precompiled.go")}
	js, _ := json.Marshal(struct{ Replace map[string]string }{gen})
	if err := os.WriteFile(filepath.Join(out, "overlay.json"), js, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"runsc/main.go=" + ours, "../x.go=" + ours, "/abs.go=" + ours, "runsc/x.go", "runsc/x.go=" + ours + ".missing"} {
		if err := addToOverlay(mod, out, []string{bad}); err == nil {
			t.Errorf("-add %q accepted", bad)
		}
	}
	if err := addToOverlay(mod, out, []string{"runsc/ember_memory.go=" + ours}); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(out, "overlay.json"))
	if err != nil {
		t.Fatal(err)
	}
	var got struct{ Replace map[string]string }
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	gen[filepath.Join(mod, "runsc/ember_memory.go")] = ours
	if !reflect.DeepEqual(got.Replace, gen) {
		t.Fatalf("overlay %v, want %v", got.Replace, gen)
	}
}
