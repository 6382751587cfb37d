"""Firecracker's API client over a unix socket (vmm/unixhttp.py), against the
Firecracker-shaped server of tests/test_vmm_firecracker.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.test_vmm_firecracker import FakeFirecracker, serve
from vmm.backend import VmmError
from vmm.unixhttp import FirecrackerApi


def test_api_client_over_unix_socket_and_fault_messages(tmp_path: Path) -> None:
    fake = FakeFirecracker(fail="PUT /boot-source")
    server = serve(fake, tmp_path / "api.sock")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    api = FirecrackerApi(tmp_path / "api.sock", timeout=10)
    try:
        assert api.get("/")["state"] == "Not started"
        assert api.call("PUT", "/machine-config", {"vcpu_count": 1, "mem_size_mib": 128}) is None  # 204
        with pytest.raises(VmmError, match=r"refused PUT /boot-source \(400\): fake failure of PUT /boot-source$"):
            api.put("/boot-source", {"kernel_image_path": "/k"})
        with pytest.raises(VmmError, match="not supported before starting"):
            api.patch("/vm", {"state": "Paused"})
    finally:
        server.shutdown()
        server.server_close()
    assert fake.requests == [
        ("GET", "/", None),
        ("PUT", "/machine-config", {"vcpu_count": 1, "mem_size_mib": 128}),
        ("PUT", "/boot-source", {"kernel_image_path": "/k"}),
        ("PATCH", "/vm", {"state": "Paused"}),
    ]
    with pytest.raises(VmmError, match="VM stopped"):  # nothing listens any more
        api.get("/")
