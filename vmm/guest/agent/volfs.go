package main

// A mounted volume (README.md, "Volume port"): a FUSE filesystem whose
// every operation is a request to the node over the volume port. This file
// mounts it, reads requests off /dev/fuse and keeps the node table; the
// operations themselves are in volops.go.

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"
)

const (
	volInFlight = 64      // requests served at once per mount
	volBigBufs  = 4       // request buffers a WRITE may hold beyond the reader's own
	volSmallReq = 1 << 16 // smaller requests are copied out of the read buffer
	rootNode    = 1       // FUSE_ROOT_ID
)

// volumes is every mounted volume, by guest directory, and the port they share.
var volumes = struct {
	mu     sync.Mutex
	port   *volPort
	mounts map[string]*volFS
}{mounts: map[string]*volFS{}}

var volumeID = regexp.MustCompile(`^[A-Za-z0-9_-]{1,128}$`)

// mountVolume serves the agent request mount_volume: it returns once the
// kernel's INIT is answered, so the mount is usable when the host hears back.
func mountVolume(vol, dir string) error {
	if !volumeID.MatchString(vol) {
		return fail("invalid", fmt.Sprintf("bad volume id %q", vol))
	}
	if !filepath.IsAbs(dir) || strings.Contains("/"+dir+"/", "/../") {
		return fail("invalid", fmt.Sprintf("mount path %q is not absolute or has ..", dir))
	}
	dir = filepath.Clean(dir)
	volumes.mu.Lock()
	defer volumes.mu.Unlock()
	if _, ok := volumes.mounts[dir]; ok {
		return fail("exists", "a volume is already mounted at "+dir)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if volumes.port == nil {
		p, err := openVolPort()
		if err != nil {
			return err
		}
		volumes.port = p
	}
	fs, err := startVolFS(vol, dir, volumes.port)
	if err != nil {
		return err
	}
	volumes.mounts[dir] = fs
	raiseReadahead(dir)
	logf("volume %s mounted at %s", vol, dir)
	return nil
}

// raiseReadahead lets sequential reads ask the node for 1 MiB at a time,
// not the 128 KiB the kernel gives a FUSE mount's readahead: each request
// is a round trip over the port. The mount's device number comes from
// mountinfo, as a stat would be a request to the node.
func raiseReadahead(dir string) {
	info, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return
	}
	esc := strings.NewReplacer(`\`, `\134`, " ", `\040`, "\t", `\011`, "\n", `\012`).Replace(dir)
	dev := ""
	for _, line := range strings.Split(string(info), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == esc {
			dev = f[2] // major:minor; the last one is the newest mount
		}
	}
	if dev != "" {
		_ = os.WriteFile("/sys/class/bdi/"+dev+"/read_ahead_kb", []byte("1024"), 0)
	}
}

// volFS is one mounted volume.
type volFS struct {
	vol, dir string
	fd       int
	port     *volPort
	ready    chan error    // INIT answered (nil), or the serve loop ended first
	sem      chan struct{} // one per request in flight
	spare    chan []byte   // big read buffers a finished WRITE gave back
	nbufs    int           // big buffers made (serve loop only)

	mu       sync.Mutex
	nodes    map[uint64]*volNode
	byPath   map[string]*volNode // nodes still at their path
	lastNode uint64
	handles  map[uint64]*volHandle
}

// volNode is what a FUSE node id names: a volume path, and how many times
// the kernel was handed the id (it FORGETs that many). Ids are never
// reused; a path whose entry changed type gets a new one, as the kernel
// refuses an inode changing type under the same id.
type volNode struct {
	id      uint64
	path    string
	kind    string
	lookups uint64
}

// volHandle is an open file or directory.
type volHandle struct {
	node  uint64
	write bool       // the node knows it as fh: flush and release go there
	dir   []dirEntry // a directory's listing, read at offset 0
}

func startVolFS(vol, dir string, port *volPort) (*volFS, error) {
	fd, err := syscall.Open("/dev/fuse", syscall.O_RDWR|syscall.O_CLOEXEC, 0)
	if errors.Is(err, syscall.ENOENT) {
		return nil, fail("internal", "no /dev/fuse (the fuse module is not loaded)")
	} else if err != nil {
		return nil, fmt.Errorf("open /dev/fuse: %w", err)
	}
	opts := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other", fd)
	if err := syscall.Mount(vol, dir, "fuse.strata", syscall.MS_NOSUID|syscall.MS_NODEV, opts); err != nil {
		syscall.Close(fd)
		return nil, fmt.Errorf("mount %s: %w", dir, err)
	}
	fs := &volFS{vol: vol, dir: dir, fd: fd, port: port, ready: make(chan error, 1),
		sem: make(chan struct{}, volInFlight), spare: make(chan []byte, volBigBufs+1),
		nodes: map[uint64]*volNode{}, byPath: map[string]*volNode{},
		lastNode: rootNode, handles: map[uint64]*volHandle{}}
	root := &volNode{id: rootNode, kind: "directory"}
	fs.nodes[rootNode], fs.byPath[""] = root, root
	go fs.serve()
	select {
	case err = <-fs.ready:
	case <-time.After(10 * time.Second):
		err = errors.New("the kernel sent no FUSE INIT in 10 s")
	}
	if err != nil {
		syscall.Unmount(dir, syscall.MNT_DETACH)
		return nil, err
	}
	return fs, nil
}

// serve reads requests until the mount goes away (ENODEV), each served on
// its own goroutine, at most volInFlight at once. A request is read into
// a buffer big enough for a 1 MiB WRITE; a WRITE keeps its buffer until
// served (at most volBigBufs of them), smaller requests are copied out.
func (fs *volFS) serve() {
	buf := make([]byte, fuseBufSize)
	for {
		n, err := syscall.Read(fs.fd, buf)
		switch err {
		case nil:
		case syscall.EINTR, syscall.EAGAIN, syscall.ENOENT: // ENOENT: the request was interrupted
			continue
		default:
			if err != syscall.ENODEV {
				logf("volume %s: reading /dev/fuse: %v", fs.vol, err)
			}
			fs.ended()
			return
		}
		r, err := parseReq(buf[:n])
		if err != nil {
			logf("volume %s: %v", fs.vol, err)
			continue
		}
		if r.op == opInit { // first, and alone: nothing else comes before its reply
			fs.init(r)
			continue
		}
		done := func() {}
		if n > volSmallReq {
			big := buf
			buf, done = fs.bigBuf(), func() { fs.spare <- big }
		} else {
			r.arg = append([]byte(nil), r.arg...)
		}
		fs.sem <- struct{}{}
		go func() {
			defer func() { done(); <-fs.sem }()
			fs.serveReq(r)
		}()
	}
}

func (fs *volFS) bigBuf() []byte {
	select {
	case b := <-fs.spare:
		return b
	default:
	}
	if fs.nbufs < volBigBufs {
		fs.nbufs++
		return make([]byte, fuseBufSize)
	}
	return <-fs.spare
}

func (fs *volFS) init(r *fuseReq) {
	out, err := initOut(r.arg)
	if err != nil {
		writeReply(fs.fd, r.unique, syscall.EPROTO, nil)
	} else {
		writeReply(fs.fd, r.unique, 0, out)
	}
	select {
	case fs.ready <- err:
	default:
	}
}

// ended: the mount is gone. The device fd is closed only once no request
// is in flight, so a late reply never lands on a reused fd number.
func (fs *volFS) ended() {
	select {
	case fs.ready <- errors.New("the FUSE device closed before INIT"):
	default:
	}
	logf("volume %s at %s unmounted", fs.vol, fs.dir)
	go func() {
		for i := 0; i < volInFlight; i++ {
			fs.sem <- struct{}{}
		}
		syscall.Close(fs.fd)
		volumes.mu.Lock()
		if volumes.mounts[fs.dir] == fs {
			delete(volumes.mounts, fs.dir)
		}
		volumes.mu.Unlock()
	}()
}

// serveReq serves one request; a panic (a malformed request) answers EIO.
func (fs *volFS) serveReq(r *fuseReq) {
	defer func() {
		if p := recover(); p != nil {
			logf("volume %s: fuse op %d: %v", fs.vol, r.op, p)
			writeReply(fs.fd, r.unique, syscall.EIO, nil)
		}
	}()
	switch r.op {
	case opForget:
		fs.forget(r.node, le64(r.arg, 0))
	case opBatchForget: // count u32 | dummy u32, then {nodeid u64, nlookup u64} x count
		for i, b := 0, r.arg[8:]; i < int(le32(r.arg, 0)); i, b = i+1, b[16:] {
			fs.forget(le64(b, 0), le64(b, 8))
		}
	default:
		out, errno := fs.do(r)
		writeReply(fs.fd, r.unique, errno, out)
	}
}

// call asks the node about this volume.
func (fs *volFS) call(op string, args map[string]any, raw []byte) (*volMsg, syscall.Errno) {
	return fs.port.call(fs.vol, op, args, raw)
}

// --- the node table -----------------------------------------------------

func (fs *volFS) nodePath(id uint64) (string, syscall.Errno) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if n, ok := fs.nodes[id]; ok {
		return n.path, 0
	}
	return "", syscall.ESTALE
}

// child is the volume path of name in directory node parent.
func (fs *volFS) child(parent uint64, name string) (string, syscall.Errno) {
	if name == "" || name == "." || name == ".." || strings.Contains(name, "/") {
		return "", syscall.EINVAL
	}
	if len(name) > 255 {
		return "", syscall.ENAMETOOLONG
	}
	dir, errno := fs.nodePath(parent)
	if errno != 0 || dir == "" {
		return name, errno
	}
	return dir + "/" + name, 0
}

// remember hands out path's node id once more (a LOOKUP's, a CREATE's...).
func (fs *volFS) remember(path string, a *volAttr) uint64 {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	n := fs.byPath[path]
	if n != nil && n.kind != a.Type && n.id != rootNode {
		delete(fs.byPath, path)
		n = nil
	}
	if n == nil {
		fs.lastNode++
		n = &volNode{id: fs.lastNode, path: path, kind: a.Type}
		fs.nodes[n.id], fs.byPath[path] = n, n
	}
	n.lookups++
	return n.id
}

// ino is what a READDIR entry at path says its inode is: its node id if
// it has one, else a hash (d_ino 0 would hide the entry from some libcs).
func (fs *volFS) ino(path string) uint64 {
	fs.mu.Lock()
	n := fs.byPath[path]
	fs.mu.Unlock()
	if n != nil {
		return n.id
	}
	h := uint64(14695981039346656037) // FNV-1a
	for i := 0; i < len(path); i++ {
		h = (h ^ uint64(path[i])) * 1099511628211
	}
	return h | 1<<63
}

func (fs *volFS) forget(id, count uint64) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	n, ok := fs.nodes[id]
	if !ok || id == rootNode {
		return
	}
	if count >= n.lookups {
		delete(fs.nodes, id)
		if fs.byPath[n.path] == n {
			delete(fs.byPath, n.path)
		}
		return
	}
	n.lookups -= count
}

// detach: the entry at path (and anything under it) is gone. Its node
// lives on until forgotten (an open file's), keeping its last path.
func (fs *volFS) detach(path string) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	fs.detachLocked(path)
}

func (fs *volFS) detachLocked(path string) {
	for p := range fs.byPath {
		if under(p, path) {
			delete(fs.byPath, p)
		}
	}
}

// moved: a rename took from to to; the node there and every node under it
// follow, and whatever to replaced is detached.
func (fs *volFS) moved(from, to string) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	fs.detachLocked(to)
	var moving []*volNode
	for p, n := range fs.byPath {
		if under(p, from) {
			moving = append(moving, n)
		}
	}
	for _, n := range moving {
		delete(fs.byPath, n.path)
	}
	for _, n := range moving {
		n.path = to + n.path[len(from):]
		fs.byPath[n.path] = n
	}
}

// under: p is dir or inside it (dir is never the root here).
func under(p, dir string) bool {
	return p == dir || strings.HasPrefix(p, dir) && p[len(dir)] == '/'
}

// --- open handles ---------------------------------------------------------

var lastFH struct {
	sync.Mutex
	n uint64
}

// newHandle opens a handle; fh numbers are unique per agent run, as the
// node keys what a guest writes by them.
func (fs *volFS) newHandle(h *volHandle) uint64 {
	lastFH.Lock()
	lastFH.n++
	fh := lastFH.n
	lastFH.Unlock()
	fs.mu.Lock()
	fs.handles[fh] = h
	fs.mu.Unlock()
	return fh
}

func (fs *volFS) handleOf(fh uint64) (*volHandle, syscall.Errno) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if h, ok := fs.handles[fh]; ok {
		return h, 0
	}
	return nil, syscall.EBADF
}

func (fs *volFS) dropHandle(fh uint64) *volHandle {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	h := fs.handles[fh]
	delete(fs.handles, fh)
	return h
}
