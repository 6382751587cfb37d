"""The committed api/openapi.json is the app's schema: API changes show up in
review as a diff of the contract. No node, mount or VMM needed."""

from __future__ import annotations

import json

from api.openapi import PATH, REGENERATE, document


def test_committed_schema_is_current() -> None:
    committed = json.loads(PATH.read_text())
    assert committed == document(), f"api/openapi.json differs from the app's schema: run `{REGENERATE}`"
