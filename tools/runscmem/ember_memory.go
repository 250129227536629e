//go:build ember_runsc

// This file is ember's addition to runsc's package main (gvisor.dev/gvisor/runsc), compiled into
// runsc by scripts/setup.sh with `go build -overlay` and the build tag ember_runsc; ember's own
// build never compiles it (issue 11, lever 8).
//
// runsc starts the sentry ("runsc boot") and the gofer ("runsc gofer") with environments of its
// own making (the sentry's is empty), so GOGC and GOMEMLIMIT cannot reach them, and runsc has no
// flag for their Go GC. At process start, before runsc's main, this reads the OCI spec
// annotations of the bundle the process serves:
//
//	dev.ember.sentry.gc-percent, dev.ember.gofer.gc-percent      debug.SetGCPercent
//	dev.ember.sentry.memory-limit, dev.ember.gofer.memory-limit  debug.SetMemoryLimit (bytes)
//
// and logs what it applied to the process's runsc log (--log-fd), e.g.
// "ember: sentry gc-percent 25 (was 100)". Other runsc commands and absent annotations are left
// as they are; a malformed value is logged and ignored.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// annotationPrefix + kind + "." + setting names an annotation.
const annotationPrefix = "dev.ember."

func init() {
	kind, bundle, logFD := processOf(os.Args[1:])
	if kind == "" || bundle == "" {
		return
	}
	b, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		return
	}
	var spec struct {
		Annotations map[string]string `json:"annotations"`
	}
	if json.Unmarshal(b, &spec) != nil {
		return
	}
	for _, msg := range applyGC(kind, spec.Annotations, debug.SetGCPercent, debug.SetMemoryLimit) {
		if logFD >= 0 {
			line := fmt.Sprintf("I%s %7d ember_memory.go] ember: %s\n", time.Now().Format("0102 15:04:05.000000"), os.Getpid(), msg)
			syscall.Write(logFD, []byte(line))
		}
	}
}

// processOf reads runsc's command line (without argv[0]): kind is "sentry" for `boot`, "gofer"
// for `gofer`, "" for any other command; bundle is the command's --bundle; logFD its global
// --log-fd (-1 if none).
func processOf(args []string) (kind, bundle string, logFD int) {
	logFD = -1
	i := 0
	for ; i < len(args) && strings.HasPrefix(args[i], "-"); i++ {
		if v, ok := strings.CutPrefix(strings.TrimLeft(args[i], "-"), "log-fd="); ok {
			if n, err := strconv.Atoi(v); err == nil {
				logFD = n
			}
		}
	}
	if i == len(args) {
		return "", "", logFD
	}
	switch args[i] {
	case "boot":
		kind = "sentry"
	case "gofer":
		kind = "gofer"
	default:
		return "", "", logFD
	}
	for j := i + 1; j < len(args); j++ {
		a := strings.TrimLeft(args[j], "-")
		if v, ok := strings.CutPrefix(a, "bundle="); ok && strings.HasPrefix(args[j], "-") {
			bundle = v
		} else if a == "bundle" && strings.HasPrefix(args[j], "-") && j+1 < len(args) {
			bundle = args[j+1]
		}
	}
	return kind, bundle, logFD
}

// applyGC applies kind's annotations with the setters given and describes what it did.
func applyGC(kind string, ann map[string]string, setPercent func(int) int, setLimit func(int64) int64) []string {
	var msgs []string
	if v, ok := ann[annotationPrefix+kind+".gc-percent"]; ok {
		if n, err := strconv.Atoi(v); err != nil || n < -1 {
			msgs = append(msgs, fmt.Sprintf("%s gc-percent %q ignored: not a percent (or -1 for off)", kind, v))
		} else {
			msgs = append(msgs, fmt.Sprintf("%s gc-percent %d (was %d)", kind, n, setPercent(n)))
		}
	}
	if v, ok := ann[annotationPrefix+kind+".memory-limit"]; ok {
		if n, err := strconv.ParseInt(v, 10, 64); err != nil || n <= 0 {
			msgs = append(msgs, fmt.Sprintf("%s memory-limit %q ignored: not a positive number of bytes", kind, v))
		} else {
			msgs = append(msgs, fmt.Sprintf("%s memory-limit %d bytes (was %d)", kind, n, setLimit(n)))
		}
	}
	return msgs
}
