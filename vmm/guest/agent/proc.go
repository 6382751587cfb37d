package main

import (
	"fmt"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

const (
	ringBytes   = 4 << 20         // output kept per process for hosts that re-attach
	keepExited  = 256             // exited processes remembered (their exit and output)
	killWait    = 3 * time.Second // a SIGKILL's reply waits this long for the exit
	readBlock   = 64 << 10
	defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
)

// chunk is a piece of output at offset off of the process's output (all
// its streams counted together, in arrival order).
type chunk struct {
	off  int64
	fd   int
	data []byte
}

// Proc is one started process and the tail of its output.
type Proc struct {
	info   ProcInfo
	cmd    *exec.Cmd
	stdin  *os.File // nil when closed or not asked for
	pty    *os.File // the master side, when started with a pty
	mu     sync.Mutex
	cond   *sync.Cond
	chunks []chunk
	kept   int   // bytes in chunks
	total  int64 // bytes ever produced
	exit   *Exit
	killed bool // SIGKILL sent: gone to every later signal
	ended  time.Time
}

// Procs is every process the agent started, by pid.
type Procs struct {
	mu    sync.Mutex
	byPid map[int]*Proc
}

func newProcs() *Procs { return &Procs{byPid: map[int]*Proc{}} }

func (ps *Procs) get(pid int) (*Proc, error) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if p, ok := ps.byPid[pid]; ok {
		return p, nil
	}
	return nil, fail("not_found", fmt.Sprintf("process %d not found", pid))
}

// wake lets every follower re-check whether its stream was cancelled.
func (ps *Procs) wake() {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	for _, p := range ps.byPid {
		p.mu.Lock()
		p.cond.Broadcast()
		p.mu.Unlock()
	}
}

func (ps *Procs) list() []ProcInfo {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	out := []ProcInfo{}
	for _, p := range ps.byPid {
		p.mu.Lock()
		if p.exit == nil {
			out = append(out, p.info)
		}
		p.mu.Unlock()
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Pid < out[j].Pid })
	return out
}

// start runs a process; its output is pumped into its ring from now on.
func (ps *Procs) start(req *Request) (*Proc, error) {
	u, err := lookupUser(req.User)
	if err != nil {
		return nil, err
	}
	path := req.Cmd
	if path == "/bin/bash" && !exists(path) {
		path = "/bin/sh" // E2B's SDK runs `/bin/bash -l -c CMD`; busybox sh takes the same flags
	}
	cwd := req.Cwd
	if cwd == "" {
		cwd = u.home
		if !exists(cwd) {
			cwd = "/"
		}
	} else if !strings.HasPrefix(cwd, "/") {
		cwd = u.home + "/" + cwd
	}
	if st, err := os.Stat(cwd); err != nil || !st.IsDir() {
		return nil, fail("invalid", fmt.Sprintf("working directory %s does not exist", cwd))
	}
	cmd := exec.Command(path, req.Args...)
	cmd.Dir = cwd
	cmd.Env = environ(u, req.Env, req.Pty != nil)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if u.uid != 0 {
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: u.uid, Gid: u.gid}
	}
	p := &Proc{cmd: cmd, info: ProcInfo{Tag: req.Tag, Cmd: req.Cmd, Args: req.Args, Env: req.Env, Cwd: cwd}}
	p.cond = sync.NewCond(&p.mu)
	if p.info.Args == nil {
		p.info.Args = []string{}
	}
	if p.info.Env == nil {
		p.info.Env = map[string]string{}
	}
	outputs, err := p.wire(req)
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		p.closeChild()
		return nil, fail("invalid", fmt.Sprintf("cannot start %s: %v", req.Cmd, err))
	}
	p.closeChild()
	p.info.Pid = cmd.Process.Pid
	ps.mu.Lock()
	ps.byPid[p.info.Pid] = p
	ps.forget()
	ps.mu.Unlock()
	var pumps sync.WaitGroup
	for fd, r := range outputs {
		pumps.Add(1)
		go func(fd int, r *os.File) { defer pumps.Done(); p.pump(fd, r) }(fd, r)
	}
	go p.reap(&pumps)
	return p, nil
}

