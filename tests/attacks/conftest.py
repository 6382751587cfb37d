"""The attack matrix: every test under tests/attacks/ is one row, an attempt
by an attacker (no key, another team's key, root in a guest, a hostile
archive or peer) on a target, named in the test's docstring as

    attacker: ...  target: ...  attempt: ...  must: ...

A row passes when the attack fails as `must` says. At the end of a run the
summary prints `attacks tried N, succeeded M`: N counts the rows that ran,
M those that failed (an attack that got through, or a row that broke)."""

from __future__ import annotations

from typing import Any

import pytest


class AttackMatrix:
    """Counts the rows' outcomes as they are reported."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if "tests/attacks/" not in report.nodeid.replace("\\", "/"):
            return
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid] = report.outcome

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.outcomes:
            tried = sum(1 for o in self.outcomes.values() if o != "skipped")
            succeeded = sum(1 for o in self.outcomes.values() if o == "failed")
            terminalreporter.write_line(f"attacks tried {tried}, succeeded {succeeded}")


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin("attack-matrix"):
        config.pluginmanager.register(AttackMatrix(), "attack-matrix")


@pytest.fixture(scope="package")  # gone before the rest of the suite starts nodes of its own
def lab(tmp_path_factory: pytest.TempPathFactory, guest: Any) -> Any:
    """The node, gateway, bait and victim sandbox of tests/attacks/lab.py."""
    from tests.attacks.lab import Lab

    target = Lab(tmp_path_factory.mktemp("attack-lab"), guest)
    yield target
    target.close()
