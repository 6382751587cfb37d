package main

// The Linux FUSE kernel protocol, spoken directly on /dev/fuse (no libfuse:
// the agent is stdlib-only and static). Layouts are linux/fuse.h's, ABI 7.x
// as in kernel 6.1, little-endian, records 64-bit aligned. A request is a
// fuse_in_header (40 bytes), the op's argument struct, then NUL-terminated
// names or write data:
//
//	 0 len u32   4 opcode u32   8 unique u64   16 nodeid u64
//	24 uid u32  28 gid u32     32 pid u32     36 total_extlen u16 | padding u16
//
// A reply is a fuse_out_header (0 len u32, 4 error i32 = -errno, 8 unique
// u64: 16 bytes) and the op's out struct, in one write. FORGET and
// BATCH_FORGET get no reply.

import (
	"encoding/binary"
	"fmt"
	"runtime"
	"syscall"
	"unsafe"
)

// Opcodes (enum fuse_opcode); anything else is answered ENOSYS.
const (
	opLookup      = 1
	opForget      = 2
	opGetattr     = 3
	opSetattr     = 4
	opReadlink    = 5
	opSymlink     = 6
	opMkdir       = 9
	opUnlink      = 10
	opRmdir       = 11
	opRename      = 12
	opOpen        = 14
	opRead        = 15
	opWrite       = 16
	opStatfs      = 17
	opRelease     = 18
	opFsync       = 20
	opFlush       = 25
	opInit        = 26
	opOpendir     = 27
	opReaddir     = 28
	opReleasedir  = 29
	opFsyncdir    = 30
	opAccess      = 34
	opCreate      = 35
	opDestroy     = 38
	opBatchForget = 42
	opReaddirplus = 44
	opRename2     = 45
)

// INIT flags we ask for (only those the kernel offers are kept).
const (
	initAsyncRead     = 1 << 0
	initAtomicOTrunc  = 1 << 3  // O_TRUNC comes with OPEN, not as a SETATTR first
	initBigWrites     = 1 << 5  // writes larger than a page
	initDoReaddirplus = 1 << 13 // READDIR carries attributes: `ls -l` is one round trip
	initParallelDirop = 1 << 18
	initMaxPages      = 1 << 22 // init_out.max_pages is honoured (else 32 pages)
)

// setattr_in.valid bits.
const (
	fattrMode     = 1 << 0
	fattrUID      = 1 << 1
	fattrGID      = 1 << 2
	fattrSize     = 1 << 3
	fattrMtime    = 1 << 5
	fattrFh       = 1 << 6
	fattrMtimeNow = 1 << 8
)

const (
	fuseMinor     = 36      // the ABI minor we answer (Debian's 6.1 offers 38; the lower one counts)
	fuseMaxWrite  = 1 << 20 // bytes per WRITE (and READ), with max_pages 256
	fuseMaxPages  = fuseMaxWrite / 4096
	fuseBufSize   = fuseMaxWrite + 4096 // a read(2) must fit a whole WRITE request
	fuseValidSecs = 1                   // entry and attribute timeouts
	inHeaderSize  = 40
	outHeaderSize = 16
)

// fuseReq is one request as read from the device.
type fuseReq struct {
	op       uint32
	unique   uint64
	node     uint64
	uid, gid uint32
	arg      []byte // what follows the header
}

func parseReq(b []byte) (*fuseReq, error) {
	if len(b) < inHeaderSize || int(le32(b, 0)) != len(b) {
		return nil, fmt.Errorf("fuse: short or torn request (%d bytes)", len(b))
	}
	return &fuseReq{op: le32(b, 4), unique: le64(b, 8), node: le64(b, 16),
		uid: le32(b, 24), gid: le32(b, 28), arg: b[inHeaderSize:]}, nil
}

// Little-endian field access; a short argument panics, and the request's
// guard turns that into EIO.
func le32(b []byte, off int) uint32 { return binary.LittleEndian.Uint32(b[off:]) }
func le64(b []byte, off int) uint64 { return binary.LittleEndian.Uint64(b[off:]) }

// names splits NUL-terminated strings (a LOOKUP's name, a RENAME's two).
func names(b []byte, n int) []string {
	out := make([]string, 0, n)
	for len(out) < n {
		i := 0
		for i < len(b) && b[i] != 0 {
			i++
		}
		if i == len(b) {
			panic("fuse: name without NUL")
		}
		out = append(out, string(b[:i]))
		b = b[i+1:]
	}
	return out
}

// enc appends little-endian fields to a reply's out struct.
type enc []byte

func (e enc) u16(v uint16) enc { return binary.LittleEndian.AppendUint16(e, v) }
func (e enc) u32(v uint32) enc { return binary.LittleEndian.AppendUint32(e, v) }
func (e enc) u64(v uint64) enc { return binary.LittleEndian.AppendUint64(e, v) }

// fuse_attr, 88 bytes:
//
//	ino size blocks atime mtime ctime            u64 x6
//	atimensec mtimensec ctimensec mode nlink     u32 x5
//	uid gid rdev blksize flags                   u32 x5
func (e enc) attr(ino uint64, a *volAttr) enc {
	mode, nlink := fileMode(a), uint32(1)
	if a.Type == "directory" {
		nlink = 2
	}
	size := a.Size
	if a.Type == "symlink" {
		size = uint64(len(a.Target))
	}
	ms, mns := splitTime(a.Mtime)
	cs, cns := splitTime(a.Ctime)
	return e.u64(ino).u64(size).u64((size + 511) / 512).u64(ms).u64(ms).u64(cs).
		u32(mns).u32(mns).u32(cns).u32(mode).u32(nlink).
		u32(a.UID).u32(a.GID).u32(0).u32(1 << 20).u32(0)
}

