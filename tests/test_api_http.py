"""The HTTP layer alone, in-process, over a stand-in node: authentication,
the error mapping, and the headers routes add (Server-Timing, X-Next-Token,
Should-Retry). Seconds, no VMM; tests/test_api.py covers a real node."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.exceptions import Capacity
from api.metrics import Metrics
from layerstore.errors import NotFound
from vmm.registry import SandboxRecord

KEY, ADMIN = "api-key-0001", "admin-key-0001"


def _record(sid: str, created: float, state: str = "running") -> SandboxRecord:
    return SandboxRecord(sid=sid, backend="qemu", source="image:guest:v1", memory_mib=256, state=state,
                         created=created, template="base", metadata={"owner": "me"}, end_at=created + 60)


class StandIn:
    """The node's methods the routes under test call, and nothing else (its
    lifecycle's too: the routes call `node.lifecycle.create`, ...)."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(api_keys=(("default", KEY), ("ops", ADMIN)), admin_keys=(("ops", ADMIN),),
                                      max_streams=1024, team_max_streams={"*": 256},
                                      team_limit=lambda limits, team: limits.get(team, limits.get("*")))
        self.metrics = Metrics()
        self.vmm_seconds = 0.0
        self.domain = None
        self.lifecycle = self

    def take_vmm_seconds(self) -> float:
        taken, self.vmm_seconds = self.vmm_seconds, 0.0
        return taken

    def create(self, _caller: object, template_id: str, **_: object) -> SandboxRecord:
        if template_id == "full":
            raise Capacity("this node holds 2 sandboxes; the limit is 2")
        if template_id == "bug":
            raise OSError(28, "No space left on device")
        self.vmm_seconds = 0.25
        return _record("sb1", time.time())

    def egress(self, *_: object) -> None:
        return None

    def kill(self, _caller: object, sid: str) -> None:
        raise NotFound(f"sandbox {sid} not found")

    def health(self, _caller: object = None):  # noqa: ANN201
        from api import models as m

        return m.Health(status="ok", store="s3://bucket/secret-prefix", mount=True, sandboxes=3)

    def list_sandboxes_page(self, _caller: object, *, limit: int, token: str | None, **_: object) -> tuple[list, str | None]:
        from api import listing, models as m

        rows, next_token = listing.page([_record(f"sb{i}", 1000.0 + i) for i in range(3)], order="desc",
                                        limit=limit, token=token)
        return [m.ListedSandbox.of(r, disk_mb=0) for r in rows], next_token


@pytest.fixture()
def client() -> TestClient:
    return TestClient(create_app(StandIn()), headers={"X-API-Key": KEY})  # type: ignore[arg-type]


def test_auth_and_openapi(client: TestClient) -> None:
    assert client.get("/v2/sandboxes", headers={"X-API-Key": "wrong-key-123"}).json()["code"] == 401
    assert client.get("/admin/sandboxes").status_code == 403
    assert client.get("/openapi.json", headers={"X-API-Key": ""}).status_code == 401
    assert client.get("/openapi.json").json()["info"]["title"] == "Strata node API"
    assert client.get("/docs").status_code == 404


def test_errors_and_headers(client: TestClient) -> None:
    r = client.post("/sandboxes", json={"templateID": "base"})
    assert r.status_code == 201 and r.headers["Server-Timing"] == "vmm;dur=250.00", r.text
    assert r.json()["sandboxID"] == "sb1" and r.json()["envdVersion"]
    r = client.post("/sandboxes", json={"templateID": "full"})
    assert r.status_code == 429 and r.headers["Should-Retry"] == "false" and "limit is 2" in r.json()["message"]
    r = client.delete("/sandboxes/nope")
    assert r.status_code == 404 and r.json() == {"code": 404, "message": "sandbox nope not found"}
    assert "Server-Timing" not in r.headers
    r = client.post("/sandboxes", json={"templateID": 5})
    assert r.status_code == 400 and r.json()["message"].startswith("invalid request: templateID")


def test_an_unexpected_exception_is_a_500_that_names_it() -> None:
    client = TestClient(create_app(StandIn()), headers={"X-API-Key": KEY}, raise_server_exceptions=False)  # type: ignore[arg-type]
    r = client.post("/sandboxes", json={"templateID": "bug"})
    assert r.status_code == 500
    assert r.json()["message"].startswith("internal error (OSError: [Errno 28] No space left on device)")
    assert client.get("/health").status_code == 200  # and the service goes on


def test_pages(client: TestClient) -> None:
    first = client.get("/v2/sandboxes", params={"limit": 2})
    assert [s["sandboxID"] for s in first.json()] == ["sb2", "sb1"]
    rest = client.get("/v2/sandboxes", params={"limit": 2, "nextToken": first.headers["X-Next-Token"]})
    assert [s["sandboxID"] for s in rest.json()] == ["sb0"] and "X-Next-Token" not in rest.headers
    assert client.get("/v2/sandboxes", params={"nextToken": "abc"}).status_code == 400


