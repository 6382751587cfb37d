package main

import (
	"fmt"
	"os"
	"syscall"
	"unsafe"
)

func ioctl(fd uintptr, req uintptr, arg unsafe.Pointer) error {
	if _, _, e := syscall.Syscall(syscall.SYS_IOCTL, fd, req, uintptr(arg)); e != 0 {
		return e
	}
	return nil
}

// openPty opens a pseudo-terminal pair, mounting devpts first if the root
// filesystem's init did not.
func openPty(size *Size) (*os.File, *os.File, error) {
	if _, err := os.Stat("/dev/pts/ptmx"); err != nil {
		_ = os.MkdirAll("/dev/pts", 0o755)
		_ = syscall.Mount("devpts", "/dev/pts", "devpts", 0, "ptmxmode=0666,mode=0620")
	}
	master, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		return nil, nil, fail("internal", "cannot open a terminal: "+err.Error())
	}
	var unlock int32
	var n uint32
	if err := ioctl(master.Fd(), syscall.TIOCSPTLCK, unsafe.Pointer(&unlock)); err != nil {
		master.Close()
		return nil, nil, err
	}
	if err := ioctl(master.Fd(), syscall.TIOCGPTN, unsafe.Pointer(&n)); err != nil {
		master.Close()
		return nil, nil, err
	}
	slave, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		master.Close()
		return nil, nil, err
	}
	if err := setSize(master, size); err != nil {
		master.Close()
		slave.Close()
		return nil, nil, err
	}
	return master, slave, nil
}

func setSize(f *os.File, size *Size) error {
	ws := struct{ rows, cols, x, y uint16 }{size.Rows, size.Cols, 0, 0}
	return ioctl(f.Fd(), syscall.TIOCSWINSZ, unsafe.Pointer(&ws))
}
