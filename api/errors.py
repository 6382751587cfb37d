"""Every error the API answers with, and the one place that maps them to HTTP.

Errors are `{"code", "message"}` with:

    error class              status          meaning
    NotFound                 404             unknown id, ref, template
    InvalidInput, bad body   400             nothing was changed
    Conflict, MissingChunk   409             wrong state / snapshot incomplete
    Unauthorized             401             a volume content request without that volume's token
    Forbidden                403             a sandbox port without its traffic access token
    AgentBusy                409             another command holds the sandbox's agent
    CorruptObject            409             stored data fails verification (`strata verify` names it)
    TooLarge                 413             upload over the node's limit
    Capacity, PoolExhausted  429             node full, no address left (Should-Retry: false)
    BackendUnavailable       503             object store down (Should-Retry: false)
    AccessDenied, BackendError 502           the object store refused the request or the node's credentials
    AgentError               502             the guest agent did not answer or answered nonsense
    AgentTimeout             504             the guest command did not finish in its timeout
    other StrataError        500             e.g. the VMM failed; message says why
    any other exception      500             a bug: the message names the exception, the log has the traceback

Bad stored data (a corrupt record, manifest or chunk) is never a 500: it
is CorruptObject, NotFound or MissingChunk, raised where it is read.

The API's own failures (Capacity, Unauthorized, Forbidden, TooLarge) are defined in
api/exceptions.py, without FastAPI, so the command line can raise them
without loading the web framework.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from layerstore.errors import (BackendError, BackendUnavailable, Conflict, CorruptObject, InvalidInput,
                               MissingChunk, NotFound, StrataError)
from vmm.agent import AgentBusy, AgentError, AgentTimeout
from vmm.network import PoolExhausted

from . import models as m
from .exceptions import Capacity, Forbidden, TooLarge, Unauthorized
from .teams import QuotaExceeded


# first match wins: TooLarge before its base class InvalidInput
STATUS: tuple[tuple[type[StrataError], int], ...] = (
    (NotFound, 404), (TooLarge, 413), (InvalidInput, 400), (Conflict, 409), (MissingChunk, 409), (Capacity, 429),
    (PoolExhausted, 429), (Unauthorized, 401), (Forbidden, 403),
    (CorruptObject, 409), (AgentBusy, 409), (AgentTimeout, 504), (AgentError, 502),
    (BackendUnavailable, 503), (BackendError, 502))  # AccessDenied is a BackendError
NO_RETRY = (429, 503)  # E2B's SDK retries unless told not to; neither clears up by retrying at once
LIMIT_HEADER = "X-Strata-Limit"  # on a 429: "team" (the team's quota, the same on every node) or "node" (this one is full)
DOCUMENTED = {code: {"model": m.Error} for code in (400, 401, 403, 404, 409, 413, 429, 500, 502, 503, 504)}


def status_of(exc: StrataError) -> int:
    return next((code for cls, code in STATUS if isinstance(exc, cls)), 500)


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)


async def _strata_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StrataError)
    request.app.state.node.metrics.error(exc)
    status = status_of(exc)
    headers = {"Should-Retry": "false"} if status in NO_RETRY else {}
    if status == 429:
        headers[LIMIT_HEADER] = "team" if isinstance(exc, QuotaExceeded) else "node"
    return error_response(status, str(exc), headers or None)


async def _bad_request(_request: Request, exc: Exception) -> JSONResponse:
    # E2B answers a malformed body with 400, not FastAPI's 422
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return error_response(400, f"invalid request: {where + ': ' if where else ''}{first.get('msg', 'malformed')}")


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, str(exc.detail))


async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    # Starlette still re-raises it after this answer, so the server logs the traceback
    return error_response(500, f"internal error ({type(exc).__name__}: {str(exc)[:300]}); the node's log has the "
                               "traceback")


def install(app: FastAPI) -> None:
    """Answer every error of `app` as `{"code", "message"}` with the status above."""
    app.add_exception_handler(StrataError, _strata_error)
    app.add_exception_handler(RequestValidationError, _bad_request)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
