package main

// The FUSE operations of a mounted volume, each one request (or none) to
// the node over the volume port. Argument offsets are those of the
// linux/fuse.h *_in structs named in each comment.

import (
	"syscall"
	"time"
)

// dirEntry is one name in an open directory's listing.
type dirEntry struct {
	name string
	attr *volAttr
	dot  bool // "." or "..": no node of ours
}

var dotAttr = &volAttr{Type: "directory"}

func (fs *volFS) do(r *fuseReq) ([]byte, syscall.Errno) {
	switch r.op {
	case opLookup:
		return fs.lookup(r.node, names(r.arg, 1)[0])
	case opGetattr: // fuse_getattr_in: flags@0 fh@8 (any path will do)
		return fs.getattr(r.node)
	case opSetattr:
		return fs.setattr(r)
	case opReadlink:
		return fs.readlink(r.node)
	case opSymlink: // the new name, then the target
		n := names(r.arg, 2)
		return fs.makeEntry(r, n[0], "symlink", map[string]any{"target": n[1]})
	case opMkdir: // fuse_mkdir_in: mode@0 umask@4 (mode is masked already), name@8
		mode := le32(r.arg, 0) & 0o7777
		return fs.makeEntry(r, names(r.arg[8:], 1)[0], "mkdir", map[string]any{"mode": mode})
	case opUnlink, opRmdir:
		return fs.remove(r)
	case opRename: // fuse_rename_in: newdir@0, names@8
		return fs.rename(r.node, le64(r.arg, 0), 0, r.arg[8:])
	case opRename2: // fuse_rename2_in: newdir@0 flags@8, names@16
		return fs.rename(r.node, le64(r.arg, 0), le32(r.arg, 8), r.arg[16:])
	case opOpen:
		return fs.open(r)
	case opCreate:
		return fs.create(r)
	case opRead:
		return fs.read(r)
	case opWrite:
		return fs.write(r)
	case opFlush, opFsync: // fuse_flush_in / fuse_fsync_in: fh@0
		return fs.flush(le64(r.arg, 0))
	case opRelease: // fuse_release_in: fh@0
		return fs.release(le64(r.arg, 0))
	case opOpendir:
		return openOut(fs.newHandle(&volHandle{node: r.node})), 0
	case opReaddir, opReaddirplus:
		return fs.readdir(r, r.op == opReaddirplus)
	case opReleasedir:
		fs.dropHandle(le64(r.arg, 0))
		return nil, 0
	case opStatfs:
		return fs.statfs()
	case opAccess, opFsyncdir, opDestroy: // no permission model of our own; nothing to sync
		return nil, 0
	}
	return nil, syscall.ENOSYS // xattrs, locks, mknod, link, fallocate...
}

func (fs *volFS) stat(path string) (*volAttr, syscall.Errno) {
	m, errno := fs.call("stat", map[string]any{"path": path}, nil)
	if errno != 0 {
		return nil, errno
	}
	return attrOf(m), 0
}

// attrOf is a reply's attr; a node that sent none gets an empty file.
func attrOf(m *volMsg) *volAttr {
	if m.Attr == nil {
		return &volAttr{Type: "file"}
	}
	return m.Attr
}

func (fs *volFS) lookup(parent uint64, name string) ([]byte, syscall.Errno) {
	path, errno := fs.child(parent, name)
	if errno != 0 {
		return nil, errno
	}
	a, errno := fs.stat(path)
	if errno != 0 {
		return nil, errno
	}
	return entryOut(fs.remember(path, a), a), 0
}

func (fs *volFS) getattr(node uint64) ([]byte, syscall.Errno) {
	path, errno := fs.nodePath(node)
	if errno != 0 {
		return nil, errno
	}
	a, errno := fs.stat(path)
	if errno != 0 {
		return nil, errno
	}
	return attrOut(node, a), 0
}

