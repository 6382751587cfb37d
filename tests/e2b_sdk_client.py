"""What the `e2b` SDK's generated API client (e2b/api/client/) says about E2B's REST API.

The SDK's client is generated from E2B's OpenAPI spec: one module per operation
under api/<tag>/, attrs models under models/. This module reads it back:

- method and path (of the API's client and the volume content API's): from the dict literal in each module's `_get_kwargs`, read
  with `ast` (an f-string's {sandbox_id} becomes {sandboxID}), so no arguments
  need inventing;
- status codes: from the `if response.status_code == N:` branches of
  `_parse_response`, read with `ast`; a branch's model is the class whose
  `from_dict` it calls, parsed once per list item when the branch loops;
- a model's fields: JSON names and which are required from its `from_dict`
  (`d.pop("name")` is required, `d.pop("name", UNSET)` optional, as attrs
  has it: required fields are those without a default); types from the attrs
  annotations, `Unset` and `None` members meaning optional and nullable.

Used by tests/test_e2b_sdk.py; nothing here knows about Strata.
"""

from __future__ import annotations

import ast
import datetime
import enum
import importlib
import inspect
import pkgutil
import re
import sys
import textwrap
import types
import typing
import uuid
from dataclasses import dataclass
from functools import cache

import attrs

PACKAGES = ("e2b.api.client", "e2b.volume.client")  # the API's client, and the volume content API's
SAMPLE_TIME = datetime.datetime(2025, 1, 1, tzinfo=datetime.timezone.utc)


@dataclass(frozen=True)
class Reply:
    """A status code `_parse_response` accepts, and the model it parses (None: no body)."""
    model: type | None
    many: bool = False  # a JSON array of `model`


@dataclass(frozen=True)
class Operation:
    tag: str
    name: str  # module name, e.g. post_sandboxes_sandbox_id_connect
    method: str
    path: str  # E2B's spelling, e.g. /sandboxes/{sandboxID}/connect
    replies: dict[str, Reply]  # status code -> what the SDK parses
    body: type | None  # the request model, if the operation sends a JSON body
    body_optional: bool  # the SDK may call it without a body


@dataclass(frozen=True)
class Field:
    json: str
    required: bool
    types: frozenset[str]  # JSON types; empty: anything
    nullable: bool
    date_time: bool
    enum: frozenset | None  # allowed values, for enum types
    model: type | None  # the attrs model of an object, or of an array's items


def normalized(path: str) -> str:
    """A path with its parameter names erased: /sandboxes/{} for /sandboxes/{sandboxID}."""
    return re.sub(r"\{[^}]*\}", "{}", path)


@cache
def operations() -> dict[tuple[str, str], Operation]:
    """Every operation of the SDK's clients, keyed by (METHOD, normalized path)."""
    found = {}
    for client in PACKAGES:
        api = importlib.import_module(f"{client}.api")
        for tag in pkgutil.iter_modules(api.__path__):
            package = importlib.import_module(f"{api.__name__}.{tag.name}")
            for mod in pkgutil.iter_modules(package.__path__):
                op = _operation(tag.name, importlib.import_module(f"{package.__name__}.{mod.name}"))
                found[op.method, normalized(op.path)] = op
    return found


def _operation(tag: str, module: types.ModuleType) -> Operation:
    method, path = _route(_function(module, "_get_kwargs"))
    body, optional = _body(module)
    return Operation(tag=tag, name=module.__name__.rsplit(".", 1)[1], method=method, path=path,
                     replies=_replies(module), body=body, body_optional=optional)


def _function(module: types.ModuleType, name: str) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(inspect.getsource(getattr(module, name)))).body[0]


def _route(get_kwargs: ast.FunctionDef) -> tuple[str, str]:
    """(METHOD, path) from the {"method": ..., "url": ...} literal."""
    for node in ast.walk(get_kwargs):
        if isinstance(node, ast.Dict):
            items = {k.value: v for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)}
            if {"method", "url"} <= set(items):
                return items["method"].value.upper(), _url(items["url"])
    raise ValueError(f"no method and url in {get_kwargs.name}")


def _url(node: ast.expr) -> str:
    if isinstance(node, ast.Constant):
        return node.value
    return "".join(part.value if isinstance(part, ast.Constant) else "{" + _parameter(part.value) + "}"
                   for part in node.values)


def _parameter(node: ast.expr) -> str:
    """E2B's name of a path parameter from the SDK's variable: sandbox_id -> sandboxID."""
    name = next(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id not in ("str", "quote"))
    head, _, last = name.rpartition("_")
    words = (head.split("_") if head else []) + [last.upper() if last == "id" else last]
    return words[0] + "".join(w[:1].upper() + w[1:] for w in words[1:])


