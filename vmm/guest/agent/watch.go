package main

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
	"unsafe"
)

const watchMask = syscall.IN_CREATE | syscall.IN_MODIFY | syscall.IN_DELETE | syscall.IN_MOVED_FROM |
	syscall.IN_MOVED_TO | syscall.IN_ATTRIB | syscall.IN_DELETE_SELF | syscall.IN_CLOSE_WRITE

// watcher streams inotify events under one directory (and its subdirectories
// when recursive; directories created later are added as they appear).
type watcher struct {
	fd        int
	root      string
	recursive bool
	dirs      map[int32]string // watch descriptor -> directory
}

func newWatcher(path string, recursive bool) (*watcher, error) {
	path, _, err := resolve(path, "")
	if err != nil {
		return nil, err
	}
	if st, err := os.Stat(path); err != nil {
		return nil, err
	} else if !st.IsDir() {
		return nil, fail("not_dir", path+" is not a directory")
	}
	fd, err := syscall.InotifyInit1(syscall.IN_CLOEXEC | syscall.IN_NONBLOCK)
	if err != nil {
		return nil, err
	}
	w := &watcher{fd: fd, root: path, recursive: recursive, dirs: map[int32]string{}}
	if err := w.add(path); err != nil {
		syscall.Close(fd)
		return nil, err
	}
	return w, nil
}

func (w *watcher) add(dir string) error {
	wd, err := syscall.InotifyAddWatch(w.fd, dir, watchMask)
	if err != nil {
		return err
	}
	w.dirs[int32(wd)] = dir
	if !w.recursive {
		return nil
	}
	names, _ := readNames(dir)
	for _, n := range names {
		p := filepath.Join(dir, n)
		if st, err := os.Lstat(p); err == nil && st.IsDir() {
			_ = w.add(p)
		}
	}
	return nil
}

// run polls (the fd is non-blocking so a cancelled stream ends promptly).
func (w *watcher) run(a *Agent, id uint64, stop chan struct{}) {
	defer syscall.Close(w.fd)
	a.sendStream(&Reply{ID: id}) // started
	buf := make([]byte, 64<<10)
	for !stopped(stop) {
		n, err := syscall.Read(w.fd, buf)
		if err == syscall.EAGAIN || n <= 0 {
			time.Sleep(50 * time.Millisecond)
			continue
		}
		for off := 0; off+syscall.SizeofInotifyEvent <= n; {
			ev := (*syscall.InotifyEvent)(unsafe.Pointer(&buf[off]))
			name := strings.TrimRight(string(buf[off+syscall.SizeofInotifyEvent:off+syscall.SizeofInotifyEvent+int(ev.Len)]), "\x00")
			off += syscall.SizeofInotifyEvent + int(ev.Len)
			dir, ok := w.dirs[ev.Wd]
			if !ok || name == "" {
				continue
			}
			full := filepath.Join(dir, name)
			if ev.Mask&syscall.IN_ISDIR != 0 && ev.Mask&(syscall.IN_CREATE|syscall.IN_MOVED_TO) != 0 && w.recursive {
				_ = w.add(full)
			}
			if kind := eventKind(ev.Mask); kind != "" {
				rel, _ := filepath.Rel(w.root, full)
				a.sendStream(&Reply{ID: id, Event: &FsEvent{Name: rel, Type: kind}})
			}
		}
	}
}

func eventKind(mask uint32) string {
	switch {
	case mask&syscall.IN_CREATE != 0, mask&syscall.IN_MOVED_TO != 0:
		return "create"
	case mask&syscall.IN_MODIFY != 0:
		return "write"
	case mask&syscall.IN_DELETE != 0:
		return "remove"
	case mask&syscall.IN_MOVED_FROM != 0:
		return "rename"
	case mask&syscall.IN_ATTRIB != 0:
		return "chmod"
	}
	return ""
}
