"""Our E2B routes against the client in E2B's Python SDK (`e2b` on PyPI).

Why this exists: tests/test_e2b_spec.py compares our routes with E2B's
published OpenAPI file, which this repository may not commit, so in CI it
skips. The `e2b` SDK is installed from PyPI and carries a client generated
from that same spec (e2b/api/client/), so this test always runs, and checks
what an E2B client actually does: which paths it calls, which status codes it
parses, which fields it reads without checking and which it sends.

What is exempt is decided in one place, test_e2b_spec.py: STRATA_ONLY (ours,
E2B has none) and DEVIATES (E2B has it, we answer differently on purpose),
each with its reason; they are imported from there, with its schema helpers.
NOT_YET below lists the SDK's sandbox operations we do not serve. For every
other operation we serve, and for any STRATA_ONLY one the SDK calls all the
same (tests/e2b_sdk_client.py reads the SDK: `ast` on its generated modules
for paths and status codes, attrs and from_dict for its models):

1. the SDK has an operation with its method and path (parameter names aside);
2. each success code we document is one the SDK's `_parse_response` branches
   on (read with `ast`, not regex);
3. for each, every field the SDK's response model requires is in our
   response schema, marked required, with a compatible type (null, enum
   values, date-time included), recursively through nested models; and a
   sample response built from our schema parses with the model's from_dict;
4. the request body: the SDK's required fields are ours to accept, ours
   requires nothing the SDK may leave out; and the SDK's request, built with
   its required fields only and to_dict()-ed, validates against our pydantic
   model (api/models.py, found from the schema's $ref name);
5. every SDK operation under the `sandboxes` tag is served, exempt or in
   NOT_YET, so a new SDK operation or a new route of ours is a decision.

The schema checked is the app's own (api.openapi.document(); test_openapi.py
keeps api/openapi.json equal to it). Each check is a function of the schema,
so it can be run on an altered copy. No network: the SDK is only imported.
Differences found and not yet fixed are KNOWN_FAILURES, strict xfails with
the reason, so each fails again once fixed and its entry must go.
"""

from __future__ import annotations

import json
from functools import cache

import pydantic
import pytest

import api.models
from api.openapi import document
from tests.e2b_sdk_client import Field, Operation, Reply, build, fields, normalized, operations, required_fields
from tests.test_e2b_spec import DEVIATES, STRATA_ONLY, Shape, _json_schema, _operations, _shape

SUCCESS = ("200", "201", "202", "204")
SAMPLE_TIME = "2025-01-01T00:00:00Z"
SAMPLE_UUID = "00000000-0000-4000-8000-000000000000"

# The SDK's sandbox operations that Strata does not serve (yet).
NOT_YET: dict[tuple[str, str], str] = {
    ("GET", "/unstable/sandboxes/{sandboxID}/record"):
        "e2b 2.64's generated client has it (a sandbox's record kept after it ended), no Sandbox method calls it; "
        "Strata keeps no record of an ended sandbox yet (issue 48's lifecycle events)",
}


# --- what is compared ----------------------------------------------------------------------
@cache
def ours() -> dict:
    return document()


def _exempt() -> set[tuple[str, str]]:
    return set(STRATA_ONLY) | set(DEVIATES)


def claimed(doc: dict) -> list[tuple[str, str]]:
    """Our operations an E2B client reaches, as (METHOD, path): those not exempt, and those STRATA_ONLY
    lists that the SDK calls all the same (test_strata_only_routes_are_not_sdk_operations fails on them)."""
    sdk_calls = {key for key in STRATA_ONLY if _sdk(key) is not None}
    return sorted(set(_operations(doc)) - _exempt() | sdk_calls)


def _sdk(key: tuple[str, str]) -> Operation | None:
    return operations().get((key[0], normalized(key[1])))


def _keys(pairs) -> set[tuple[str, str]]:
    return {(method, normalized(path)) for method, path in pairs}


def _success(op: dict) -> list[str]:
    return sorted(code for code in op["responses"] if code in SUCCESS)


# --- 2. status codes -----------------------------------------------------------------------
def status_problems(doc: dict, key: tuple[str, str]) -> list[str]:
    accepted = set(_sdk(key).replies)
    return [f"we answer {code}, the SDK's client handles only {sorted(accepted)}"
            for code in _success(_operations(doc)[key]) if code not in accepted]