def test_no_key_is_401_before_the_body_is_read(client: TestClient) -> None:
    """An anonymous request is refused before parsing: malformed JSON without a
    key is 401 (it was 400), and a body is never buffered for it."""
    anonymous = {"X-API-Key": ""}
    r = client.post("/sandboxes", content=b"{not json", headers={**anonymous, "Content-Type": "application/json"})
    assert r.status_code == 401 and r.json() == {"code": 401, "message": "missing or invalid X-API-Key"}
    r = client.put("/images/big:v1", content=b"x" * (1 << 20), headers=anonymous)
    assert r.status_code == 401
    r = client.post("/sandboxes", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400  # with a key: the body is read, and it is malformed


def test_health_without_a_key_shows_status_only(client: TestClient) -> None:
    r = client.get("/health", headers={"X-API-Key": ""})
    assert r.status_code == 200 and r.json() == {"status": "ok"}  # not the store's name
    assert client.get("/health").json()["store"] == "s3://bucket/secret-prefix"


def test_metrics_label_only_known_methods(client: TestClient) -> None:
    for i in range(20):
        client.request(f"BREW{i}", "/v2/sandboxes")
    assert client.get("/metrics").status_code == 403  # every team's sandboxes: admins only
    rendered = client.get("/metrics", headers={"X-API-Key": ADMIN}).text
    assert "BREW" not in rendered and 'method="other"' in rendered


# --- long work and short requests (api/limits.py) ------------------------------------------

class Blocking(StandIn):
    """A node whose execs block until `release` is set, as a guest command
    that runs for minutes would; team alpha and team beta have keys too."""

    def __init__(self, **limits: object) -> None:
        super().__init__()
        self.config.api_keys += (("alpha", ALPHA), ("beta", BETA))
        vars(self.config).update(limits)
        self.release = threading.Event()
        self.running = 0

    def exec(self, _caller: object, sid: str, command: str, timeout: float) -> SimpleNamespace:
        self.running += 1
        self.release.wait(60)
        return SimpleNamespace(exit_code=0, output=f"{command} in {sid}\n", dropped=0)


    def metrics_of(self, caller: object, sid: str) -> tuple:
        """A guest that does not answer, for as long as `release` is unset (its agent would give up after 30 s)."""
        self.running += 1
        self.release.wait(60)
        raise NotFound(f"sandbox {sid} not found")


ALPHA, BETA = "alpha-key-0001", "beta-key-0001"


async def _serve(node: StandIn, work: Callable[[httpx.AsyncClient], Awaitable[None]]) -> None:
    """`work` against the app of `node`, in this event loop, lifespan included
    (it sizes the worker threads as `strata serve` does)."""
    app = create_app(node)  # type: ignore[arg-type]
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://node", timeout=30) as client:
            await work(client)


async def _until(check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_600_long_execs_of_one_team_leave_short_requests_answered() -> None:
    """The issue's attack in-process: team beta runs 600 execs that never end
    (its limit raised to 600 here, so none is refused: the point is the
    threads, not the quota). Short requests of another team are answered;
    they wait for no thread beta holds."""
    node = Blocking(team_max_streams={"beta": 600, "*": 256})

    async def work(client: httpx.AsyncClient) -> None:
        beta = {"X-API-Key": BETA}
        execs = [asyncio.create_task(client.post("/sandboxes/sb1/exec", json={"command": "sleep 3000"}, headers=beta))
                 for _ in range(600)]
        await _until(lambda: node.running >= 512)  # as many as there are threads for short requests
        for _ in range(3):
            r = await asyncio.wait_for(client.get("/v2/sandboxes", headers={"X-API-Key": ALPHA}), 10)
            assert r.status_code == 200, r.text
            r = await asyncio.wait_for(client.post("/sandboxes", json={"templateID": "base"},
                                                   headers={"X-API-Key": ALPHA}), 10)
            assert r.status_code == 201, r.text
        await _until(lambda: node.running == 600)
        r = await asyncio.wait_for(client.post("/sandboxes/sb1/exec", json={"command": "true"}, headers=beta), 10)
        assert r.status_code == 429 and "team_max_streams" in r.json()["message"], r.text
        node.release.set()
        assert {(await e).status_code for e in execs} == {200}

    asyncio.run(work_with_timeout(node, work))


async def work_with_timeout(node: StandIn, work: Callable[[httpx.AsyncClient], Awaitable[None]]) -> None:
    try:
        await asyncio.wait_for(_serve(node, work), 120)
    finally:
        node.release.set()  # type: ignore[attr-defined]


def test_a_team_cannot_take_every_thread_with_slow_short_requests() -> None:
    """Any request can wait on a guest (metrics of a hung one) or a lock for
    a while: team beta's 600 of them at once take at most its share of the
    short requests' threads; the rest wait without one, and team alpha's
    list and create are answered meanwhile. Beta's all end once the guest does."""
    node = Blocking()

    async def work(client: httpx.AsyncClient) -> None:
        beta = {"X-API-Key": BETA}
        slow = [asyncio.create_task(client.get("/sandboxes/sb1/metrics", headers=beta)) for _ in range(600)]
        await _until(lambda: node.running >= 128)
        await asyncio.sleep(0.5)  # room for more to start, if they could
        assert node.running == 128  # beta's share (api/limits.py SHORT_SHARE)
        r = await asyncio.wait_for(client.get("/v2/sandboxes", headers={"X-API-Key": ALPHA}), 10)
        assert r.status_code == 200, r.text
        r = await asyncio.wait_for(client.post("/sandboxes", json={"templateID": "base"},
                                               headers={"X-API-Key": ALPHA}), 10)
        assert r.status_code == 201, r.text
        node.release.set()
        assert {(await t).status_code for t in slow} == {404}

    asyncio.run(work_with_timeout(node, work))


def test_a_team_past_its_long_request_limit_is_429_naming_it() -> None:
    """team_max_streams per team (X-Strata-Limit: team), max_streams per node
    (X-Strata-Limit: node); refused at once, and a finished exec gives its
    place back."""
    node = Blocking(team_max_streams={"alpha": 2, "*": 256}, max_streams=3)

    async def work(client: httpx.AsyncClient) -> None:
        alpha, beta = {"X-API-Key": ALPHA}, {"X-API-Key": BETA}
        held = [asyncio.create_task(client.post("/sandboxes/sb1/exec", json={"command": "x"}, headers=alpha))
                for _ in range(2)]
        await _until(lambda: node.running == 2)
        r = await client.post("/sandboxes/sb1/exec", json={"command": "x"}, headers=alpha)
        assert r.status_code == 429 and r.headers["X-Strata-Limit"] == "team", r.text
        assert r.json()["message"] == ("team alpha is over its quota team_max_streams: it has 2, this needs 1 more "
                                       "and the limit is 2")
        held.append(asyncio.create_task(client.post("/sandboxes/sb1/exec", json={"command": "x"}, headers=beta)))
        await _until(lambda: node.running == 3)
        r = await client.post("/sandboxes/sb1/exec", json={"command": "x"}, headers=beta)
        assert r.status_code == 429 and r.headers["X-Strata-Limit"] == "node", r.text
        assert "max_streams" in r.json()["message"] and "3" in r.json()["message"]
        node.release.set()
        assert [(await h).status_code for h in held] == [200, 200, 200]
        r = await client.post("/sandboxes/sb1/exec", json={"command": "again"}, headers=alpha)
        assert r.status_code == 200 and r.json()["output"] == "again in sb1\n", r.text

    asyncio.run(work_with_timeout(node, work))


NON_ASCII = ["é".encode() * 20, "ключ-ключ-ключ".encode(), b"\xff" * 16, KEY.encode() + b"\xe9", b"\x80" * 12]


@pytest.mark.parametrize("header", NON_ASCII)
def test_a_non_ascii_key_is_401_never_500(header: bytes) -> None:
    """X-API-Key as bytes that are not ASCII (UTF-8, Latin-1, or a valid key
    with one more byte): refused like any wrong key, on plain, admin and
    long-request routes."""
    client = TestClient(create_app(Blocking()), raise_server_exceptions=False)  # type: ignore[arg-type]
    for method, path in (("GET", "/v2/sandboxes"), ("GET", "/admin/sandboxes"), ("POST", "/sandboxes/sb1/exec"),
                         ("GET", "/metrics"), ("POST", "/sandboxes")):
        r = client.request(method, path, headers={"X-API-Key": header}, json={"command": "true"})
        assert r.status_code == 401, (path, r.status_code, r.text)


def test_a_streams_keepalive_is_bounded() -> None:
    """A stream whose client left is noticed at its next keepalive: a client
    asking for none in a year (or never) would hold its place that long."""
    from api.routes.envd import DEFAULT_KEEPALIVE, MAX_KEEPALIVE, _keepalive

    assert _keepalive({"keepalive-ping-interval": "30"}) == 30.0
    assert _keepalive({}) == DEFAULT_KEEPALIVE and _keepalive({"keepalive-ping-interval": "x"}) == DEFAULT_KEEPALIVE
    for huge in ("31536000", "inf", "1e308"):
        assert _keepalive({"keepalive-ping-interval": huge}) == MAX_KEEPALIVE
    assert _keepalive({"keepalive-ping-interval": "nan"}) == DEFAULT_KEEPALIVE
    assert _keepalive({"keepalive-ping-interval": "-5"}) == 1.0
