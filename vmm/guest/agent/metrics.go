package main

import (
	"bufio"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Metrics is one sample of the guest's use of its resources (E2B's
// SandboxMetric): CPU since the previous sample, memory and root disk now.
type Metrics struct {
	CPUCount   int     `json:"cpu_count"`
	CPUUsedPct float64 `json:"cpu_used_pct"`
	MemTotal   uint64  `json:"mem_total"`
	MemUsed    uint64  `json:"mem_used"`
	MemCache   uint64  `json:"mem_cache"`
	DiskTotal  uint64  `json:"disk_total"`
	DiskUsed   uint64  `json:"disk_used"`
}

// cpuMeter remembers the previous /proc/stat reading, so each sample covers
// the time since the last one (the first covers a short wait).
type cpuMeter struct {
	mu          sync.Mutex
	busy, total uint64
}

func (m *cpuMeter) sample() float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	busy, total := cpuTimes()
	if m.total == 0 {
		time.Sleep(100 * time.Millisecond)
		m.busy, m.total = busy, total
		busy, total = cpuTimes()
	}
	pct := 0.0
	if total > m.total {
		pct = float64(busy-m.busy) / float64(total-m.total) * 100
	}
	m.busy, m.total = busy, total
	return pct
}

func cpuTimes() (busy, total uint64) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line := strings.SplitN(string(data), "\n", 2)[0]
	for i, f := range strings.Fields(line)[1:] {
		v, _ := strconv.ParseUint(f, 10, 64)
		total += v
		if i != 3 && i != 4 { // idle, iowait
			busy += v
		}
	}
	return busy, total
}

func (m *cpuMeter) metrics() *Metrics {
	out := &Metrics{CPUCount: runtime.NumCPU(), CPUUsedPct: m.sample()}
	if f, err := os.Open("/proc/meminfo"); err == nil {
		info := map[string]uint64{}
		s := bufio.NewScanner(f)
		for s.Scan() {
			fields := strings.Fields(s.Text())
			if len(fields) >= 2 {
				v, _ := strconv.ParseUint(fields[1], 10, 64)
				info[strings.TrimSuffix(fields[0], ":")] = v * 1024
			}
		}
		f.Close()
		out.MemTotal, out.MemCache = info["MemTotal"], info["Cached"]
		out.MemUsed = info["MemTotal"] - info["MemAvailable"]
	}
	var st syscall.Statfs_t
	if syscall.Statfs("/", &st) == nil {
		out.DiskTotal = st.Blocks * uint64(st.Bsize)
		out.DiskUsed = (st.Blocks - st.Bfree) * uint64(st.Bsize)
	}
	return out
}
