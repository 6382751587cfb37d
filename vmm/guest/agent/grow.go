package main

import (
	"os"
	"strconv"
	"strings"
	"syscall"
	"unsafe"
)

// ext4's online resize ioctl: _IOW('f', 16, __u64), the new size in blocks.
const ext4ResizeFS = 0x40086610

// growRoot grows the root ext4 filesystem to fill its disk, online: a
// sandbox's disk may be larger than the image it was made from. Idempotent
// (a filesystem that fills its disk is left alone); returns what it did.
func growRoot(dev string) string {
	raw, err := os.ReadFile("/sys/class/block/" + dev + "/size")
	if err != nil {
		return ""
	}
	sectors, err := strconv.ParseUint(strings.TrimSpace(string(raw)), 10, 64)
	if err != nil {
		return ""
	}
	var st syscall.Statfs_t
	if syscall.Statfs("/", &st) != nil || st.Type != 0xEF53 || st.Bsize <= 0 {
		return "" // not ext4
	}
	blocks := sectors * 512 / uint64(st.Bsize)
	if blocks <= st.Blocks+uint64(st.Blocks)/100 { // already (nearly) fills the disk
		return ""
	}
	root, err := os.Open("/")
	if err != nil {
		return "grow: " + err.Error()
	}
	defer root.Close()
	if err := ioctl(root.Fd(), ext4ResizeFS, unsafe.Pointer(&blocks)); err != nil {
		return "grow root to " + strconv.FormatUint(blocks, 10) + " blocks: " + err.Error()
	}
	return "grew the root filesystem to " + strconv.FormatUint(blocks*uint64(st.Bsize)>>20, 10) + " MiB"
}