// setattr (fuse_setattr_in: valid@0 fh@8 size@16 mtime@40 mtimensec@60
// mode@68 uid@76 gid@80). atime and ctime are not kept by volumes.
func (fs *volFS) setattr(r *fuseReq) ([]byte, syscall.Errno) {
	path, errno := fs.nodePath(r.node)
	if errno != 0 {
		return nil, errno
	}
	valid, a := le32(r.arg, 0), r.arg
	args := map[string]any{"path": path}
	if valid&fattrMode != 0 {
		args["mode"] = le32(a, 68) & 0o7777
	}
	if valid&fattrUID != 0 {
		args["uid"] = le32(a, 76)
	}
	if valid&fattrGID != 0 {
		args["gid"] = le32(a, 80)
	}
	if valid&fattrSize != 0 {
		args["size"] = le64(a, 16)
		if h, _ := fs.handleOf(le64(a, 8)); valid&fattrFh != 0 && h != nil && h.write {
			args["fh"] = le64(a, 8) // ftruncate: the node changes what fh staged
		}
	}
	switch {
	case valid&fattrMtimeNow != 0:
		args["mtime"] = float64(time.Now().UnixNano()) / 1e9
	case valid&fattrMtime != 0:
		args["mtime"] = float64(le64(a, 40)) + float64(le32(a, 60))/1e9
	}
	if len(args) == 1 { // nothing a volume keeps (atime only, say)
		return fs.getattr(r.node)
	}
	m, errno := fs.call("setattr", args, nil)
	if errno != 0 {
		return nil, errno
	}
	return attrOut(r.node, attrOf(m)), 0
}

func (fs *volFS) readlink(node uint64) ([]byte, syscall.Errno) {
	path, errno := fs.nodePath(node)
	if errno != 0 {
		return nil, errno
	}
	a, errno := fs.stat(path)
	if errno != 0 {
		return nil, errno
	}
	if a.Type != "symlink" {
		return nil, syscall.EINVAL
	}
	return []byte(a.Target), 0
}

// makeEntry makes a directory or symlink owned by the caller.
func (fs *volFS) makeEntry(r *fuseReq, name, op string, args map[string]any) ([]byte, syscall.Errno) {
	path, errno := fs.child(r.node, name)
	if errno != 0 {
		return nil, errno
	}
	args["path"], args["uid"], args["gid"] = path, r.uid, r.gid
	m, errno := fs.call(op, args, nil)
	if errno != 0 {
		return nil, errno
	}
	a := attrOf(m)
	return entryOut(fs.remember(path, a), a), 0
}

func (fs *volFS) remove(r *fuseReq) ([]byte, syscall.Errno) {
	path, errno := fs.child(r.node, names(r.arg, 1)[0])
	if errno != 0 {
		return nil, errno
	}
	op := "unlink"
	if r.op == opRmdir {
		op = "rmdir"
	}
	if _, errno = fs.call(op, map[string]any{"path": path}, nil); errno == 0 {
		fs.detach(path)
	}
	return nil, errno
}

// rename: RENAME_NOREPLACE (1) is the node's; RENAME_EXCHANGE and
// RENAME_WHITEOUT are not supported.
func (fs *volFS) rename(dir, newdir uint64, flags uint32, arg []byte) ([]byte, syscall.Errno) {
	if flags&^1 != 0 {
		return nil, syscall.EINVAL
	}
	n := names(arg, 2)
	from, errno := fs.child(dir, n[0])
	if errno != 0 {
		return nil, errno
	}
	to, errno := fs.child(newdir, n[1])
	if errno != 0 {
		return nil, errno
	}
	args := map[string]any{"path": from, "to": to, "noreplace": flags&1 != 0}
	if _, errno = fs.call("rename", args, nil); errno == 0 {
		fs.moved(from, to)
	}
	return nil, errno
}