# --- 3. responses --------------------------------------------------------------------------
def response_problems(doc: dict, key: tuple[str, str]) -> list[str]:
    """Each success response against the SDK model parsed for that code."""
    problems = []
    for code, schema, reply in _responses(doc, key):
        if schema is None:
            problems.append(f"{code}: the SDK parses a {reply.model.__name__}, ours has no JSON body")
        else:
            problems += _reply_problems(doc, _shape(doc, schema), reply, f"{code}")
    return problems


def _responses(doc: dict, key: tuple[str, str]):
    """(code, our JSON schema or None, the SDK's Reply) for each success code the SDK parses a model for."""
    op, replies = _operations(doc)[key], _sdk(key).replies
    for code in _success(op):
        if code in replies and replies[code].model is not None:
            yield code, _json_schema(op["responses"][code]), replies[code]


def _reply_problems(doc: dict, shape: Shape, reply: Reply, where: str) -> list[str]:
    if reply.many:
        if "array" not in shape.types or shape.items is None:
            return [f"{where}: the SDK reads a list of {reply.model.__name__}, ours is {sorted(shape.types)}"]
        shape, where = _shape(doc, shape.items), f"{where}[]"
    return _model_problems(doc, shape, reply.model, where)


def _model_problems(doc: dict, shape: Shape, model: type, where: str, depth: int = 0) -> list[str]:
    """The object `shape` describes, as `model` reads it: what it requires is there and always sent;
    what it reads is of a type it can take."""
    problems = []
    for f in fields(model):
        at = f"{where}.{f.json}"
        if f.json not in shape.properties:
            problems += [f"{at}: {model.__name__} requires it, ours does not have it"] if f.required else []
            continue
        if f.required and f.json not in shape.required:
            problems.append(f"{at}: {model.__name__} requires it, ours does not mark it required")
        problems += _sent_field_problems(doc, _shape(doc, shape.properties[f.json]), f, at, depth)
    return problems


def _sent_field_problems(doc: dict, o: Shape, f: Field, at: str, depth: int) -> list[str]:
    """A field we send, against what the SDK reads. Null where the SDK's optional field is not nullable
    passes when the SDK hands the value on as it is (a string, number, flag or dict: None, falsy like its
    UNSET); it fails where the SDK parses it (a model, a date-time, an enum), which raises on null."""
    parsed = f.model is not None or f.date_time or f.enum is not None
    if o.nullable and not f.nullable and (f.required or parsed):
        return [f"{at}: we may send null, the SDK's is not nullable"]
    if f.types and not o.types <= _fits(f.types):
        return [f"{at}: ours is {sorted(o.types) or 'untyped'}, the SDK's {sorted(f.types)}"]
    if f.date_time and o.format != "date-time":
        return [f"{at}: the SDK parses a date-time, ours is {o.format or 'a plain string'}"]
    if f.enum is not None and (o.enum is None or not o.enum <= f.enum):
        return [f"{at}: the SDK accepts only {sorted(f.enum)}, ours {sorted(o.enum) if o.enum else 'any value'}"]
    if f.model is None or depth > 5 or not o.types:
        return []
    if "array" in f.types and o.items is not None:
        return _model_problems(doc, _shape(doc, o.items), f.model, f"{at}[]", depth + 1)
    return _model_problems(doc, o, f.model, at, depth + 1)


def _fits(expected: frozenset[str] | set[str]) -> set[str]:
    """The JSON types a value of `expected` type may come as: an integer is a number."""
    return set(expected) | ({"integer"} if "number" in expected else set())


# --- 3. responses, behaviourally -----------------------------------------------------------
def parse_problems(doc: dict, key: tuple[str, str]) -> list[str]:
    """A response built from our schema (required properties only) through the SDK's from_dict: once with
    a value of its type in each property, once with null wherever our schema allows it."""
    problems = []
    for code, schema, reply in _responses(doc, key):
        if schema is None:
            continue
        for nulls in (False, True):
            problems += _parse(reply, sample(doc, schema, nulls=nulls), code)
    return problems


def _parse(reply: Reply, body: object, code: str) -> list[str]:
    try:
        for item in body if reply.many else [body]:
            reply.model.from_dict(item)
    except Exception as e:  # noqa: BLE001 - any failure to parse is the finding
        return [f"{code}: {reply.model.__name__}.from_dict({body!r}) fails: {type(e).__name__}: {e}"]
    return []


