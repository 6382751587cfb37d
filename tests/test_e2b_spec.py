"""Our E2B routes against E2B's published OpenAPI spec.

For every operation the app serves that is not listed in STRATA_ONLY or
DEVIATES below, E2B's spec must have the same method and path, the same
success status codes, a response carrying every property E2B marks required
(always sent, with a compatible type), and a request body accepting E2B's
required properties and requiring nothing E2B clients may leave out. Every
operation must be classified, so a new route is a decision, not a silent
extension of "E2B-compatible".

The spec is E2B's own file, kept whole (SPEC_SOURCE says which one), read
from $STRATA_E2B_SPEC or shared/e2b/openapi.yml beside the repository; the
test is skipped, saying where to put it, when neither exists.

tests/test_e2b_sdk.py makes the same checks, always, against the client the
`e2b` SDK (PyPI) generates from E2B's spec; it imports STRATA_ONLY and
DEVIATES from here, so these two lists decide what both tests exempt.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from api.openapi import document

ROOT = Path(__file__).resolve().parent.parent
SPEC_SOURCE = "github.com/e2b-dev/infra, path spec/openapi.yml, commit 54693ff353d26c5fe1951db5467e751f3e2f984e"
SUCCESS = ("200", "201", "202", "204")
JSON = "application/json"

# Operations E2B's spec does not have: Strata's own.
STRATA_ONLY: dict[tuple[str, str], str] = {
    ("GET", "/metrics"): "Prometheus metrics of this node; E2B's metrics are per team and sandbox, not per node",
    ("POST", "/sandboxes/{sandboxID}/exec"): "E2B runs commands only through envd (which Strata serves too); this "
                                             "is Strata's one-request command call",
    ("GET", "/snapshots/{snapshotID}"): "inspect a snapshot's layers and stored size; E2B has no such view",
    ("DELETE", "/snapshots/{snapshotID}"): "E2B deletes a snapshot as a template (DELETE /templates/{templateID}, "
                                           "which Strata serves too); this one refuses while a name still needs it",
    ("POST", "/volumes/{volumeID}/snapshots"): "volume snapshots: E2B has none (a volume kept whole, new volumes "
                                                "started from it)",
    ("GET", "/volumes/{volumeID}/snapshots"): "volume snapshots: Strata's own",
    ("DELETE", "/volume-snapshots/{snapshotID}"): "volume snapshots: Strata's own",
    ("GET", "/images"): "raw images imported into the store: Strata's own",
    ("GET", "/images/{ref}"): "raw images: Strata's own",
    ("PUT", "/images/{ref}"): "raw images: Strata's own",
    ("DELETE", "/images/{ref}"): "raw images: Strata's own",
    ("GET", "/chunks/{digest}"): "chunk objects for peer nodes: Strata's own",
    ("GET", "/cache"): "the node's chunk cache: Strata's own",
    ("POST", "/admin/cache/drop"): "operating one node's cache: Strata's own (E2B's /admin paths are per team)",
    ("POST", "/admin/cache/pin"): "as above",
    ("POST", "/admin/cache/unpin"): "as above",
    ("POST", "/admin/gc"): "garbage collection of the content-addressed store: Strata's own",
    ("POST", "/admin/push"): "copying to the shared remote store: Strata's own",
    ("POST", "/admin/pull"): "copying from the shared remote store: Strata's own",
    ("GET", "/admin/sandboxes"): "every sandbox record including the warm pool, for operators: Strata's own",
}

# Operations the e2b SDK's client (PyPI e2b 2.x) calls that the pinned spec above predates:
# checked against the SDK by test_e2b_sdk.py, not against this spec.
NEWER_THAN_SPEC: dict[tuple[str, str], str] = {
    **{(method, f"/volumecontent/{{volumeID}}/{what}"): "the volume content API: the SDK's own client "
       "(e2b.volume.client), from a spec of its own" for method, what in (
           ("GET", "path"), ("DELETE", "path"), ("PATCH", "path"), ("GET", "dir"), ("POST", "dir"),
           ("GET", "file"), ("PUT", "file"))},
    ("POST", "/v2/sandboxes"): "e2b 2.x creates sandboxes here (NewSandboxV2)",
    ("POST", "/v2/sandboxes/{sandboxID}/connect"): "e2b 2.x connects here (ConnectSandboxV2)",
}

# Operations E2B's spec has, that Strata answers differently on purpose.
DEVIATES: dict[tuple[str, str], str] = {
    ("GET", "/health"): "E2B answers 204 without a body; a node answers 200 with what it serves and 503 when its "
                        "mount daemon is down, so a load balancer takes a node without a mount out",
    ("POST", "/templates"): "E2B's (deprecated) builds a template from a Dockerfile (202); Strata's names an imported "
                            "image or a snapshot, which takes no build (201)",
}


def _spec_file() -> Path | None:
    for candidate in (os.environ.get("STRATA_E2B_SPEC"), ROOT.parent / "shared" / "e2b" / "openapi.yml"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


@pytest.fixture(scope="module")
def e2b() -> dict:
    path = _spec_file()
    if path is None:
        pytest.skip(f"E2B's spec ({SPEC_SOURCE}) is not here: put it at shared/e2b/openapi.yml beside the "
                    "repository or point STRATA_E2B_SPEC at it")
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def ours() -> dict:
    return document()


def _operations(doc: dict) -> dict[tuple[str, str], dict]:
    return {(method.upper(), path): op for path, item in doc["paths"].items() for method, op in item.items()
            if method in ("get", "put", "post", "delete", "patch")}


@dataclass
class Shape:
    """A JSON schema reduced to what compatibility depends on."""
    types: set[str] = field(default_factory=set)  # non-null types; empty: unconstrained (or null only)
    nullable: bool = False
    enum: set | None = None
    format: str | None = None
    properties: dict[str, dict] = field(default_factory=dict)
    required: set[str] = field(default_factory=set)
    items: dict | None = None
    additional: dict | None = None


def _shape(doc: dict, schema: dict) -> Shape:
    """Follow $ref, allOf, anyOf/oneOf and `nullable` (3.0) or a null type (3.1) into one Shape."""
    while "$ref" in schema:
        schema = {**_lookup(doc, schema["$ref"]), **{k: v for k, v in schema.items() if k != "$ref"}}
    shape = Shape(nullable=bool(schema.get("nullable")), format=schema.get("format"))
    for part in schema.get("allOf", []) + schema.get("anyOf", []) + schema.get("oneOf", []):
        sub = _shape(doc, part)
        shape.types |= sub.types
        shape.nullable |= sub.nullable
        shape.enum = sub.enum if shape.enum is None else shape.enum | (sub.enum or set())
        shape.format = shape.format or sub.format
        shape.properties.update(sub.properties)
        shape.required |= sub.required
        shape.items = shape.items or sub.items
        shape.additional = shape.additional or sub.additional
    types = schema.get("type", [])
    for t in [types] if isinstance(types, str) else types:
        if t == "null":
            shape.nullable = True
        else:
            shape.types.add(t)
    if "properties" in schema or isinstance(schema.get("additionalProperties"), dict):
        shape.types.add("object")
    if "enum" in schema or "const" in schema:
        shape.enum = set(schema.get("enum", [])) | ({schema["const"]} if "const" in schema else set())
    shape.properties.update(schema.get("properties", {}))
    shape.required |= set(schema.get("required", []))
    shape.items = schema.get("items", shape.items)
    if isinstance(schema.get("additionalProperties"), dict):
        shape.additional = schema["additionalProperties"]
    return shape


def _lookup(doc: dict, ref: str) -> dict:
    node = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def _widen(types: set[str]) -> set[str]:
    """What may be sent where `types` is expected: an integer is a number (not the other way round)."""
    return types | {"integer"} if "number" in types else types


@dataclass(frozen=True)
class Compare:
    """Whether what we send (response) or accept (request) fits E2B's schema."""
    ours_doc: dict
    e2b_doc: dict
    response: bool

    def check(self, ours: dict, theirs: dict, where: str, depth: int = 0) -> list[str]:
        o, t = _shape(self.ours_doc, ours), _shape(self.e2b_doc, theirs)
        if not t.types or depth > 8:
            return []
        problems = self._scalar(o, t, where)
        if problems or not o.types:
            return problems
        if "array" in t.types and o.items is not None and t.items is not None:
            problems += self.check(o.items, t.items, f"{where}[]", depth + 1)
        if o.additional is not None and t.additional is not None:
            problems += self.check(o.additional, t.additional, f"{where}{{}}", depth + 1)
        return problems + self._properties(o, t, where, depth)

    def _scalar(self, o: Shape, t: Shape, where: str) -> list[str]:
        sent, expected = (o, t) if self.response else (t, o)
        if not expected.types:
            return []
        if not sent.types <= _widen(expected.types):
            return [f"{where}: type {sorted(o.types)} is not E2B's {sorted(t.types)}"]
        if self.response and o.nullable and not t.nullable:
            return [f"{where}: we may send null, E2B's is not nullable"]
        if sent.enum is not None and expected.enum is not None and not sent.enum <= expected.enum:
            return [f"{where}: values {sorted(map(str, o.enum or ()))} vs E2B's {sorted(map(str, t.enum or ()))}"]
        if self.response and t.enum is not None and o.enum is None:
            return [f"{where}: E2B allows only {sorted(map(str, t.enum))}, ours any value"]
        if t.format == "date-time" and o.format != "date-time":
            return [f"{where}: E2B's is a date-time, ours {o.format or 'not'}"]
        return []

    def _properties(self, o: Shape, t: Shape, where: str, depth: int) -> list[str]:
        problems = []
        for name in sorted(t.required):
            if name not in o.properties:
                problems.append(f"{where}.{name}: required by E2B, missing in ours")
                continue
            if self.response and name not in o.required:
                problems.append(f"{where}.{name}: required by E2B, but ours does not say it is always sent")
            problems += self.check(o.properties[name], t.properties.get(name, {}), f"{where}.{name}", depth + 1)
        if not self.response:
            problems += [f"{where}.{name}: we require it, E2B clients may leave it out"
                         for name in sorted(o.required - t.required)]
        return problems