// wire connects stdio: pipes (or a pty) whose parent ends are returned by fd.
func (p *Proc) wire(req *Request) (map[int]*os.File, error) {
	if req.Pty != nil {
		master, slave, err := openPty(req.Pty)
		if err != nil {
			return nil, err
		}
		p.cmd.Stdin, p.cmd.Stdout, p.cmd.Stderr = slave, slave, slave
		p.cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0, Credential: p.cmd.SysProcAttr.Credential}
		p.pty = master
		return map[int]*os.File{3: master}, nil
	}
	outputs := map[int]*os.File{}
	if req.Merge {
		r, w, err := os.Pipe()
		if err != nil {
			return nil, err
		}
		outputs[1], p.cmd.Stdout, p.cmd.Stderr = r, w, w
	}
	for _, fd := range []int{1, 2} {
		if req.Merge {
			break
		}
		r, w, err := os.Pipe()
		if err != nil {
			return nil, err
		}
		outputs[fd] = r
		if fd == 1 {
			p.cmd.Stdout = w
		} else {
			p.cmd.Stderr = w
		}
	}
	if req.Stdin {
		r, w, err := os.Pipe()
		if err != nil {
			return nil, err
		}
		p.cmd.Stdin, p.stdin = r, w
	}
	return outputs, nil
}

// closeChild closes our copies of the child's ends of its stdio.
func (p *Proc) closeChild() {
	seen := map[*os.File]bool{}
	for _, f := range []any{p.cmd.Stdin, p.cmd.Stdout, p.cmd.Stderr} {
		if f, ok := f.(*os.File); ok && !seen[f] {
			seen[f] = true
			f.Close()
		}
	}
}

func (p *Proc) pump(fd int, r *os.File) {
	defer r.Close()
	for {
		buf := make([]byte, readBlock)
		n, err := r.Read(buf)
		if n > 0 {
			p.mu.Lock()
			p.chunks = append(p.chunks, chunk{p.total, fd, buf[:n:n]})
			p.total += int64(n)
			p.kept += n
			for p.kept > ringBytes && len(p.chunks) > 1 {
				p.kept -= len(p.chunks[0].data)
				p.chunks = p.chunks[1:]
			}
			p.cond.Broadcast()
			p.mu.Unlock()
		}
		if err != nil {
			return
		}
	}
}

// reap waits for the process; its output streams get a short grace to
// drain (a background child may hold them open for ever).
func (p *Proc) reap(pumps *sync.WaitGroup) {
	err := p.cmd.Wait()
	done := make(chan struct{})
	go func() { pumps.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(250 * time.Millisecond):
	}
	e := &Exit{Code: p.cmd.ProcessState.ExitCode(), Status: "exited"}
	if ws, ok := p.cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		e.Code, e.Signal, e.Status = -1, int(ws.Signal()), "signal: "+ws.Signal().String()
	} else if err != nil && e.Code == -1 {
		e.Status = err.Error()
	} else {
		e.Status = "exit status " + strconv.Itoa(e.Code)
	}
	p.mu.Lock()
	p.exit, p.ended = e, time.Now()
	if p.stdin != nil {
		p.stdin.Close()
		p.stdin = nil
	}
	p.cond.Broadcast()
	p.mu.Unlock()
}

// follow sends the process's output from offset `from` (-1: from now) as
// it arrives, then its exit. Output dropped from the ring before the
// follower got to it is reported as `lost`.
func (p *Proc) follow(a *Agent, id uint64, from int64, stop chan struct{}) {
	p.mu.Lock()
	if from < 0 {
		from = p.total
	}
	a.sendStream(&Reply{ID: id, Pid: p.info.Pid, Off: from})
	for {
		for p.exit == nil && from >= p.total && !stopped(stop) {
			p.cond.Wait()
		}
		if stopped(stop) {
			p.mu.Unlock()
			return
		}
		var batch []Reply
		for _, c := range p.chunks {
			end := c.off + int64(len(c.data))
			if end <= from {
				continue
			}
			r := Reply{ID: id, Fd: c.fd, Off: c.off, Data: c.data}
			if c.off > from {
				r.Lost = c.off - from
			} else if c.off < from {
				r.Off, r.Data = from, c.data[from-c.off:]
			}
			batch = append(batch, r)
			from = end
		}
		exit := p.exit
		p.mu.Unlock()
		for i := range batch {
			a.sendStream(&batch[i])
		}
		if exit != nil && len(batch) == 0 {
			a.sendStream(&Reply{ID: id, End: true, Pid: p.info.Pid, Exit: exit, Off: from})
			return
		}
		p.mu.Lock()
	}
}

func stopped(stop chan struct{}) bool {
	select {
	case <-stop:
		return true
	default:
		return false
	}
}

