"""Content digests: blake3-256, written as 64 lowercase hex characters.

blake3 releases the GIL for large inputs (and `max_threads` lets one hash use
several cores), so hashing 1 MiB chunks from a thread pool scales with cores.
"""

from __future__ import annotations

import re

import blake3

from .errors import InvalidInput

DIGEST_HEX_LEN = 64
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def digest_bytes(data: bytes | memoryview) -> str:
    """Return the blake3-256 digest of `data` as lowercase hex."""
    return blake3.blake3(data).hexdigest()


def is_digest(text: object) -> bool:
    """True if `text` is a well-formed digest (64 lowercase hex characters)."""
    return isinstance(text, str) and _DIGEST_RE.fullmatch(text) is not None


def check_digest(text: object, *, what: str = "digest") -> str:
    """Return `text` if it is a well-formed digest, else raise InvalidInput.

    Digests become object keys and file names, so anything else (upper case,
    slashes, dots) is refused before it gets near a path.
    """
    if not is_digest(text):
        raise InvalidInput(f"malformed {what}: {str(text)[:80]!r} (want 64 lowercase hex characters)")
    return text  # type: ignore[return-value]
