"""Rows: one team against another's volume, through the control plane and
the volume content API. Another team's volume answers as a missing one; the
content API wants that volume's own token; no path leaves the volume. And a
guest against the store's index of its mounted volume, over the node's end of
the volume port (tests/test_vmm_volumeport.py's stand-in for the guest)."""

from __future__ import annotations

import httpx
import pytest

from tests.attacks.lab import Lab
from tests.test_vmm_volumeport import served  # noqa: F401 (the volume port's fixture)


@pytest.fixture(scope="module")
def volume(lab: Lab) -> dict:
    r = lab.alpha.post("/volumes", json={"name": "alpha-data"})
    assert r.status_code == 201, r.text
    vol = r.json()
    r = httpx.put(f"{lab.node.url}/volumecontent/{vol['volumeID']}/file", params={"path": "/secret"},
                  content=b"alpha's secret", headers={"Authorization": f"Bearer {vol['token']}"})
    assert r.status_code == 201, r.text
    return vol


def test_another_teams_volume_is_missing(lab: Lab, volume: dict) -> None:
    """attacker: team beta, knowing alpha's volume id.  target: alpha's
    volume and its token.  attempt: list, get (which would hand out the
    token), destroy.  must: 404 as for a missing one; nothing listed; the
    volume and its file stay."""
    vid = volume["volumeID"]
    assert vid not in lab.beta.get("/volumes").text
    for method in ("GET", "DELETE"):
        r = lab.beta.request(method, f"/volumes/{vid}")
        assert r.status_code == 404 and volume["token"] not in r.text, r.text
    assert lab.alpha.get(f"/volumes/{vid}").json()["token"] == volume["token"]


def test_the_content_api_wants_the_volumes_own_token(lab: Lab, volume: dict) -> None:
    """attacker: team beta, with its API key and a volume (and token) of its
    own.  target: alpha's file.  attempt: reading and deleting it with
    beta's key, beta's volume token, no token, a guessed one.  must: 401,
    the same as for an unknown volume; the file stays."""
    own = lab.beta.post("/volumes", json={"name": "beta-data"}).json()
    vid = volume["volumeID"]
    for headers in ({"X-API-Key": lab.beta.headers["X-API-Key"]}, {"Authorization": f"Bearer {own['token']}"}, {},
                    {"Authorization": "Bearer " + "0" * 64}):
        for method in ("GET", "DELETE"):
            what = "file" if method == "GET" else "path"
            r = httpx.request(method, f"{lab.node.url}/volumecontent/{vid}/{what}", params={"path": "/secret"},
                              headers=headers)
            assert r.status_code == 401 and b"alpha's secret" not in r.content, (headers, r.text)
    r = httpx.get(f"{lab.node.url}/volumecontent/{vid}/file", params={"path": "/secret"},
                  headers={"Authorization": f"Bearer {volume['token']}"})
    assert r.content == b"alpha's secret"


@pytest.mark.parametrize("path", ["../../etc/passwd", "/../secret", "/secret/../../x", "..", "/a/\0"])
def test_no_path_leaves_the_volume(lab: Lab, volume: dict, path: str) -> None:
    """attacker: a holder of a volume token.  target: the node's files
    beside the volume.  attempt: paths with `..` and NUL on read and write.
    must: 400, nothing read or written."""
    base = f"{lab.node.url}/volumecontent/{volume['volumeID']}"
    auth = {"Authorization": f"Bearer {volume['token']}"}
    assert httpx.get(f"{base}/file", params={"path": path}, headers=auth).status_code == 400
    assert httpx.put(f"{base}/file", params={"path": path}, content=b"x", headers=auth).status_code == 400
    listed = httpx.get(f"{base}/dir", params={"path": "/"}, headers=auth).json()
    assert [e["path"] for e in listed] == ["/secret"]


def test_another_teams_volume_cannot_be_mounted(lab: Lab, volume: dict) -> None:
    """attacker: team beta, knowing the name and id of alpha's volume.
    target: alpha's files, by mounting the volume in a sandbox of beta's.
    attempt: volumeMounts by alpha's volume name and by its id.  must: 404
    as for a missing volume, before any sandbox is made; beta holds no
    sandbox afterwards."""
    image = lab.own_image(lab.beta, "guest:beta")
    before = lab.beta.get("/v2/sandboxes").json()
    for name in ("alpha-data", volume["volumeID"]):
        r = lab.beta.post("/sandboxes", json={"templateID": image, "timeout": 60,
                                              "volumeMounts": [{"name": name, "path": "/mnt/x"}]})
        assert r.status_code == 404 and volume["token"] not in r.text, r.text
    assert lab.beta.get("/v2/sandboxes").json() == before


def test_a_guests_rename_cannot_make_the_volume_index_unreadable(served) -> None:  # noqa: F811
    """attacker: root in a guest with a volume mounted.  target: the volume's index in the store,
    which every team's GC reads.  attempt: rename a directory to a longer name, so that a path
    under it passes MAX_PATH (4096).  must: ENAMETOOLONG, the index unchanged and readable, a
    rename within the limit still moves, and GC plans over the store."""
    import errno

    from layerstore import gc

    store, volumes, vid, _, guest, _ = served
    path = "d"
    guest.ok("mkdir", vid, path=path, mode=0o755)
    for part in ["x" * 250] * 15 + ["y" * 200]:  # a child 3,967 characters deep
        path += "/" + part
        guest.ok("mkdir", vid, path=path, mode=0o755)
    before = volumes.get(vid)
    assert guest.call("rename", vid, path="d", to="z" * 200)[0]["errno"] == errno.ENAMETOOLONG
    assert volumes.get(vid) == before
    assert guest.ok("rename", vid, path="d", to="z" * 100)  # still within the limit: moved
    assert max(len(p) for p in volumes.get(vid).entries) == len(path) + 99
    gc.plan(store)  # reads every index strictly enough to keep what it names