def _json_schema(part: dict | None) -> dict | None:
    return (part or {}).get("content", {}).get(JSON, {}).get("schema")


def _problems(ours_doc: dict, e2b_doc: dict, key: tuple[str, str]) -> list[str]:
    ours_op, theirs_op = _operations(ours_doc)[key], _operations(e2b_doc)[key]
    ours_ok = {c for c in ours_op["responses"] if c in SUCCESS}
    theirs_ok = {c for c in theirs_op["responses"] if c in SUCCESS}
    if ours_ok != theirs_ok:
        return [f"success codes {sorted(ours_ok)}, E2B's {sorted(theirs_ok)}"]
    problems = []
    for code in sorted(theirs_ok):
        theirs = _json_schema(theirs_op["responses"][code])
        ours = _json_schema(ours_op["responses"][code])
        if theirs is not None and ours is None:
            problems.append(f"{code}: E2B's has a JSON body, ours none")
        elif theirs is not None and ours is not None:
            problems += Compare(ours_doc, e2b_doc, response=True).check(ours, theirs, f"{code} response")
    return problems + _request_problems(ours_doc, e2b_doc, ours_op, theirs_op)


def _request_problems(ours_doc: dict, e2b_doc: dict, ours_op: dict, theirs_op: dict) -> list[str]:
    theirs, ours = _json_schema(theirs_op.get("requestBody")), _json_schema(ours_op.get("requestBody"))
    if theirs is None:
        return ["E2B's takes no body, ours requires one"] if ours_op.get("requestBody", {}).get("required") else []
    if ours is None:
        return ["E2B's takes a JSON body, ours none"]
    must_send = theirs_op["requestBody"].get("required") or _shape(e2b_doc, theirs).required
    if ours_op["requestBody"].get("required") and not must_send:
        return ["ours requires a body, E2B clients may send none"]
    return Compare(ours_doc, e2b_doc, response=False).check(ours, theirs, "request")


