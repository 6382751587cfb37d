"""Errors Strata raises on purpose.

Every failure a user can cause or meet (bad input, a missing object, a corrupt
chunk, a dead object store) is a `StrataError` whose message is one line that
names the thing at fault. The CLI prints that line and exits non-zero; the API
maps the classes to HTTP status codes. Anything else escaping is a bug.
"""

from __future__ import annotations


class StrataError(Exception):
    """Base class: a failure with a message fit to show a user as is."""


class InvalidInput(StrataError):
    """The caller gave something malformed (a bad name, size, option or file)."""


class NotFound(StrataError):
    """A named object (key, ref, manifest, chunk) does not exist."""


class Conflict(StrataError):
    """The request is valid but the object is in the wrong state for it
    (pausing a paused sandbox, deleting a snapshot a template uses)."""


class CorruptObject(StrataError):
    """Stored bytes fail verification: wrong digest, undecodable, truncated."""


class MissingChunk(StrataError):
    """A manifest names a chunk the store does not hold."""


class BackendError(StrataError):
    """The object store refused or failed a request in a way retrying won't fix."""


class BackendUnavailable(BackendError):
    """The object store could not be reached or answered with a transient error.

    This is the only error the retry wrapper retries.
    """


class AccessDenied(BackendError):
    """The object store rejected our credentials or permissions."""