def sample(doc: dict, schema: dict, depth: int = 0, nulls: bool = False) -> object:
    """A value our schema allows: each required property filled with a value of its type (`nulls`: with
    null where our schema allows null)."""
    s = _shape(doc, schema)
    if nulls and s.nullable and depth:
        return None
    if s.enum:
        return sorted(s.enum, key=str)[0]
    kind = next((t for t in ("object", "array", "string", "integer", "number", "boolean") if t in s.types), None)
    if kind is None or depth > 8:
        return None
    if kind == "object":
        return {name: sample(doc, s.properties[name], depth + 1, nulls)
                for name in sorted(s.required & set(s.properties))}
    if kind == "array":
        return [sample(doc, s.items, depth + 1, nulls)] if s.items is not None else []
    if kind == "string":
        return {"date-time": SAMPLE_TIME, "date": SAMPLE_TIME[:10], "uuid": SAMPLE_UUID}.get(s.format, "x")
    return {"integer": 1, "number": 1.5, "boolean": True}[kind]


# --- 4. request bodies ---------------------------------------------------------------------
def request_problems(doc: dict, key: tuple[str, str]) -> list[str]:
    """Our request body against the SDK's request model: what it must send, we accept; we require no more."""
    op, sdk = _operations(doc)[key], _sdk(key)
    schema, body_required = _json_schema(op.get("requestBody")), bool(op.get("requestBody", {}).get("required"))
    if sdk.body is None:
        return ["ours requires a body, the SDK sends none"] if body_required else []
    if sdk.body.__name__ == "File":  # raw bytes (the SDK's types.File), not JSON
        raw = "application/octet-stream" in op.get("requestBody", {}).get("content", {})
        return [] if raw else ["the SDK sends raw bytes, ours takes no application/octet-stream body"]
    if schema is None:
        return [f"the SDK sends a {sdk.body.__name__}, ours takes no JSON body"]
    problems = ["ours requires a body, the SDK may send none"] if body_required and sdk.body_optional else []
    shape, theirs = _shape(doc, schema), required_fields(sdk.body)
    for f in theirs:
        at = f"request.{f.json}"
        if f.json not in shape.properties:
            problems.append(f"{at}: {sdk.body.__name__} requires it, ours does not accept it")
        else:
            problems += _accepted_field_problems(_shape(doc, shape.properties[f.json]), f, at)
    return problems + [f"request.{name}: we require it, {sdk.body.__name__} may leave it out"
                       for name in sorted(shape.required - {f.json for f in theirs})]


def _accepted_field_problems(o: Shape, f: Field, at: str) -> list[str]:
    """A field the SDK sends, against what we accept."""
    if f.nullable and not o.nullable and o.types:
        return [f"{at}: the SDK may send null, ours does not accept it"]
    if o.types and not set(f.types) <= _fits(o.types):
        return [f"{at}: the SDK sends {sorted(f.types)}, ours accepts {sorted(o.types)}"]
    if f.enum is not None and o.enum is not None and not f.enum <= o.enum:
        return [f"{at}: the SDK may send {sorted(f.enum)}, ours accepts {sorted(o.enum)}"]
    return []


def validation_problems(doc: dict, key: tuple[str, str]) -> list[str]:
    """The SDK's request (its required fields, plus the defaults it always sends) against our pydantic model,
    or, if the schema names none in api/models.py, against our required properties."""
    op, sdk = _operations(doc)[key], _sdk(key)
    schema = _json_schema(op.get("requestBody"))
    if sdk.body is None or schema is None:
        return []
    payload = json.loads(json.dumps(build(sdk.body).to_dict()))
    model = _pydantic_model(schema)
    if model is None:
        missing = _shape(doc, schema).required - set(payload)
        return [f"request {payload!r} lacks our required {sorted(missing)}"] if missing else []
    try:
        model.model_validate(payload)
    except pydantic.ValidationError as e:
        return [f"request {payload!r} does not validate as our {model.__name__}: {e}"]
    return []


