package main

import (
	"fmt"
	"io"
	"os"
	osuser "os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

const fileBlock = 256 << 10 // bytes of a file per read reply

// Files serves the filesystem ops and holds files open for writing.
type Files struct {
	mu      sync.Mutex
	next    uint64
	writing map[uint64]*upload
}

type upload struct {
	f   *os.File
	err error
}

func newFiles() *Files { return &Files{writing: map[uint64]*upload{}} }

// resolve makes a path absolute: relative paths are under the user's home.
func resolve(path, who string) (string, *user, error) {
	u, err := lookupUser(who)
	if err != nil {
		return "", nil, err
	}
	if path == "" {
		return "", nil, fail("invalid", "path is empty")
	}
	if strings.HasPrefix(path, "~/") || path == "~" {
		path = u.home + path[1:]
	}
	if !filepath.IsAbs(path) {
		path = filepath.Join(u.home, path)
	}
	return filepath.Clean(path), u, nil
}

func (fs *Files) do(req *Request) (*Reply, error) {
	path, u, err := resolve(req.Path, req.User)
	if err != nil {
		return nil, err
	}
	switch req.Op {
	case "stat":
		e, err := entry(path)
		return &Reply{Entry: e}, err
	case "ls":
		entries, err := list(path, req.Depth)
		return &Reply{Entries: entries}, err
	case "mkdir":
		if st, err := os.Stat(path); err == nil {
			if st.IsDir() {
				return nil, fail("exists", fmt.Sprintf("directory %s already exists", path))
			}
			return nil, fail("exists", fmt.Sprintf("%s exists and is not a directory", path))
		}
		if err := mkdirs(path, u); err != nil {
			return nil, err
		}
		e, err := entry(path)
		return &Reply{Entry: e}, err
	case "move":
		dest, _, err := resolve(req.Dest, req.User)
		if err != nil {
			return nil, err
		}
		if _, err := os.Lstat(path); err != nil {
			return nil, err
		}
		if err := mkdirs(filepath.Dir(dest), u); err != nil {
			return nil, err
		}
		if err := os.Rename(path, dest); err != nil {
			return nil, err
		}
		e, err := entry(dest)
		return &Reply{Entry: e}, err
	case "remove":
		if _, err := os.Lstat(path); err != nil {
			return nil, err
		}
		return &Reply{}, os.RemoveAll(path)
	}
	return nil, fail("invalid", "unknown op "+req.Op)
}

// mkdirs makes path and its missing parents, owned by u.
func mkdirs(path string, u *user) error {
	if st, err := os.Stat(path); err == nil {
		if !st.IsDir() {
			return fail("not_dir", path+" is not a directory")
		}
		return nil
	}
	if err := mkdirs(filepath.Dir(path), u); err != nil {
		return err
	}
	if err := os.Mkdir(path, 0o755); err != nil && !os.IsExist(err) {
		return err
	}
	return os.Lchown(path, int(u.uid), int(u.gid))
}

func entry(path string) (*Entry, error) {
	st, err := os.Lstat(path)
	if err != nil {
		return nil, err
	}
	e := &Entry{Name: filepath.Base(path), Path: path}
	if st.Mode()&os.ModeSymlink != 0 {
		if target, err := filepath.EvalSymlinks(path); err == nil {
			e.Symlink = target
		} else if target, err := os.Readlink(path); err == nil {
			e.Symlink = target
		}
		if tst, err := os.Stat(path); err == nil {
			st = tst
		}
	}
	e.Type = "other"
	switch {
	case e.Symlink != "" && st.Mode()&os.ModeSymlink != 0:
		e.Type = "symlink"
	case st.IsDir():
		e.Type = "dir"
	case st.Mode().IsRegular():
		e.Type = "file"
	}
	e.Size, e.Mode, e.Perm = st.Size(), uint32(st.Mode()), st.Mode().String()
	e.Mtime = st.ModTime().UnixNano()
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		e.Owner, e.Group = userName(sys.Uid), groupName(sys.Gid)
	}
	return e, nil
}

func userName(uid uint32) string {
	if u, err := osuser.LookupId(strconv.Itoa(int(uid))); err == nil {
		return u.Username
	}
	return strconv.Itoa(int(uid))
}

func groupName(gid uint32) string {
	if g, err := osuser.LookupGroupId(strconv.Itoa(int(gid))); err == nil {
		return g.Name
	}
	return strconv.Itoa(int(gid))
}

// list walks a directory `depth` levels down (0 or 1: its entries only).
func list(dir string, depth int) ([]Entry, error) {
	st, err := os.Stat(dir)
	if err != nil {
		return nil, err
	}
	if !st.IsDir() {
		return nil, fail("not_dir", dir+" is not a directory")
	}
	if depth < 1 {
		depth = 1
	}
	out := []Entry{}
	var walk func(string, int) error
	walk = func(d string, level int) error {
		names, err := readNames(d)
		if err != nil {
			return err
		}
		for _, n := range names {
			e, err := entry(filepath.Join(d, n))
			if err != nil {
				continue // vanished meanwhile
			}
			out = append(out, *e)
			if e.Type == "dir" && level < depth {
				if err := walk(e.Path, level+1); err != nil && d == dir {
					return err
				}
			}
		}
		return nil
	}
	return out, walk(dir, 1)
}

func readNames(dir string) ([]string, error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	names, err := f.Readdirnames(-1)
	sort.Strings(names)
	return names, err
}

// read streams a file: replies with Data, then one with End and Size.
func (fs *Files) read(a *Agent, req *Request) error {
	path, _, err := resolve(req.Path, req.User)
	if err != nil {
		return err
	}
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if st, err := f.Stat(); err != nil {
		return err
	} else if st.IsDir() {
		return fail("is_dir", path+" is a directory")
	}
	var size int64
	for {
		buf := make([]byte, fileBlock)
		n, err := io.ReadFull(f, buf)
		if n > 0 {
			a.sendStream(&Reply{ID: req.ID, Data: buf[:n], Off: size})
			size += int64(n)
		}
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			break
		}
		if err != nil {
			return err
		}
	}
	a.sendStream(&Reply{ID: req.ID, End: true, Size: size})
	return nil
}

// open starts writing a file (parents made, owned by the user, truncated).
func (fs *Files) open(path, who string) (uint64, error) {
	path, u, err := resolve(path, who)
	if err != nil {
		return 0, err
	}
	if err := mkdirs(filepath.Dir(path), u); err != nil {
		return 0, err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return 0, err
	}
	_ = f.Chown(int(u.uid), int(u.gid))
	fs.mu.Lock()
	defer fs.mu.Unlock()
	fs.next++
	fs.writing[fs.next] = &upload{f: f}
	return fs.next, nil
}

func (fs *Files) write(h uint64, data []byte) {
	fs.mu.Lock()
	up := fs.writing[h]
	fs.mu.Unlock()
	if up != nil && up.err == nil {
		_, up.err = up.f.Write(data)
	}
}

func (fs *Files) close(h uint64) (*Entry, error) {
	fs.mu.Lock()
	up := fs.writing[h]
	delete(fs.writing, h)
	fs.mu.Unlock()
	if up == nil {
		return nil, fail("invalid", fmt.Sprintf("no file open as handle %d", h))
	}
	err := up.err
	if cerr := up.f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, err
	}
	return entry(up.f.Name())
}
