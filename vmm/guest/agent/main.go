// strata-agent is the guest end of the Strata host<->guest protocol
// (vmm/guest/README.md): JSON lines over one virtio-serial port (or a serial
// tty), many requests in flight at once. Processes it starts outlive the
// host's connection: their output is kept in a bounded ring with offsets, so
// a host that reconnects (after a pause, a snapshot restore or a fork)
// re-attaches from the last offset it saw and loses or repeats nothing.
//
// It is a static Go binary (stdlib only) so it runs in any root filesystem:
// the initramfs starts it, chrooted into the real root, before switch_root.
package main

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"
)

const (
	version      = "strata-agent 3" // 3: reseed
	maxLine      = 8 << 20          // a request line longer than this is dropped
	portName     = "strata.agent"
	outboxLength = 64 // replies queued for the port before senders wait
)

// Agent holds everything one agent process serves.
type Agent struct {
	boot    string
	ctl     chan []byte // replies to one-shot requests: written first, never behind stream data
	out     chan []byte // stream replies (output, file blocks, events), in order per stream
	procs   *Procs
	files   *Files
	cpu     cpuMeter
	mu      sync.Mutex
	session string
	streams map[uint64]chan struct{} // open streams by request id: closed to cancel
}

func main() {
	root, port := "", ""
	for i := 1; i < len(os.Args); i++ {
		switch os.Args[i] {
		case "--chroot":
			i++
			root = os.Args[i]
		case "--port":
			i++
			port = os.Args[i]
		}
	}
	log := func(format string, a ...any) {
		fmt.Fprintf(os.Stderr, "strata-agent: "+format+"\n", a...)
	}
	if root != "" { // enter the real root first: its /dev, /sys, /proc are the live ones
		if err := syscall.Chroot(root); err != nil {
			log("chroot %s: %v", root, err)
			os.Exit(1)
		}
		_ = os.Chdir("/")
	}
	if port == "" {
		port = waitPort(log) // sysfs is up once the port shows
		if root != "" {
			if did := growRoot("vda"); did != "" {
				log("%s", did)
			}
		}
	}
	f, err := os.OpenFile(port, os.O_RDWR, 0)
	if err != nil {
		log("open %s: %v", port, err)
		os.Exit(1)
	}
	if strings.HasPrefix(filepath.Base(port), "tty") || strings.HasPrefix(port, "/dev/pts/") {
		makeRaw(int(f.Fd()))
	}
	log("listening on %s", port)
	a := &Agent{boot: bootToken(), out: make(chan []byte, outboxLength), ctl: make(chan []byte, 256),
		streams: map[uint64]chan struct{}{}}
	a.procs = newProcs()
	a.files = newFiles()
	go a.writer(f)
	a.reader(f)
}

// bootToken names this agent process's run: the kernel's boot id, the
// start time and pid, hashed. Not crypto/rand: that blocks until the
// kernel's random pool is ready, a second into a TCG guest's boot, and
// nothing here needs a secret, only a value no other run shares.
func bootToken() string {
	id, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
	sum := sha256.Sum256([]byte(fmt.Sprintf("%s %d %d", id, time.Now().UnixNano(), os.Getpid())))
	return hex.EncodeToString(sum[:8])
}

