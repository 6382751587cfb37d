"""The processes' log lines: one record, one line, whoever wrote its text.

A log message often carries text a guest or a client chose (a volume path, a
DNS name, an agent's error). Written as is, a newline in it forges a log
line of the attacker's choosing and a terminal escape rewrites what an
operator's terminal shows. So the message part of every record has its
control characters escaped (`\\n`, `\\x1b`, `\\u2028`...); a traceback the
record carries stays as Python formats it.
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class OneLine(logging.Formatter):
    """A Formatter that escapes control characters in each record's message."""

    _ESCAPES = {**{c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7f, 0xa0)]},
                ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t", 0x2028: "\\u2028", 0x2029: "\\u2029"}

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)


def escape(text: str) -> str:
    """`text` with its control characters (C0, DEL, C1, line separators) written as escapes."""
    return text.translate(OneLine._ESCAPES)


def configure(level: int | str = logging.INFO) -> None:
    """Root logging to stderr in FORMAT, one line per record (what serve, gateway and the mount daemon use)."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLine(FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
