package main

// The guest end of the volume port (README.md, "Volume port"): the FUSE
// server's requests to the node, one JSON line each (plus raw bytes), over
// the virtio-serial port strata.volumes. Here the guest asks and the node
// answers, so this side owns retries: a request unanswered for 2 s is sent
// again with its id, and one unanswered for 60 s fails with EIO.

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"sync"
	"syscall"
	"time"
)

const (
	volPortName = "strata.volumes"
	volMaxLine  = 4 << 20        // a longer reply line is a protocol error
	volMaxRaw   = 1<<20 + 64<<10 // raw bytes after a reply: a read's 1 MiB, and slack
	volTick     = 250 * time.Millisecond
	volResend   = 8   // ticks (2 s) without an answer before a request is sent again
	volGiveUp   = 240 // ticks (60 s) before its caller gets EIO
)

// Time is counted in ticks, not read from the clock: a paused VM's clock
// jumps on `cont`, and a Go ticker drops the ticks it missed, so a pause
// (or a snapshot kept for days) does not count against a request.

var errProtocol = errors.New("volume port: protocol error")

// volPort is the one connection to the node, shared by every mounted volume.
type volPort struct {
	path  string
	host  *hostSignal   // wakes the reader when the node comes back
	busy  chan struct{} // wakes the ticker: a call is outstanding
	mu    sync.Mutex
	f     *os.File // nil while reopening
	next  uint64
	calls map[uint64]*volCall // sent, or to send, and not yet answered
	queue []*volCall          // to (re)send, in order
	kick  chan struct{}       // wakes the writer
}

type volCall struct {
	id     uint64
	line   []byte // the JSON line, with its newline
	raw    []byte // bytes after it (write data); the caller keeps them alive
	done   chan *volMsg
	queued bool // in the queue or being written: not due for a resend
	idle   int  // ticks since it was last written
	age    int  // ticks since it was asked
}

// volMsg is a reply: {"id", "errno", ...}, raw bytes after it in data.
type volMsg struct {
	ID      uint64     `json:"id"`
	Errno   int        `json:"errno"`
	Raw     int        `json:"raw"`
	Attr    *volAttr   `json:"attr"`
	Entries []volEntry `json:"entries"`
	Size    int64      `json:"size"`
	Blocks  uint64     `json:"blocks"`
	Bfree   uint64     `json:"bfree"`
	Files   uint64     `json:"files"`
	Ffree   uint64     `json:"ffree"`
	Bsize   uint32     `json:"bsize"`
	data    []byte
}

// volAttr is an attribute A of the wire format.
type volAttr struct {
	Type   string  `json:"type"` // file directory symlink
	Mode   uint32  `json:"mode"`
	UID    uint32  `json:"uid"`
	GID    uint32  `json:"gid"`
	Size   uint64  `json:"size"`
	Mtime  float64 `json:"mtime"`
	Ctime  float64 `json:"ctime"`
	Target string  `json:"target"`
}

type volEntry struct {
	Name string   `json:"name"`
	Attr *volAttr `json:"attr"`
}

