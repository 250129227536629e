package envd

import (
	"bufio"
	"encoding/json"
	"math"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Metrics is the body of GET /metrics.
type Metrics struct {
	Timestamp   int64   `json:"ts"`
	CPUCount    int     `json:"cpu_count"`
	CPUUsedPct  float64 `json:"cpu_used_pct"`
	MemTotal    uint64  `json:"mem_total"`
	MemUsed     uint64  `json:"mem_used"`
	MemCache    uint64  `json:"mem_cache"`
	DiskUsed    uint64  `json:"disk_used"`
	DiskTotal   uint64  `json:"disk_total"`
	MemTotalMiB uint64  `json:"mem_total_mib"`
	MemUsedMiB  uint64  `json:"mem_used_mib"`
}

func (s *Server) getEnvs(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, s.EnvVars())
}

func (s *Server) postInit(w http.ResponseWriter, r *http.Request) {
	var req InitRequest
	if r.ContentLength != 0 {
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			writeJSONError(w, http.StatusBadRequest, "invalid init body: "+err.Error())
			return
		}
	}
	s.Init(req)
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) getMetrics(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, s.Metrics())
}

// Metrics samples CPU, memory (/proc) and the root filesystem (statfs).
func (s *Server) Metrics() Metrics {
	m := Metrics{Timestamp: time.Now().Unix(), CPUCount: runtime.NumCPU()}
	m.CPUUsedPct = s.cpu.percent()
	if mi, err := readMeminfo(); err == nil {
		m.MemTotal = mi["MemTotal"]
		avail, ok := mi["MemAvailable"]
		if !ok {
			avail = mi["MemFree"] + mi["Buffers"] + mi["Cached"]
		}
		if avail <= m.MemTotal {
			m.MemUsed = m.MemTotal - avail
		}
		m.MemCache = mi["Cached"] + mi["Buffers"]
		m.MemTotalMiB = m.MemTotal >> 20
		m.MemUsedMiB = m.MemUsed >> 20
	}
	var st unix.Statfs_t
	if err := unix.Statfs("/", &st); err == nil {
		bs := uint64(st.Bsize)
		m.DiskTotal = st.Blocks * bs
		m.DiskUsed = (st.Blocks - st.Bfree) * bs
	}
	return m
}

// readMeminfo returns /proc/meminfo in bytes.
func readMeminfo() (map[string]uint64, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]uint64{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		fields := strings.Fields(v)
		if len(fields) == 0 {
			continue
		}
		n, err := strconv.ParseUint(fields[0], 10, 64)
		if err != nil {
			continue
		}
		if len(fields) > 1 && fields[1] == "kB" {
			n *= 1024
		}
		out[k] = n
	}
	return out, sc.Err()
}

// cpuSampler computes CPU use between successive calls (the first call samples 100 ms).
type cpuSampler struct {
	mu          sync.Mutex
	busy, total uint64
}

func readCPUStat() (busy, total uint64, ok bool) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, false
	}
	line, _, _ := strings.Cut(string(b), "\n")
	fields := strings.Fields(line)
	if len(fields) < 5 || fields[0] != "cpu" {
		return 0, 0, false
	}
	var vals []uint64
	for _, f := range fields[1:] {
		v, _ := strconv.ParseUint(f, 10, 64)
		vals = append(vals, v)
	}
	for i, v := range vals {
		if i >= 8 { // guest time is already counted in user time
			break
		}
		total += v
		if i != 3 && i != 4 { // idle, iowait
			busy += v
		}
	}
	return busy, total, true
}

func (c *cpuSampler) percent() float64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	busy, total, ok := readCPUStat()
	if !ok {
		return 0
	}
	if c.total == 0 {
		time.Sleep(100 * time.Millisecond)
		c.busy, c.total = busy, total
		if busy, total, ok = readCPUStat(); !ok {
			return 0
		}
	}
	db, dt := float64(busy-c.busy), float64(total-c.total)
	c.busy, c.total = busy, total
	if dt <= 0 || busy < c.busy {
		return 0
	}
	return math.Round(db/dt*10000) / 100
}
