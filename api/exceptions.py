"""The API's own errors, apart from their HTTP statuses (api/errors.py).

Kept free of the web framework so that code the command line loads (team
quotas, builds) can raise them without importing FastAPI, which costs a
`strata` command about half a second of start-up.
"""

from __future__ import annotations

from layerstore.errors import InvalidInput, StrataError


class Capacity(StrataError):
    """The node is full: it holds as many sandboxes as it is configured to, or its disk has no room
    for an upload."""


class Unauthorized(StrataError):
    """A credential of its own is missing or wrong (a volume's bearer token)."""


class Forbidden(StrataError):
    """The caller is known but may not do this (a sandbox port without its traffic token)."""


class TooLarge(InvalidInput):
    """An upload is bigger than the node accepts (config `max_upload`)."""
