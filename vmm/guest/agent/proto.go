package main

// The wire format: one JSON object per line in each direction (README.md,
// "Agent protocol"). Byte fields ([]byte) travel as standard base64.

// Request is every host -> guest message; Op says which fields matter.
type Request struct {
	ID        uint64            `json:"id"`
	Op        string            `json:"op"`
	Session   string            `json:"session,omitempty"` // hello: the host connection's id
	Cmd       string            `json:"cmd,omitempty"`
	Args      []string          `json:"args,omitempty"`
	Env       map[string]string `json:"env,omitempty"`
	Cwd       string            `json:"cwd,omitempty"`
	User      string            `json:"user,omitempty"`
	Tag       string            `json:"tag,omitempty"`
	Stdin     bool              `json:"stdin,omitempty"`
	Merge     bool              `json:"merge,omitempty"` // stderr into stdout's pipe (fd 1), in order
	Pty       *Size             `json:"pty,omitempty"`
	Pid       int               `json:"pid,omitempty"`
	From      int64             `json:"from,omitempty"` // attach: replay output from this offset; -1: only new output
	Sig       int               `json:"sig,omitempty"`
	Data      []byte            `json:"data,omitempty"`
	Raw       int               `json:"raw,omitempty"` // this many raw bytes follow the line: Data, without base64
	Path      string            `json:"path,omitempty"`
	Dest      string            `json:"dest,omitempty"`
	Depth     int               `json:"depth,omitempty"`
	Recursive bool              `json:"recursive,omitempty"`
	Handle    uint64            `json:"handle,omitempty"`
	Target    uint64            `json:"target,omitempty"` // cancel: the id of the stream to stop
	Volume    string            `json:"volume,omitempty"` // mount_volume: the volume's id
}

// Size is a terminal size.
type Size struct {
	Cols uint16 `json:"cols"`
	Rows uint16 `json:"rows"`
}

// Reply is every guest -> host message. A request gets exactly one reply
// with End set (or an Error); streams send more replies before it.
type Reply struct {
	ID      uint64     `json:"id"`
	Error   string     `json:"error,omitempty"`
	Code    string     `json:"code,omitempty"` // not_found exists invalid denied not_dir is_dir no_space busy internal
	End     bool       `json:"end,omitempty"`
	Version string     `json:"version,omitempty"`
	Boot    string     `json:"boot,omitempty"`
	Pid     int        `json:"pid,omitempty"`
	Fd      int        `json:"fd,omitempty"` // 1 stdout, 2 stderr, 3 pty
	Data    []byte     `json:"data,omitempty"`
	Raw     int        `json:"raw,omitempty"`  // Data follows the line as this many raw bytes (not in the JSON)
	Off     int64      `json:"off,omitempty"`  // offset of Data in the process's output
	Lost    int64      `json:"lost,omitempty"` // output bytes dropped before Off (ring overrun)
	Exit    *Exit      `json:"exit,omitempty"`
	Entry   *Entry     `json:"entry,omitempty"`
	Entries []Entry    `json:"entries,omitempty"`
	Procs   []ProcInfo `json:"procs,omitempty"`
	Handle  uint64     `json:"handle,omitempty"`
	Event   *FsEvent   `json:"event,omitempty"`
	Size    int64      `json:"size,omitempty"`
	Metrics *Metrics   `json:"metrics,omitempty"`
}

// Exit is how a process ended.
type Exit struct {
	Code   int    `json:"code"`
	Signal int    `json:"signal,omitempty"`
	Status string `json:"status"`
}

// ProcInfo describes a process the agent started.
type ProcInfo struct {
	Pid  int               `json:"pid"`
	Tag  string            `json:"tag,omitempty"`
	Cmd  string            `json:"cmd"`
	Args []string          `json:"args"`
	Env  map[string]string `json:"env"`
	Cwd  string            `json:"cwd"`
}

// Entry describes a file.
type Entry struct {
	Name    string `json:"name"`
	Type    string `json:"type"` // file dir symlink other
	Path    string `json:"path"`
	Size    int64  `json:"size"`
	Mode    uint32 `json:"mode"`
	Perm    string `json:"perm"`
	Owner   string `json:"owner"`
	Group   string `json:"group"`
	Mtime   int64  `json:"mtime_ns"`
	Symlink string `json:"symlink,omitempty"`
}

// FsEvent is one change under a watched directory.
type FsEvent struct {
	Name string `json:"name"`
	Type string `json:"type"` // create write remove rename chmod
}

type codedError struct {
	code string
	msg  string
}

func (e *codedError) Error() string { return e.msg }

func fail(code, msg string) error { return &codedError{code, msg} }