// open (fuse_open_in: flags@0). A read-only open asks the node nothing
// (reads carry their path); an open for writing is staged by the node
// under fh, emptied first for O_TRUNC (FUSE_ATOMIC_O_TRUNC).
func (fs *volFS) open(r *fuseReq) ([]byte, syscall.Errno) {
	flags := le32(r.arg, 0)
	trunc := flags&syscall.O_TRUNC != 0
	if flags&syscall.O_ACCMODE == syscall.O_RDONLY && !trunc {
		return openOut(fs.newHandle(&volHandle{node: r.node})), 0
	}
	path, errno := fs.nodePath(r.node)
	if errno != 0 {
		return nil, errno
	}
	fh := fs.newHandle(&volHandle{node: r.node, write: true})
	if _, errno = fs.call("open", map[string]any{"path": path, "fh": fh, "trunc": trunc}, nil); errno != 0 {
		fs.dropHandle(fh)
		return nil, errno
	}
	return openOut(fh), 0
}

// create (fuse_create_in: flags@0 mode@4 umask@8 open_flags@12, name@16):
// a new empty file, open for writing. If another writer made the name
// meanwhile and the caller did not ask for O_EXCL, it opens that file.
func (fs *volFS) create(r *fuseReq) ([]byte, syscall.Errno) {
	flags, mode := le32(r.arg, 0), le32(r.arg, 4)&0o7777
	path, errno := fs.child(r.node, names(r.arg[16:], 1)[0])
	if errno != 0 {
		return nil, errno
	}
	fh := fs.newHandle(&volHandle{write: true})
	m, errno := fs.call("create", map[string]any{"path": path, "mode": mode, "uid": r.uid, "gid": r.gid, "fh": fh}, nil)
	if errno == syscall.EEXIST && flags&syscall.O_EXCL == 0 {
		m, errno = fs.call("open", map[string]any{"path": path, "fh": fh, "trunc": flags&syscall.O_TRUNC != 0}, nil)
	}
	if errno != 0 {
		fs.dropHandle(fh)
		return nil, errno
	}
	a := attrOf(m)
	node := fs.remember(path, a)
	fs.mu.Lock()
	fs.handles[fh].node = node
	fs.mu.Unlock()
	return append(entryOut(node, a), openOut(fh)...), 0
}

// read (fuse_read_in: fh@0 offset@8 size@16): the node answers with the
// bytes, fewer at the end of the file.
func (fs *volFS) read(r *fuseReq) ([]byte, syscall.Errno) {
	path, errno := fs.nodePath(r.node)
	if errno != 0 {
		return nil, errno
	}
	m, errno := fs.call("read", map[string]any{"path": path, "off": le64(r.arg, 8), "len": le32(r.arg, 16)}, nil)
	if errno != 0 {
		return nil, errno
	}
	if n := int(le32(r.arg, 16)); len(m.data) > n {
		return m.data[:n], 0
	}
	return m.data, 0
}

// write (fuse_write_in: fh@0 offset@8 size@16, 40 bytes, then the data);
// fuse_write_out is size u32 | padding u32.
func (fs *volFS) write(r *fuseReq) ([]byte, syscall.Errno) {
	fh, size := le64(r.arg, 0), int(le32(r.arg, 16))
	data := r.arg[40 : 40+size]
	h, errno := fs.handleOf(fh)
	if errno != 0 || !h.write {
		return nil, syscall.EBADF
	}
	path, errno := fs.nodePath(h.node)
	if errno != 0 {
		return nil, errno
	}
	m, errno := fs.call("write", map[string]any{"fh": fh, "path": path, "off": le64(r.arg, 8)}, data)
	if errno != 0 {
		return nil, errno
	}
	n := uint32(size)
	if m.Size > 0 && m.Size < int64(size) { // a node that leaves out size wrote it all
		n = uint32(m.Size)
	}
	return make(enc, 0, 8).u32(n).u32(0), 0
}