def _replies(module: types.ModuleType) -> dict[str, Reply]:
    """Status code -> Reply, from the `if response.status_code == N:` branches."""
    replies = {}
    for node in ast.walk(_function(module, "_parse_response")):
        code = _status(node)
        if code is not None:
            branch = ast.Module(body=node.body, type_ignores=[])
            parsed = [call.func.value.id for call in ast.walk(branch) if _calls_from_dict(call)]
            many = any(isinstance(n, ast.For) for n in ast.walk(branch))
            replies[str(code)] = Reply(getattr(module, parsed[0]) if parsed else None, many and bool(parsed))
    return replies


def _status(node: ast.AST) -> int | None:
    if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Attribute) and node.test.left.attr == "status_code"
            and isinstance(node.test.ops[0], ast.Eq) and isinstance(node.test.comparators[0], ast.Constant)):
        return node.test.comparators[0].value
    return None


def _calls_from_dict(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "from_dict"
            and isinstance(node.func.value, ast.Name))


def _body(module: types.ModuleType) -> tuple[type | None, bool]:
    """The request model `_get_kwargs` takes as `body`, and whether it may be left out."""
    parameter = inspect.signature(module._get_kwargs).parameters.get("body")
    if parameter is None:
        return None, True
    members = [t for t in _members(_hints(module._get_kwargs, module)["body"]) if attrs.has(t)]
    return (members[0] if members else None), parameter.default is not inspect.Parameter.empty


# --- models -------------------------------------------------------------------------------
def fields(model: type) -> list[Field]:
    """The fields a model's from_dict reads, in its order."""
    hints = _hints(model, sys.modules[model.__module__])
    python = {f.name: f.default is attrs.NOTHING for f in attrs.fields(model)}
    return [_field(name, required and python[attribute], hints[attribute])
            for name, attribute, required in _json_names(model) if attribute in python]


def required_fields(model: type) -> list[Field]:
    """The fields a model's from_dict requires (attrs: those without a default)."""
    return [f for f in fields(model) if f.required]


def _json_names(model: type) -> list[tuple[str, str, bool]]:
    """(JSON name, attribute, required) for each `d.pop(...)` of from_dict."""
    names = []
    for statement in _function(model, "from_dict").body:
        target = _target(statement)
        for call in ast.walk(statement):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "pop"
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == "d"):
                names.append((call.args[0].value, target, len(call.args) == 1))
    return names


def _target(statement: ast.stmt) -> str | None:
    if isinstance(statement, ast.Assign) and isinstance(statement.targets[0], ast.Name):
        return statement.targets[0].id.lstrip("_")
    return None


def _hints(obj: object, module: types.ModuleType) -> dict[str, object]:
    """Annotations resolved; the models name each other under TYPE_CHECKING only."""
    client = next(p for p in PACKAGES if module.__name__.startswith(p + "."))
    models = importlib.import_module(f"{client}.models")
    return typing.get_type_hints(obj, {**vars(models), **vars(module)})


def _members(annotation: object) -> list:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _members(a)]
    return [annotation]


def _field(json: str, required: bool, annotation: object) -> Field:
    members = [m for m in _members(annotation) if m is not type(None) and getattr(m, "__name__", "") != "Unset"]
    json_types, enums, model = set(), None, None
    for member in members:
        kind, values, inner = _json_type(member)
        json_types |= {kind} if kind else set()
        enums = values if values is not None else enums
        model = inner or model
    return Field(json=json, required=required, types=frozenset(json_types), nullable=type(None) in _members(annotation),
                 date_time=datetime.datetime in members, enum=enums, model=model)


def _json_type(annotation: object) -> tuple[str | None, frozenset | None, type | None]:
    """(JSON type, enum values, attrs model) of one annotation."""
    origin = typing.get_origin(annotation) or annotation
    if origin is list:
        (item,) = typing.get_args(annotation) or (None,)
        return "array", None, item if attrs.has(item) else None
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "string", frozenset(m.value for m in annotation), None
    if attrs.has(annotation):
        return "object", None, annotation
    simple = {str: "string", bool: "boolean", int: "integer", float: "number", dict: "object",
              datetime.datetime: "string", datetime.date: "string", uuid.UUID: "string"}
    return simple.get(origin), None, None


def build(model: type) -> object:
    """An instance of `model` with only its required fields set, each to a value of its type."""
    hints = _hints(model, sys.modules[model.__module__])
    return model(**{f.name: _value(hints[f.name]) for f in attrs.fields(model)
                    if f.init and f.default is attrs.NOTHING})


def _value(annotation: object) -> object:
    member = next(m for m in _members(annotation) if getattr(m, "__name__", "") != "Unset")
    origin = typing.get_origin(member) or member
    if member is type(None):
        return None
    if isinstance(member, type) and issubclass(member, enum.Enum):
        return next(iter(member))
    if attrs.has(member):
        return build(member)
    defaults = {str: "x", bool: True, int: 1, float: 1.0, list: [], dict: {}, datetime.datetime: SAMPLE_TIME,
                datetime.date: SAMPLE_TIME.date(), uuid.UUID: uuid.UUID(int=0)}
    return defaults[origin]
