package cluster

import (
	"os"
	"runtime"
	"strings"
)

// CPUClass names the CPU feature level of this host (x86-64-v1..v4 from /proc/cpuinfo's
// flags; the architecture elsewhere). gVisor checkpoints restore only where the features the
// checkpointing host offered exist, so placement of a restore compares classes.
func CPUClass() string {
	if runtime.GOARCH != "amd64" {
		return runtime.GOARCH
	}
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "x86-64"
	}
	flags := map[string]bool{}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "flags"); ok {
			_, v, _ = strings.Cut(v, ":")
			for _, f := range strings.Fields(v) {
				flags[f] = true
			}
			break
		}
	}
	all := func(fs ...string) bool {
		for _, f := range fs {
			if !flags[f] {
				return false
			}
		}
		return true
	}
	switch {
	case all("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "bmi2", "fma", "movbe"):
		return "x86-64-v4"
	case all("avx2", "avx", "bmi1", "bmi2", "fma", "movbe", "xsave"):
		return "x86-64-v3"
	case all("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"):
		return "x86-64-v2"
	}
	return "x86-64-v1"
}