def test_every_operation_is_classified(ours: dict) -> None:
    unlisted = set(_operations(ours)) - set(STRATA_ONLY) - set(DEVIATES) - set(NEWER_THAN_SPEC)
    listed_gone = (set(STRATA_ONLY) | set(DEVIATES) | set(NEWER_THAN_SPEC)) - set(_operations(ours))
    assert not listed_gone, f"listed but not served any more: {sorted(listed_gone)}"
    e2b_routes = {("POST", "/sandboxes"), ("GET", "/sandboxes"), ("GET", "/v2/sandboxes"),
                  ("GET", "/sandboxes/{sandboxID}"), ("DELETE", "/sandboxes/{sandboxID}"),
                  *{("POST", f"/sandboxes/{{sandboxID}}/{verb}")
                    for verb in ("pause", "resume", "connect", "timeout", "refreshes")}}
    assert e2b_routes <= unlisted, f"E2B routes Strata claims must be checked: {sorted(e2b_routes - unlisted)}"


def test_strata_only_routes_are_not_e2b_routes(ours: dict, e2b: dict) -> None:
    theirs = set(_operations(e2b))
    assert not set(STRATA_ONLY) & theirs, f"E2B has these now: check them or move them to DEVIATES: " \
                                          f"{sorted(set(STRATA_ONLY) & theirs)}"
    assert set(DEVIATES) <= theirs, f"E2B has dropped: {sorted(set(DEVIATES) - theirs)}"


def test_e2b_routes_match_e2b_spec(ours: dict, e2b: dict) -> None:
    claimed = sorted(set(_operations(ours)) - set(STRATA_ONLY) - set(DEVIATES) - set(NEWER_THAN_SPEC))
    missing = [key for key in claimed if key not in _operations(e2b)]
    assert not missing, f"not in E2B's spec ({SPEC_SOURCE}): {missing}; list them in STRATA_ONLY with a reason"
    problems = [f"{method} {path}: {p}" for method, path in claimed for p in _problems(ours, e2b, (method, path))]
    assert not problems, "differences from E2B's spec:\n" + "\n".join(problems)