func (ps *Procs) input(pid int, data []byte) error {
	p, err := ps.get(pid)
	if err != nil {
		return err
	}
	p.mu.Lock()
	w := p.stdin
	if p.pty != nil {
		w = p.pty
	}
	p.mu.Unlock()
	if w == nil {
		return fail("invalid", fmt.Sprintf("process %d has no open stdin", pid))
	}
	_, err = w.Write(data)
	return err
}

func (ps *Procs) closeStdin(pid int) error {
	p, err := ps.get(pid)
	if err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pty != nil {
		_, err = p.pty.Write([]byte{4}) // ^D
		return err
	}
	if p.stdin != nil {
		p.stdin.Close()
		p.stdin = nil
	}
	return nil
}

// signal signals the process's whole group (commands run through a shell).
func (ps *Procs) signal(pid, sig int) error {
	p, err := ps.get(pid)
	if err != nil {
		return err
	}
	p.mu.Lock()
	gone := p.exit != nil || p.killed
	p.mu.Unlock()
	if gone {
		return fail("not_found", fmt.Sprintf("process %d has already exited", pid))
	}
	err = syscall.Kill(-pid, syscall.Signal(sig))
	if err != nil {
		err = syscall.Kill(pid, syscall.Signal(sig))
	}
	if err == syscall.ESRCH { // exited, and its exit not recorded yet (reap waits for its output)
		return fail("not_found", fmt.Sprintf("process %d has already exited", pid))
	}
	if err == nil && syscall.Signal(sig) == syscall.SIGKILL {
		p.awaitKilled()
	}
	return err
}

// awaitKilled marks a process SIGKILLed (it is gone for every later signal:
// a second kill answers not_found, as the SDK expects) and waits briefly
// for its exit to be recorded, so a kill that returned is a process that
// ended (a zombie would otherwise still take signals until it is reaped).
func (p *Proc) awaitKilled() {
	p.mu.Lock()
	p.killed = true
	p.mu.Unlock()
	deadline := time.Now().Add(killWait)
	for time.Now().Before(deadline) {
		p.mu.Lock()
		done := p.exit != nil
		p.mu.Unlock()
		if done {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (ps *Procs) resize(pid int, size *Size) error {
	p, err := ps.get(pid)
	if err != nil {
		return err
	}
	if p.pty == nil || size == nil {
		return fail("invalid", fmt.Sprintf("process %d has no terminal", pid))
	}
	return setSize(p.pty, size)
}

// forget drops the oldest exited processes past keepExited (ps.mu held).
func (ps *Procs) forget() {
	var exited []*Proc
	for _, p := range ps.byPid {
		p.mu.Lock()
		if p.exit != nil {
			exited = append(exited, p)
		}
		p.mu.Unlock()
	}
	if len(exited) <= keepExited {
		return
	}
	sort.Slice(exited, func(i, j int) bool { return exited[i].ended.Before(exited[j].ended) })
	for _, p := range exited[:len(exited)-keepExited] {
		delete(ps.byPid, p.info.Pid)
	}
}

type user struct {
	name     string
	uid, gid uint32
	home     string
}

// lookupUser reads /etc/passwd; "" is root, a number is a uid (an OCI
// image's User may be one that /etc/passwd does not list).
func lookupUser(name string) (*user, error) {
	if name == "" {
		name = "root"
	}
	uid, numeric := strconv.ParseUint(name, 10, 32)
	data, _ := os.ReadFile("/etc/passwd")
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Split(line, ":")
		if len(f) >= 6 && (f[0] == name || (numeric == nil && f[2] == name)) {
			uid, err1 := strconv.ParseUint(f[2], 10, 32)
			gid, err2 := strconv.ParseUint(f[3], 10, 32)
			if err1 == nil && err2 == nil {
				return &user{name, uint32(uid), uint32(gid), f[5]}, nil
			}
		}
	}
	if name == "root" {
		return &user{"root", 0, 0, "/root"}, nil
	}
	if numeric == nil {
		return &user{name, uint32(uid), uint32(uid), "/"}, nil
	}
	return nil, fail("invalid", fmt.Sprintf("user %q does not exist in the sandbox", name))
}

func environ(u *user, extra map[string]string, tty bool) []string {
	env := map[string]string{"PATH": defaultPath, "HOME": u.home, "USER": u.name, "LOGNAME": u.name}
	if tty {
		env["TERM"] = "xterm-256color"
	}
	for k, v := range extra {
		env[k] = v
	}
	out := make([]string, 0, len(env))
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	sort.Strings(out)
	return out
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