// waitPort finds the agent's port: `strata.agent=DEV` on the kernel command
// line, else the virtio port named strata.agent (devtmpfs has no
// /dev/virtio-ports links, so through sysfs).
func waitPort(log func(string, ...any)) string {
	for i := 0; ; i++ {
		if cmdline, err := os.ReadFile("/proc/cmdline"); err == nil {
			for _, w := range strings.Fields(string(cmdline)) {
				if strings.HasPrefix(w, portName+"=") {
					return strings.TrimPrefix(w, portName+"=")
				}
			}
		}
		if dev := virtioPort(portName); dev != "" {
			return dev
		}
		if i == 50 {
			classes, _ := filepath.Glob("/sys/class/*")
			names, _ := filepath.Glob("/sys/class/virtio-ports/*/name")
			log("no port %s yet (sysfs classes: %d, ports: %v)", portName, len(classes), names)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// virtioPort is the device of the virtio port called name, "" if none
// shows yet (devtmpfs has no /dev/virtio-ports links: through sysfs).
func virtioPort(name string) string {
	names, _ := filepath.Glob("/sys/class/virtio-ports/*/name")
	for _, n := range names {
		if data, err := os.ReadFile(n); err == nil && strings.TrimSpace(string(data)) == name {
			return "/dev/" + filepath.Base(filepath.Dir(n))
		}
	}
	return ""
}

// writer sends control replies before stream data, so a hello is answered
// at once even while a stream's output fills the port.
func (a *Agent) writer(w io.Writer) {
	for {
		var line []byte
		select {
		case line = <-a.ctl:
		default:
			select {
			case line = <-a.ctl:
			case line = <-a.out:
			}
		}
		if _, err := w.Write(line); err != nil {
			time.Sleep(50 * time.Millisecond) // host gone: the line is lost, as the protocol allows
		}
	}
}

// encode makes a reply's line; its Data, if any, follows raw (no base64
// for an emulated CPU to spend time on).
func encode(r *Reply) []byte {
	payload := r.Data
	if len(payload) > 0 {
		copied := *r
		copied.Data, copied.Raw = nil, len(payload)
		r = &copied
	}
	line, err := json.Marshal(r)
	if err != nil {
		line, _ = json.Marshal(&Reply{ID: r.ID, End: true, Code: "internal", Error: err.Error()})
		payload = nil
	}
	return append(append(line, '\n'), payload...)
}

// send queues the reply to a one-shot request.
func (a *Agent) send(r *Reply) { a.ctl <- encode(r) }

// sendStream queues a stream's reply; it waits while the port is slower
// than the stream (back-pressure), never the reader.
func (a *Agent) sendStream(r *Reply) { a.out <- encode(r) }

func (a *Agent) sendError(id uint64, err error) {
	code := "internal"
	var ce *codedError
	switch {
	case errors.As(err, &ce):
		code = ce.code
	case errors.Is(err, os.ErrNotExist), errors.Is(err, syscall.ESRCH):
		code = "not_found"
	case errors.Is(err, os.ErrExist):
		code = "exists"
	case errors.Is(err, os.ErrPermission):
		code = "denied"
	case errors.Is(err, syscall.ENOTDIR):
		code = "not_dir"
	case errors.Is(err, syscall.EISDIR):
		code = "is_dir"
	case errors.Is(err, syscall.EINVAL), errors.Is(err, syscall.ENAMETOOLONG), errors.Is(err, syscall.ELOOP):
		code = "invalid"
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		code = "no_space"
	}
	a.send(&Reply{ID: id, End: true, Code: code, Error: err.Error()})
}

// reader reads request lines until the process dies. EOF means the host
// disconnected: streams stop (the host re-attaches) and reading resumes
// once it is back (hostwait.go).
func (a *Agent) reader(f *os.File) {
	host := newHostSignal()
	host.watch(f)
	r := bufio.NewReaderSize(f, 1<<20)
	var line []byte
	for {
		part, err := r.ReadSlice('\n')
		if len(line)+len(part) <= maxLine {
			line = append(line, part...)
		} else {
			line = append(line[:0], 'x') // too long: keep reading, then reject
		}
		switch {
		case err == bufio.ErrBufferFull:
			continue
		case err != nil:
			line = line[:0]
			a.cancelStreams()
			host.wait()
			continue
		}
		if l := bytes.TrimSpace(line); len(l) > 0 {
			a.handle(l, r)
		}
		line = line[:0]
	}
}

func (a *Agent) handle(line []byte, r *bufio.Reader) {
	defer a.guard(0)
	var req Request
	if err := json.Unmarshal(line, &req); err != nil {
		a.send(&Reply{ID: req.ID, End: true, Code: "invalid", Error: "malformed request: " + err.Error()})
		return
	}
	if req.Raw > 0 { // a payload in raw bytes after the line (file writes)
		if req.Raw > maxLine {
			a.send(&Reply{ID: req.ID, End: true, Code: "invalid", Error: "raw payload too large"})
			_, _ = r.Discard(req.Raw)
			return
		}
		req.Data = make([]byte, req.Raw)
		if _, err := io.ReadFull(r, req.Data); err != nil {
			return // the host went away mid-payload
		}
	}
	switch req.Op {
	case "hello":
		a.hello(&req)
	// In order, on the reader: these must not overtake each other.
	// reseed too: the host sends it unanswered after a restore, and
	// nothing it asks after may run before the kernel is reseeded.
	case "input", "close_stdin", "write", "open", "close", "resize", "signal", "cancel", "reseed":
		if err := a.ordered(&req); err != nil {
			a.sendError(req.ID, err)
		}
	default:
		go a.concurrent(&req)
	}
}

// guard turns a panic while serving one request into an error reply: one
// bad request never takes the agent down (nothing restarts it).
func (a *Agent) guard(id uint64) {
	if r := recover(); r != nil {
		a.send(&Reply{ID: id, End: true, Code: "internal", Error: fmt.Sprintf("agent bug: %v", r)})
	}
}

func (a *Agent) hello(req *Request) {
	a.mu.Lock()
	changed := req.Session != a.session
	a.session = req.Session
	a.mu.Unlock()
	if changed {
		a.cancelStreams() // a new host connection: the old one's streams are dead
	}
	a.send(&Reply{ID: req.ID, End: true, Version: version, Boot: a.boot})
}

func (a *Agent) ordered(req *Request) error {
	var err error
	switch req.Op {
	case "input":
		err = a.procs.input(req.Pid, req.Data)
	case "close_stdin":
		err = a.procs.closeStdin(req.Pid)
	case "signal":
		err = a.procs.signal(req.Pid, req.Sig)
	case "resize":
		err = a.procs.resize(req.Pid, req.Pty)
	case "open":
		h, err := a.files.open(req.Path, req.User)
		if err == nil {
			a.send(&Reply{ID: req.ID, End: true, Handle: h})
		}
		return err
	case "write": // pipelined: no reply; an error is kept for close
		a.files.write(req.Handle, req.Data)
		return nil
	case "close":
		e, err := a.files.close(req.Handle)
		if err == nil {
			a.send(&Reply{ID: req.ID, End: true, Entry: e})
		}
		return err
	case "cancel":
		a.stopStream(req.Target)
	case "reseed": // random.go
		if err = reseed(req.Data); err != nil {
			fmt.Fprintf(os.Stderr, "strata-agent: reseed: %v\n", err)
		}
	}
	if err == nil {
		a.send(&Reply{ID: req.ID, End: true})
	}
	return err
}

func (a *Agent) concurrent(req *Request) {
	defer a.guard(req.ID)
	var err error
	switch req.Op {
	case "start":
		var p *Proc
		if p, err = a.procs.start(req); err == nil {
			a.stream(req.ID, func(stop chan struct{}) { p.follow(a, req.ID, 0, stop) })
		}
	case "attach":
		var p *Proc
		if p, err = a.procs.get(req.Pid); err == nil {
			a.stream(req.ID, func(stop chan struct{}) { p.follow(a, req.ID, req.From, stop) })
		}
	case "list":
		a.send(&Reply{ID: req.ID, End: true, Procs: a.procs.list()})
	case "metrics":
		a.send(&Reply{ID: req.ID, End: true, Metrics: a.cpu.metrics()})
	case "stat", "ls", "mkdir", "move", "remove":
		var r *Reply
		if r, err = a.files.do(req); err == nil {
			r.ID, r.End = req.ID, true
			a.send(r)
		}
	case "read":
		err = a.files.read(a, req)
	case "mount_volume": // volfs.go
		if err = mountVolume(req.Volume, req.Path); err == nil {
			a.send(&Reply{ID: req.ID, End: true})
		}
	case "watch":
		var w *watcher
		if w, err = newWatcher(req.Path, req.Recursive); err == nil {
			a.stream(req.ID, func(stop chan struct{}) { w.run(a, req.ID, stop) })
		}
	default:
		err = fail("invalid", fmt.Sprintf("unknown op %q", req.Op))
	}
	if err != nil {
		a.sendError(req.ID, err)
	}
}

// stream runs body until it ends or the stream is cancelled.
func (a *Agent) stream(id uint64, body func(stop chan struct{})) {
	stop := make(chan struct{})
	a.mu.Lock()
	a.streams[id] = stop
	a.mu.Unlock()
	body(stop)
	a.stopStream(id)
}

func (a *Agent) stopStream(id uint64) {
	a.mu.Lock()
	if stop, ok := a.streams[id]; ok {
		close(stop)
		delete(a.streams, id)
	}
	a.mu.Unlock()
	a.procs.wake()
}

// cancelStreams ends every stream (the host that asked for them is gone)
// and drops their queued replies: a host re-attaches from its own offsets.
func (a *Agent) cancelStreams() {
	a.mu.Lock()
	for id, stop := range a.streams {
		close(stop)
		delete(a.streams, id)
	}
	a.mu.Unlock()
	a.procs.wake()
	for {
		select {
		case <-a.out:
		default:
			return
		}
	}
}

// makeRaw puts a serial tty in raw mode, so lines pass unchanged.
func makeRaw(fd int) {
	var t syscall.Termios
	if _, _, e := syscall.Syscall(syscall.SYS_IOCTL, uintptr(fd), syscall.TCGETS, uintptr(unsafe.Pointer(&t))); e != 0 {
		return
	}
	t.Iflag &^= syscall.IGNBRK | syscall.BRKINT | syscall.PARMRK | syscall.ISTRIP | syscall.INLCR | syscall.IGNCR | syscall.ICRNL | syscall.IXON
	t.Oflag &^= syscall.OPOST
	t.Lflag &^= syscall.ECHO | syscall.ECHONL | syscall.ICANON | syscall.ISIG | syscall.IEXTEN
	t.Cflag &^= syscall.CSIZE | syscall.PARENB
	t.Cflag |= syscall.CS8
	t.Cc[syscall.VMIN], t.Cc[syscall.VTIME] = 1, 0
	syscall.Syscall(syscall.SYS_IOCTL, uintptr(fd), syscall.TCSETS, uintptr(unsafe.Pointer(&t)))
}