// fuse_entry_out, 128 bytes: nodeid generation entry_valid attr_valid u64 |
// entry_valid_nsec attr_valid_nsec u32 | fuse_attr. Node ids are never
// reused, so the generation is always 0. A zero nodeid (and attr) is a
// READDIRPLUS entry the kernel must not link ("." and "..").
func entryOut(node uint64, a *volAttr) enc {
	e := make(enc, 0, 128).u64(node).u64(0)
	if node == 0 {
		return append(e, make([]byte, 128-16)...)
	}
	return e.u64(fuseValidSecs).u64(fuseValidSecs).u32(0).u32(0).attr(node, a)
}

// fuse_attr_out, 104 bytes: attr_valid u64 | attr_valid_nsec u32 | dummy u32 | fuse_attr.
func attrOut(node uint64, a *volAttr) enc {
	return make(enc, 0, 104).u64(fuseValidSecs).u32(0).u32(0).attr(node, a)
}

// fuse_open_out, 16 bytes: fh u64 | open_flags u32 | padding u32. open_flags
// stay 0: no FOPEN_KEEP_CACHE, so the kernel drops a file's pages at open.
func openOut(fh uint64) enc { return make(enc, 0, 16).u64(fh).u32(0).u32(0) }

// fuse_dirent: ino u64 | off u64 | namelen u32 | type u32 | name, padded to 8.
func (e enc) dirent(ino, off uint64, typ uint32, name string) enc {
	e = append(e.u64(ino).u64(off).u32(uint32(len(name))).u32(typ), name...)
	return append(e, make([]byte, direntSize(name, false)-24-len(name))...)
}

// direntSize is a dirent's record size, with its fuse_entry_out for READDIRPLUS.
func direntSize(name string, plus bool) int {
	n := (24 + len(name) + 7) &^ 7
	if plus {
		n += 128
	}
	return n
}

func fileMode(a *volAttr) uint32 {
	perm := a.Mode & 0o7777
	switch a.Type {
	case "directory":
		return syscall.S_IFDIR | perm
	case "symlink":
		return syscall.S_IFLNK | perm
	}
	return syscall.S_IFREG | perm
}

func splitTime(t float64) (uint64, uint32) {
	if t <= 0 {
		return 0, 0
	}
	s := uint64(t)
	ns := uint32((t - float64(s)) * 1e9)
	if ns >= 1e9 {
		ns = 1e9 - 1
	}
	return s, ns
}

// initOut answers INIT (fuse_init_in: major@0 minor@4 max_readahead@8
// flags@12 flags2@16). fuse_init_out, 64 bytes:
//
//	major minor max_readahead flags                    u32 x4
//	max_background congestion_threshold u16 x2 | max_write u32
//	time_gran u32 | max_pages u16 | map_alignment u16
//	flags2 u32 | unused u32 x7
func initOut(arg []byte) (enc, error) {
	major, minor, readahead, offered := le32(arg, 0), le32(arg, 4), le32(arg, 8), le32(arg, 12)
	if major != 7 {
		return nil, fmt.Errorf("fuse: kernel protocol %d.%d, want 7.x", major, minor)
	}
	if minor > fuseMinor {
		minor = fuseMinor
	}
	flags := offered & (initAsyncRead | initAtomicOTrunc | initBigWrites | initDoReaddirplus |
		initParallelDirop | initMaxPages)
	maxWrite := uint32(fuseMaxWrite)
	if flags&initMaxPages == 0 {
		maxWrite = 32 * 4096 // the kernel's default of 32 pages a request
	}
	e := make(enc, 0, 64).u32(7).u32(minor).u32(readahead).u32(flags).
		u16(16).u16(12).u32(maxWrite).u32(1).u16(fuseMaxPages).u16(0).u32(0)
	return append(e, make([]byte, 28)...), nil
}

// writeReply writes a reply: the out header and payload in one writev(2),
// as the device takes a reply only whole. An error reply has no payload.
// ENOENT from the device means the request was interrupted: nobody waits.
func writeReply(fd int, unique uint64, errno syscall.Errno, payload []byte) {
	if errno != 0 {
		payload = nil
	}
	hdr := make(enc, 0, outHeaderSize).u32(uint32(outHeaderSize + len(payload))).
		u32(uint32(-int32(errno))).u64(unique)
	iov := []syscall.Iovec{{Base: &hdr[0]}}
	iov[0].SetLen(len(hdr))
	if len(payload) > 0 {
		v := syscall.Iovec{Base: &payload[0]}
		v.SetLen(len(payload))
		iov = append(iov, v)
	}
	for {
		_, _, e := syscall.Syscall(syscall.SYS_WRITEV, uintptr(fd), uintptr(unsafe.Pointer(&iov[0])), uintptr(len(iov)))
		if e != syscall.EINTR {
			break
		}
	}
	runtime.KeepAlive(hdr)
	runtime.KeepAlive(payload)
}
