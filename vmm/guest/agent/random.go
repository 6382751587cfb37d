package main

// Fresh randomness after a restore. VMs restored from one snapshot (forks,
// sandboxes of one template) start with the kernel's CRNG in one state, so
// until the kernel reseeds on its own (a minute later) they read the same
// /dev/urandom bytes: keys, tokens and UUIDs one sandbox makes, its
// siblings, other teams' among them, would make too. The host sends random
// bytes after every restore; they are added to the input pool as entropy
// (RNDADDENTROPY: a snapshot taken early in a TCG boot has no CRNG ready
// yet, and the credit readies it) and the CRNG is rekeyed from the pool at
// once (RNDRESEEDCRNG). The cloud kernel has no VM generation ID driver
// that would do this itself.

import (
	"encoding/binary"
	"os"
	"syscall"
	"unsafe"
)

const (
	rndAddEntropy = 0x40085203 // _IOW('R', 0x03, int[2]): struct rand_pool_info
	rndReseedCRNG = 0x5207     // _IO('R', 0x07)
)

func reseed(seed []byte) error {
	if len(seed) < 32 || len(seed) > 4096 {
		return fail("invalid", "reseed takes 32 to 4096 bytes")
	}
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	info := make([]byte, 8+len(seed)) // entropy_count (bits), buf_size (bytes), buf
	binary.LittleEndian.PutUint32(info[0:], uint32(8*len(seed)))
	binary.LittleEndian.PutUint32(info[4:], uint32(len(seed)))
	copy(info[8:], seed)
	raw, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var errno syscall.Errno
	if err := raw.Control(func(fd uintptr) {
		if _, _, errno = syscall.Syscall(syscall.SYS_IOCTL, fd, rndAddEntropy, uintptr(unsafe.Pointer(&info[0]))); errno != 0 {
			return
		}
		_, _, errno = syscall.Syscall(syscall.SYS_IOCTL, fd, rndReseedCRNG, 0)
	}); err != nil {
		return err
	}
	if errno != 0 {
		return errno
	}
	return nil
}
