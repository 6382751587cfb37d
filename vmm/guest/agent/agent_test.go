package main

// Unit tests of the agent's pure parts: the FUSE wire (what the guest's
// kernel hands the volume filesystem), the reply framing the node reads,
// and process environments. Run by tests/test_vmm_guest_agent.py (go test).

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"strings"
	"testing"
)

func header(length, op uint32, unique, node uint64) []byte {
	b := make([]byte, inHeaderSize)
	binary.LittleEndian.PutUint32(b[0:], length)
	binary.LittleEndian.PutUint32(b[4:], op)
	binary.LittleEndian.PutUint64(b[8:], unique)
	binary.LittleEndian.PutUint64(b[16:], node)
	binary.LittleEndian.PutUint32(b[24:], 1000)
	binary.LittleEndian.PutUint32(b[28:], 100)
	return b
}

func TestParseReqRefusesShortAndTornRequests(t *testing.T) {
	for _, b := range [][]byte{nil, make([]byte, inHeaderSize-1), header(inHeaderSize+8, 1, 1, 1)} {
		if _, err := parseReq(b); err == nil {
			t.Fatalf("parseReq(%d bytes) took a short or torn request", len(b))
		}
	}
	b := append(header(inHeaderSize+3, 15, 7, 9), 'a', 'b', 0)
	req, err := parseReq(b)
	if err != nil {
		t.Fatal(err)
	}
	if req.op != 15 || req.unique != 7 || req.node != 9 || req.uid != 1000 || req.gid != 100 || string(req.arg) != "ab\x00" {
		t.Fatalf("parsed %+v", req)
	}
}

func TestNamesSplitsAndRefusesANameWithoutItsNUL(t *testing.T) {
	got := names([]byte("old\x00new\x00rest"), 2)
	if len(got) != 2 || got[0] != "old" || got[1] != "new" {
		t.Fatalf("names: %q", got)
	}
	defer func() {
		if recover() == nil {
			t.Fatal("a name without NUL was taken")
		}
	}()
	names([]byte("unterminated"), 1)
}

func TestShortArgumentsPanicForTheRequestGuard(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Fatal("le64 of 3 bytes returned")
		}
	}()
	le64([]byte{1, 2, 3}, 0)
}

func TestDirentRecordsAreWholeAndAlignedToEightBytes(t *testing.T) {
	for n := 0; n < 40; n++ {
		name := strings.Repeat("x", n)
		e := enc(nil).dirent(1, 2, 8, name)
		if len(e) != direntSize(name, false) || len(e)%8 != 0 {
			t.Fatalf("dirent of a %d-byte name: %d bytes, size says %d", n, len(e), direntSize(name, false))
		}
		if direntSize(name, true) != direntSize(name, false)+128 {
			t.Fatalf("readdirplus size of a %d-byte name", n)
		}
	}
}

func TestSplitTimeKeepsNanosecondsBelowASecond(t *testing.T) {
	cases := []struct {
		in  float64
		s   uint64
		max uint32
	}{{1.5, 1, 500000001}, {0, 0, 1}, {-3, 0, 1}, {1.9999999999, 1, 1000000000}}
	for _, c := range cases {
		s, ns := splitTime(c.in)
		if s != c.s || ns >= c.max || ns >= 1e9 {
			t.Fatalf("splitTime(%v) = %d, %d", c.in, s, ns)
		}
	}
}

func TestInitOffersOnlyWhatTheAgentSupports(t *testing.T) {
	arg := make([]byte, 20)
	binary.LittleEndian.PutUint32(arg[0:], 7)
	binary.LittleEndian.PutUint32(arg[4:], 40)
	binary.LittleEndian.PutUint32(arg[8:], 1<<17)
	binary.LittleEndian.PutUint32(arg[12:], 0xffffffff)
	out, err := initOut(arg)
	if err != nil {
		t.Fatal(err)
	}
	if len(out) != 64 || le32(out, 4) != fuseMinor {
		t.Fatalf("init reply: %d bytes, minor %d", len(out), le32(out, 4))
	}
	supported := uint32(initAsyncRead | initAtomicOTrunc | initBigWrites | initDoReaddirplus | initParallelDirop |
		initMaxPages)
	if flags := le32(out, 12); flags&^supported != 0 {
		t.Fatalf("init offered flags %#x beyond %#x", flags, supported)
	}
	binary.LittleEndian.PutUint32(arg[0:], 6)
	if _, err := initOut(arg); err == nil {
		t.Fatal("protocol 6 was taken")
	}
}

func TestAReplyIsOneLineWithItsDataRawAfterIt(t *testing.T) {
	data := []byte("two\nlines\n\x00")
	b := encode(&Reply{ID: 3, Pid: 7, Data: data, Error: "quote \" and newline \n"})
	i := bytes.IndexByte(b, '\n')
	var r Reply
	if err := json.Unmarshal(b[:i], &r); err != nil {
		t.Fatal(err)
	}
	if r.ID != 3 || r.Raw != len(data) || r.Data != nil || !bytes.Equal(b[i+1:], data) {
		t.Fatalf("reply %+v then %q", r, b[i+1:])
	}
}

func TestTheEnvironmentIsTheUsersWithTheRequestsOnTop(t *testing.T) {
	env := environ(&user{name: "user", home: "/home/user"}, map[string]string{"HOME": "/srv", "X": "1"}, true)
	want := map[string]bool{"HOME=/srv": true, "USER=user": true, "LOGNAME=user": true, "X=1": true,
		"TERM=xterm-256color": true, "PATH=" + defaultPath: true}
	if len(env) != len(want) {
		t.Fatalf("environ: %q", env)
	}
	for i, kv := range env {
		if !want[kv] || (i > 0 && env[i-1] > kv) {
			t.Fatalf("environ: %q", env)
		}
	}
}