@pytest.mark.parametrize("how", ["create", "open-trunc", "write"])
def test_a_guest_cannot_stage_more_files_than_the_open_file_cap(served, how: str,  # noqa: F811
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """attacker: root in a guest with a volume mounted.  target: the node's staging space and memory
    for the volume's open files (vmm/volumefs.py).  attempt: open MAX_OPEN + 50 files for writing
    without closing any, by create, by open with O_TRUNC, or by writing to handles never opened
    (MAX_OPEN set to 32 here, for time: each create rewrites the index).  must: EMFILE past
    MAX_OPEN whichever way, nothing of the refused ones staged; once one is closed, one more
    opens."""
    import errno

    from vmm import volumefs

    monkeypatch.setattr(volumefs, "MAX_OPEN", 32)
    MAX_OPEN = volumefs.MAX_OPEN
    _, _, vid, _, guest, port = served
    files = port._volumes[vid]
    if how != "create":
        for n in range(MAX_OPEN + 50):
            guest.ok("create", vid, path=f"f{n}", mode=0o644, fh=100_000 + n)
            guest.ok("release", vid, fh=100_000 + n, path=f"f{n}")
    answers = []
    for n in range(MAX_OPEN + 50):
        if how == "create":
            answers.append(guest.call("create", vid, path=f"f{n}", mode=0o644, fh=n)[0]["errno"])
        elif how == "open-trunc":
            answers.append(guest.call("open", vid, path=f"f{n}", fh=n, trunc=True)[0]["errno"])
        else:
            answers.append(guest.call("write", vid, b"x", fh=n, path=f"f{n}", off=0)[0]["errno"])
    assert answers[:MAX_OPEN] == [0] * MAX_OPEN and set(answers[MAX_OPEN:]) == {errno.EMFILE}
    assert len(files._staged) == MAX_OPEN and len(list(files._staging_dir.iterdir())) == MAX_OPEN
    guest.ok("release", vid, fh=0, path="f0")
    assert guest.call("open", vid, path="f0", fh=0, trunc=True)[0]["errno"] == 0


def test_handles_a_guest_never_opened_leave_nothing_behind(served) -> None:  # noqa: F811
    """attacker: root in a guest with a volume mounted.  target: the node's memory (a lock was kept
    for every file handle a request named).  attempt: 6,000 flushes, releases and failing writes on
    handles never opened.  must: each answered, and the node holds no lock for any of them."""
    _, _, vid, _, guest, port = served
    files = port._volumes[vid]
    for fh in range(6_000):
        op = ("flush", "release", "write")[fh % 3]
        guest.call(op, vid, b"x" if op == "write" else b"", fh=10_000 + fh, path="missing", off=0)
    assert files._fh_locks == {}
    assert port.alive()


def _requests():
    """Hypothesis: a short run of volume-port requests as a hostile guest writes them."""
    from hypothesis import strategies as st

    names = st.sampled_from(["", "a", "a/b", "b", "..", "../x", "a/../../b", "/abs", "x" * 300, "d/" * 40 + "f",
                             "nul\0byte", "é", ".", "a//b"])
    values = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
                       st.floats(allow_nan=True), st.text(max_size=20), names,
                       st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
    ops = st.sampled_from(["stat", "list", "read", "create", "open", "write", "flush", "release", "setattr", "mkdir",
                           "symlink", "unlink", "rmdir", "rename", "statfs", "chown_everything", ""])
    fields = st.dictionaries(st.sampled_from(["path", "fh", "off", "len", "mode", "uid", "gid", "size", "mtime",
                                              "target", "to", "trunc", "noreplace"]), values, max_size=6)
    request = st.tuples(ops, st.sampled_from(["mounted", "other", "unknown"]), fields, st.binary(max_size=64))
    return st.lists(request, min_size=1, max_size=12)


def test_generated_requests_get_an_errno_and_leave_the_index_readable(served) -> None:  # noqa: F811
    """attacker: root in a guest with a volume mounted.  target: the node's end of the volume
    port (vmm/volumeport.py, vmm/volumefs.py) and the volume's index.  attempt: runs of requests
    generated by hypothesis: every op and unknown ones, fields of every JSON type (huge and
    negative integers, NaN, lists, `..` and NUL in paths), another team's volume, raw bytes.
    must: each request answered with its id and an errno (0 or one the guest can return), the
    port alive, and the volume's index still one every reader parses."""
    from hypothesis import HealthCheck, given, settings

    _, volumes, vid, other, guest, port = served
    which = {"mounted": vid, "other": other, "unknown": "vol" + "0" * 16}

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(_requests())
    def run(requests: list) -> None:
        for op, vol, fields, raw in requests:
            fields = {k: v for k, v in fields.items() if k not in ("id", "op", "vol", "raw")}
            reply, _ = guest.call(op, which[vol], raw if op == "write" else b"", **fields)
            assert isinstance(reply.get("errno"), int) and 0 <= reply["errno"] < 256, reply
        assert port.alive()
        volumes.get(vid)  # parses, every entry checked as any reader checks it

    run()
