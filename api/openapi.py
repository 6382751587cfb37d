"""Write the node API's OpenAPI document to api/openapi.json.

    python -m api.openapi            # regenerate the committed file
    python -m api.openapi --check    # exit 1 if it is out of date

The document is committed so changes to the API show up in review as a diff
of the contract, not only of the code; tests/test_openapi.py fails when it
is stale. The app is built without a node: no store, mount or VMM needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PATH = Path(__file__).resolve().parent / "openapi.json"
REGENERATE = "python -m api.openapi"


def document() -> dict:
    """The app's OpenAPI document as JSON would carry it."""
    from .app import create_app

    return json.loads(json.dumps(create_app().openapi()))


def render(doc: dict) -> str:
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed file; write nothing")
    args = parser.parse_args(argv)
    text = render(document())
    if args.check:
        if not PATH.exists() or PATH.read_text() != text:
            print(f"{PATH} is out of date: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    PATH.write_text(text)
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
