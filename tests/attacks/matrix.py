"""The attack matrix's count (tests/attacks/conftest.py says what a row is): every report of a
test under tests/attacks/, a worker's too under pytest-xdist, and one line at the end."""

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