// flush publishes what fh wrote (close(2) sends FLUSH, fsync(2) FSYNC);
// a read-only handle has nothing to publish.
func (fs *volFS) flush(fh uint64) ([]byte, syscall.Errno) {
	h, errno := fs.handleOf(fh)
	if errno != 0 || !h.write {
		return nil, 0
	}
	path, errno := fs.nodePath(h.node)
	if errno != 0 {
		return nil, errno
	}
	_, errno = fs.call("flush", map[string]any{"fh": fh, "path": path}, nil)
	return nil, errno
}

func (fs *volFS) release(fh uint64) ([]byte, syscall.Errno) {
	h := fs.dropHandle(fh)
	if h == nil || !h.write {
		return nil, 0
	}
	path, errno := fs.nodePath(h.node)
	if errno != 0 {
		return nil, errno
	}
	_, errno = fs.call("release", map[string]any{"fh": fh, "path": path}, nil)
	return nil, errno
}

// readdir (fuse_read_in: fh@0 offset@8 size@16) lists the directory from
// the node at offset 0 (opendir, rewinddir) and pages through that listing;
// an entry's offset is its index + 1. READDIRPLUS entries carry a
// fuse_entry_out each, and each one the kernel gets counts as a lookup.
func (fs *volFS) readdir(r *fuseReq, plus bool) ([]byte, syscall.Errno) {
	fh, off, size := le64(r.arg, 0), le64(r.arg, 8), int(le32(r.arg, 16))
	h, errno := fs.handleOf(fh)
	if errno != 0 {
		return nil, errno
	}
	dir, errno := fs.nodePath(r.node)
	if errno != 0 {
		return nil, errno
	}
	if off == 0 || h.dir == nil {
		m, errno := fs.call("list", map[string]any{"path": dir}, nil)
		if errno != 0 {
			return nil, errno
		}
		h.dir = listing(m.Entries)
	}
	out := make(enc, 0, size)
	for i := int(off); i < len(h.dir); i++ {
		e := h.dir[i]
		if len(out)+direntSize(e.name, plus) > size {
			break
		}
		path := e.name
		if dir != "" {
			path = dir + "/" + e.name
		}
		var ino uint64
		switch {
		case e.dot:
			ino = rootNode
			if plus {
				out = append(out, entryOut(0, nil)...)
			}
		case plus:
			ino = fs.remember(path, e.attr)
			out = append(out, entryOut(ino, e.attr)...)
		default:
			ino = fs.ino(path)
		}
		out = out.dirent(ino, uint64(i+1), fileMode(e.attr)>>12, e.name)
	}
	return out, 0
}

// listing is "." and "..", then the node's entries (bad names skipped).
func listing(entries []volEntry) []dirEntry {
	out := []dirEntry{{name: ".", attr: dotAttr, dot: true}, {name: "..", attr: dotAttr, dot: true}}
	for _, e := range entries {
		if e.Name == "" || e.Name == "." || e.Name == ".." || len(e.Name) > 255 || containsSlashOrNUL(e.Name) {
			continue
		}
		a := e.Attr
		if a == nil {
			a = &volAttr{Type: "file"}
		}
		out = append(out, dirEntry{name: e.Name, attr: a})
	}
	return out
}

func containsSlashOrNUL(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] == '/' || s[i] == 0 {
			return true
		}
	}
	return false
}

// statfs: fuse_statfs_out (80 bytes) is blocks bfree bavail files ffree
// u64 | bsize namelen frsize padding u32 | spare u32 x6.
func (fs *volFS) statfs() ([]byte, syscall.Errno) {
	m, errno := fs.call("statfs", nil, nil)
	if errno != 0 {
		return nil, errno
	}
	bsize := m.Bsize
	if bsize == 0 {
		bsize = 4096
	}
	e := make(enc, 0, 80).u64(m.Blocks).u64(m.Bfree).u64(m.Bfree).u64(m.Files).u64(m.Ffree).
		u32(bsize).u32(255).u32(bsize).u32(0)
	return append(e, make([]byte, 24)...), 0
}
