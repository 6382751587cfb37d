"""layerstore/logs.py: a record is one line whatever text it carries; its traceback stays readable."""

from __future__ import annotations

import io
import logging

from layerstore.logs import FORMAT, OneLine, escape


def test_control_characters_in_a_message_are_escaped() -> None:
    hostile = "volume path a\nFAKE 2026-01-01 ERROR strata.api: forged\r\x1b[2J\x00\u2028end\x85"
    assert escape(hostile) == ("volume path a\\nFAKE 2026-01-01 ERROR strata.api: forged\\r\\x1b[2J\\x00"
                               "\\u2028end\\x85")
    assert escape("plain text, ünïcode and a tab-free line") == "plain text, ünïcode and a tab-free line"


def test_a_record_with_guest_text_is_one_line_and_a_traceback_stays() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(OneLine(FORMAT))
    logger = logging.getLogger("strata.test-logs")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("volume %s: /%s not published", "vol1", "x\nERROR forged line")
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("a guest said %r then %s", "q", "multi\nline")
    finally:
        logger.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("volume vol1: /x\\nERROR forged line not published")
    assert lines[1].endswith("a guest said 'q' then multi\\nline")
    assert lines[2] == "Traceback (most recent call last):" and lines[-1] == "ValueError: boom"
