package main

// Fresh randomness after a restore. VMs restored from one snapshot (forks,
// sandboxes of one template) start with the kernel's CRNG in one state, so
// until the kernel reseeds on its own (a minute later) they read the same
// /dev/urandom bytes: keys, tokens and UUIDs one sandbox makes, its
// siblings, other teams' among them, would make too. The host sends random
// bytes after every restore; they are mixed into the input pool, and the
// CRNG is rekeyed from it at once (RNDRESEEDCRNG). The cloud kernel has no
// VM generation ID driver that would do this itself.

import (
	"os"
	"syscall"
)

const rndReseedCRNG = 0x5207 // _IO('R', 0x07)

func reseed(seed []byte) error {
	if len(seed) < 32 {
		return fail("invalid", "reseed takes at least 32 bytes")
	}
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.Write(seed); err != nil {
		return err
	}
	raw, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var errno syscall.Errno
	if err := raw.Control(func(fd uintptr) {
		_, _, errno = syscall.Syscall(syscall.SYS_IOCTL, fd, rndReseedCRNG, 0)
	}); err != nil {
		return err
	}
	if errno != 0 {
		return errno
	}
	return nil
}
