"""Who may reach a sandbox other than through the API's key: its envd
access token (the data plane) and its traffic token (its ports).

A wrong token and an unknown sandbox get the same answer, so the data plane
tells nobody which ids exist; tokens are compared in constant time
(`teams.same_secret`).
"""

from __future__ import annotations

from collections.abc import Callable

from layerstore.config import NodeConfig
from layerstore.errors import Conflict, NotFound
from vmm.agent import Agent
from vmm.registry import SandboxRecord
from vmm.sandbox import Sandboxes

from .connect import ConnectError
from .envd import Target
from .exceptions import Forbidden, Unauthorized
from .teams import caller_of, same_secret


class Access:
    def __init__(self, config: NodeConfig, boxes: Sandboxes, record: Callable[[str], SandboxRecord]) -> None:
        """`record(sid)` is a client-visible sandbox's record (NotFound for
        the node's own: warm pools, builds)."""
        self._config = config
        self._boxes = boxes
        self._record = record

    def data_plane(self, sid: str, *, token: str | None, key: str | None, user: str) -> Target:
        """The sandbox an envd request is for, if its access token (or an
        API key of its team) says the caller may use it."""
        denied = ConnectError("unauthenticated", f"missing or invalid access token for sandbox {sid!r}")
        if not sid:
            raise ConnectError("invalid_argument", "the E2b-Sandbox-Id header is required")
        try:
            record = self._record(sid)
        except NotFound:
            raise denied from None
        caller = caller_of(key, self._config) if key else None
        if not (same_secret(token, record.access_token) or (caller is not None and caller.sees(record.team))):
            raise denied
        boxes = self._boxes

        def agent_of() -> Agent:
            try:
                if boxes.record(sid).state == "suspended":
                    raise ConnectError("unavailable", f"sandbox {sid} is paused: resume it first")
                return boxes.agent(sid)
            except (NotFound, Conflict):
                raise ConnectError("unavailable", f"sandbox {sid} is not running") from None

        return Target(sid, agent_of, env=dict(record.env), user=user or record.user, cwd=record.cwd,
                      log=lambda level, message: boxes.log_event(sid, level, message))

    def is_secret(self, sid: str, value: str) -> bool:
        """Whether `value` is a key of this node or sandbox `sid`'s access or traffic token."""
        if caller_of(value, self._config) is not None:
            return True
        try:
            record = self._boxes.record(sid)
        except NotFound:
            return False
        return same_secret(value, record.access_token) or bool(record.traffic_token
                                                               and same_secret(value, record.traffic_token))

    def port_address(self, sid: str, token: str | None, *, access_token: str | None = None,
                     runs_code: bool = False) -> str:
        """Where the port proxy (api/ports.py) reaches sandbox `sid`: its
        address on the node. Forbidden without the sandbox's traffic token
        when its ports are not public; Unauthorized when an `access_token`
        is given (E2B's SDK sends its envd token) and is not the sandbox's,
        or is missing for a path that `runs_code`."""
        try:
            record = self._boxes.record(sid)
        except NotFound:
            raise NotFound(f"sandbox {sid} not found") from None
        if access_token is not None and not same_secret(access_token, record.access_token):
            raise Unauthorized(f"wrong access token for sandbox {sid} (header X-Access-Token)")
        if record.traffic_token and not same_secret(token, record.traffic_token):
            raise Forbidden(f"sandbox {sid}'s ports need its traffic access token (header e2b-traffic-access-token)")
        if runs_code and not (access_token and record.access_token):
            raise Unauthorized(f"the code interpreter of sandbox {sid} runs code only with its access token "
                               "(header X-Access-Token)")
        if record.state == "suspended":
            raise Conflict(f"sandbox {sid} is paused: resume it to reach its ports")
        address = self._boxes.address(record)
        if address is None:
            raise Conflict(f"sandbox {sid} has no network (config network.enabled)")
        return address