def _pydantic_model(schema: object) -> type[pydantic.BaseModel] | None:
    """The model in api/models.py a schema's $ref names (through anyOf and the like)."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            found = getattr(api.models, schema["$ref"].rsplit("/", 1)[1], None)
            return found if isinstance(found, type) and issubclass(found, pydantic.BaseModel) else None
        return next(filter(None, map(_pydantic_model, schema.values())), None)
    if isinstance(schema, list):
        return next(filter(None, map(_pydantic_model, schema)), None)
    return None


# --- the tests -----------------------------------------------------------------------------
# Differences this test found and reported, not fixed here: (test, operation) -> what is wrong. Each is a
# strict xfail, so the test fails again once it is fixed, and the entry must go.
KNOWN_FAILURES: dict[tuple[str, tuple[str, str]], str] = {
}
CLAIMED = claimed(ours())


def _params(test: str, keys) -> list:
    """`keys` as parameters of `test`, with KNOWN_FAILURES as strict xfails."""
    return [pytest.param(key, id=" ".join(key), marks=_known(test, key)) for key in keys]


def _known(test: str, key: tuple[str, str]) -> list:
    reason = KNOWN_FAILURES.get((test, key))
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


def _sdk_sandbox_operations() -> set[tuple[str, str]]:
    return {key for key, op in operations().items() if op.tag == "sandboxes"}


def test_every_sdk_sandbox_operation_is_decided() -> None:
    """The SDK's sandbox operations are exactly: ours that we check, exempt ones, NOT_YET."""
    sdk, served = _sdk_sandbox_operations(), _keys(_operations(ours()))
    undecided = sdk - _keys(CLAIMED) - _keys(_exempt()) - _keys(NOT_YET)
    assert not undecided, f"new in the SDK: serve them or list them in NOT_YET: {sorted(undecided)}"
    assert _keys(NOT_YET) <= sdk, f"NOT_YET lists what the SDK has not: {sorted(_keys(NOT_YET) - sdk)}"
    assert not _keys(NOT_YET) & served, f"served now, take out of NOT_YET: {sorted(_keys(NOT_YET) & served)}"


def test_known_failures_are_current() -> None:
    tests, keys = {test for test, _ in KNOWN_FAILURES}, {key for _, key in KNOWN_FAILURES}
    assert tests <= set(globals()), f"KNOWN_FAILURES names no such test: {sorted(tests - set(globals()))}"
    assert keys <= set(_operations(ours())), f"KNOWN_FAILURES names routes we do not serve: " \
                                             f"{sorted(keys - set(_operations(ours())))}"


@pytest.mark.parametrize("key", _params("test_the_sdk_has_the_operation", CLAIMED))
def test_the_sdk_has_the_operation(key: tuple[str, str]) -> None:
    assert _sdk(key) is not None, \
        f"{' '.join(key)} is not an operation of the e2b SDK's client: list it in STRATA_ONLY (test_e2b_spec.py)"


def _checked(key: tuple[str, str]) -> None:
    if _sdk(key) is None:
        pytest.skip("not an SDK operation (test_the_sdk_has_the_operation fails)")


@pytest.mark.parametrize("key", _params("test_success_codes_are_ones_the_sdk_handles", CLAIMED))
def test_success_codes_are_ones_the_sdk_handles(key: tuple[str, str]) -> None:
    _checked(key)
    assert not (problems := status_problems(ours(), key)), "\n".join(problems)


@pytest.mark.parametrize("key", _params("test_response_has_what_the_sdk_reads", CLAIMED))
def test_response_has_what_the_sdk_reads(key: tuple[str, str]) -> None:
    _checked(key)
    assert not (problems := response_problems(ours(), key)), "\n".join(problems)


@pytest.mark.parametrize("key", _params("test_sample_response_parses_with_the_sdk", CLAIMED))
def test_sample_response_parses_with_the_sdk(key: tuple[str, str]) -> None:
    _checked(key)
    assert not (problems := parse_problems(ours(), key)), "\n".join(problems)


@pytest.mark.parametrize("key", _params("test_request_body_fits_the_sdk", CLAIMED))
def test_request_body_fits_the_sdk(key: tuple[str, str]) -> None:
    _checked(key)
    assert not (problems := request_problems(ours(), key)), "\n".join(problems)


@pytest.mark.parametrize("key", _params("test_sdk_request_validates_against_ours", CLAIMED))
def test_sdk_request_validates_against_ours(key: tuple[str, str]) -> None:
    _checked(key)
    assert not (problems := validation_problems(ours(), key)), "\n".join(problems)


@pytest.mark.parametrize("key", _params("test_strata_only_routes_are_not_sdk_operations", sorted(STRATA_ONLY)))
def test_strata_only_routes_are_not_sdk_operations(key: tuple[str, str]) -> None:
    """STRATA_ONLY says E2B has no such operation; the SDK's client must not call it either."""
    assert _sdk(key) is None, f"the e2b SDK's client calls {' '.join(key)} ({_sdk(key).name}): it is not " \
                              "Strata's own; move it to DEVIATES or out of STRATA_ONLY (test_e2b_spec.py)"
