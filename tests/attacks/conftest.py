"""The attack matrix: every test under tests/attacks/ is one row, an attempt
by an attacker (no key, another team's key, root in a guest, a hostile
archive or peer) on a target, named in the test's docstring as

    attacker: ...  target: ...  attempt: ...  must: ...

A row passes when the attack fails as `must` says. At the end of a run the
summary prints `attacks tried N, succeeded M`: N counts the rows that ran,
M those that failed (an attack that got through, or a row that broke):
tests/attacks/matrix.py, registered by tests/conftest.py (the one conftest
pytest-xdist's controller, which prints the summary, loads)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="package")  # gone before the rest of the suite starts nodes of its own
def lab(tmp_path_factory: pytest.TempPathFactory, guest: Any) -> Any:
    """The node, gateway, bait and victim sandbox of tests/attacks/lab.py."""
    from tests.attacks.lab import Lab

    target = Lab(tmp_path_factory.mktemp("attack-lab"), guest)
    yield target
    target.close()