// findPort names the virtio port called name, waiting up to a second for it.
func findPort(name string) (string, error) {
	for i := 0; i < 20; i++ {
		if dev := virtioPort(name); dev != "" {
			return dev, nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return "", fail("not_found", "no virtio port "+name+" in this VM")
}

func openVolPort() (*volPort, error) {
	path, err := findPort(volPortName)
	if err != nil {
		return nil, err
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, err
	}
	p := &volPort{path: path, host: newHostSignal(), busy: make(chan struct{}, 1), f: f,
		calls: map[uint64]*volCall{}, kick: make(chan struct{}, 1)}
	p.host.watch(f)
	go p.readLoop(f)
	go p.writeLoop()
	go p.tickLoop()
	return p, nil
}

// call sends one request and waits for its reply; a non-zero errno from
// the node (or EIO after 60 s) comes back as the error.
func (p *volPort) call(vol, op string, args map[string]any, raw []byte) (*volMsg, syscall.Errno) {
	p.mu.Lock()
	p.next++
	id := p.next
	p.mu.Unlock()
	if args == nil {
		args = map[string]any{}
	}
	args["id"], args["op"], args["vol"] = id, op, vol
	if len(raw) > 0 {
		args["raw"] = len(raw)
	}
	line, err := json.Marshal(args)
	if err != nil {
		return nil, syscall.EINVAL
	}
	c := &volCall{id: id, line: append(line, '\n'), raw: raw, done: make(chan *volMsg, 1)}
	p.mu.Lock()
	p.calls[id] = c
	if len(p.calls) == 1 {
		select {
		case p.busy <- struct{}{}:
		default:
		}
	}
	p.enqueue(c)
	p.mu.Unlock()
	m := <-c.done
	if m.Errno != 0 {
		if m.Errno < 0 || m.Errno > 4095 {
			return m, syscall.EIO
		}
		return m, syscall.Errno(m.Errno)
	}
	return m, 0
}

// enqueue queues c for the writer; p.mu is held.
func (p *volPort) enqueue(c *volCall) {
	if c.queued {
		return
	}
	c.queued = true
	p.queue = append(p.queue, c)
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// finish hands a reply to its caller, once: a repeated reply, or one to a
// request that already failed, finds no call and is dropped.
func (p *volPort) finish(m *volMsg) {
	p.mu.Lock()
	c := p.calls[m.ID]
	delete(p.calls, m.ID)
	p.mu.Unlock()
	if c != nil {
		c.done <- m
	}
}

// writeLoop writes queued requests one whole request at a time (a port
// write takes at most 32 KiB, so a big one is many writes that no other
// request may cut into).
func (p *volPort) writeLoop() {
	for range p.kick {
		for {
			p.mu.Lock()
			if len(p.queue) == 0 || p.f == nil {
				p.mu.Unlock()
				break
			}
			c, f := p.queue[0], p.f
			p.queue = p.queue[1:]
			pending := p.calls[c.id] == c
			p.mu.Unlock()
			var err error
			if pending {
				if _, err = f.Write(c.line); err == nil && len(c.raw) > 0 {
					_, err = f.Write(c.raw)
				}
			}
			p.mu.Lock()
			c.queued, c.idle = false, 0
			if err != nil && p.f != nil && p.f != f { // written to a port closed meanwhile
				p.enqueue(c)
			}
			p.mu.Unlock()
		}
	}
}

// tickLoop resends what waited 2 s and fails what waited 60 s. It ticks
// only while a call is outstanding: an idle guest is not woken 4 times a
// second for nothing.
func (p *volPort) tickLoop() {
	for range p.busy {
		p.tickWhileBusy()
	}
}

func (p *volPort) tickWhileBusy() {
	tick := time.NewTicker(volTick)
	defer tick.Stop()
	for range tick.C {
		var expired []*volCall
		p.mu.Lock()
		for id, c := range p.calls {
			c.age++
			switch {
			case c.age > volGiveUp: // ">": the first tick may come at once
				delete(p.calls, id)
				expired = append(expired, c)
			case !c.queued:
				if c.idle++; c.idle > volResend {
					p.enqueue(c)
				}
			}
		}
		idle := len(p.calls) == 0 // checked under p.mu, as call's wake-up is sent
		p.mu.Unlock()
		for _, c := range expired {
			c.done <- &volMsg{ID: c.id, Errno: int(syscall.EIO)}
		}
		if idle {
			return
		}
	}
}

// readLoop reads replies until the port fails: EOF when the node went
// away (its end closed: a restore, a fork, a node restart), or a protocol
// error. Then it starts over on a fresh open (reopen) and waits for a node.
func (p *volPort) readLoop(f *os.File) {
	r := bufio.NewReaderSize(f, 256<<10)
	for {
		if err := p.readReplies(r); err == errProtocol {
			logf("%v; reopening", err)
		}
		f = p.reopen(f)
		r = bufio.NewReaderSize(f, 256<<10)
		// A port with no node behind it reads EOF at once: wait for the
		// node (hostwait.go) rather than reopen it (each open and close is
		// a message to QEMU; at 10 Hz that cost a TCG guest 8% of a vCPU).
		for {
			if _, err := r.Peek(1); err != io.EOF {
				break
			}
			p.host.wait()
		}
	}
}

// reopen closes the port, which drops what it buffered and stops a write
// cut short by the node leaving (the next node sees no half request),
// opens it again (every 0.1 s until it opens) and sends every unanswered
// request again: the writes wait in the kernel until a node is there.
func (p *volPort) reopen(old *os.File) *os.File {
	p.mu.Lock()
	p.f = nil
	p.mu.Unlock()
	old.Close()
	for {
		time.Sleep(100 * time.Millisecond)
		f, err := os.OpenFile(p.path, os.O_RDWR, 0)
		if err != nil {
			continue
		}
		p.host.watch(f)
		p.mu.Lock()
		p.f = f
		p.requeueAll()
		p.mu.Unlock()
		return f
	}
}

// requeueAll queues every unanswered request again, oldest first; p.mu is held.
func (p *volPort) requeueAll() {
	calls := make([]*volCall, 0, len(p.calls))
	for _, c := range p.calls {
		calls = append(calls, c)
	}
	sort.Slice(calls, func(i, j int) bool { return calls[i].id < calls[j].id })
	for _, c := range calls {
		p.enqueue(c)
	}
	select { // the writer may be idle with requests queued while p.f was nil
	case p.kick <- struct{}{}:
	default:
	}
}

func (p *volPort) readReplies(r *bufio.Reader) error {
	for {
		line, err := readLine(r, volMaxLine)
		if err != nil {
			return err
		}
		var head struct {
			ID  uint64 `json:"id"`
			Raw int    `json:"raw"`
		}
		if json.Unmarshal(line, &head) != nil || head.ID == 0 {
			continue // not a reply: the rest of one cut off by a reopen
		}
		if head.Raw < 0 || head.Raw > volMaxRaw {
			return errProtocol
		}
		m := &volMsg{}
		if err := json.Unmarshal(line, m); err != nil { // the node's bug: fail this call only
			logf("volume port: bad reply %d: %v", head.ID, err)
			m = &volMsg{ID: head.ID, Errno: int(syscall.EIO)}
		}
		if head.Raw > 0 {
			m.data = make([]byte, head.Raw)
			if _, err := io.ReadFull(r, m.data); err != nil {
				return err
			}
		}
		p.finish(m)
	}
}

// readLine returns the next line, at most max bytes, valid until the next read.
func readLine(r *bufio.Reader, max int) ([]byte, error) {
	var line []byte
	for {
		part, err := r.ReadSlice('\n')
		if len(line)+len(part) > max {
			return nil, errProtocol
		}
		if err == nil && line == nil {
			return part, nil
		}
		line = append(line, part...)
		if err != bufio.ErrBufferFull {
			return line, err
		}
	}
}

func logf(format string, a ...any) {
	fmt.Fprintf(os.Stderr, "strata-agent: "+format+"\n", a...)
}
