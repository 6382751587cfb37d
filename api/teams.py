"""Teams: whose objects a caller sees and may change, and per-team quotas.

Every API key belongs to a team (`STRATA_API_KEYS` entries `TEAM:KEY`; a
bare `KEY` is team `default`). What a team creates records it as owner:
sandbox records (`team`), snapshots (annotation `team`), templates and image
refs (`owner`); objects from before teams belong to `default`.

    caller           sees                  may change
    team T key       T's objects           T's objects; a name another team
                                           holds is 409, and nothing changes
    admin key        every team's objects  everything

Another team's object answers exactly as a missing one (404, same message),
so ids and names leak nothing. These checks live here and in `Node` /
`Catalog`, which take the caller; the routes only pass it on.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from layerstore.config import DEFAULT_TEAM, NodeConfig
from layerstore.errors import Conflict, NotFound

from .exceptions import Capacity


@dataclass(frozen=True)
class Caller:
    team: str
    admin: bool = False

    def sees(self, owner: str | None) -> bool:
        return self.admin or (owner or DEFAULT_TEAM) == self.team

    def check_sees(self, owner: str | None, missing: str) -> None:
        """NotFound(`missing`) unless the caller sees an object of `owner`."""
        if not self.sees(owner):
            raise NotFound(missing)

    def check_may_replace(self, owner: str | None, what: str) -> None:
        """Conflict unless the caller may overwrite an object of `owner`."""
        if not self.sees(owner):
            raise Conflict(f"{what} belongs to another team: choose another name")


ADMIN = Caller(DEFAULT_TEAM, admin=True)  # what the node itself acts as (reaper, warm pool, CLI)


def same_secret(given: str | None, expected: str) -> bool:
    """Whether `given` is the secret `expected`, in constant time. Compared
    as UTF-8 bytes: `hmac.compare_digest` raises on str with non-ASCII
    characters (a 500), and a header or query may carry any."""
    encoded = (given or "").encode("utf-8", "surrogatepass")
    return hmac.compare_digest(encoded, expected.encode("utf-8", "surrogatepass")) and bool(given)


def caller_of(given: str | None, config: NodeConfig) -> Caller | None:
    """The caller a key belongs to, None if it is no key of this node.
    Every configured key is compared, each in constant time."""
    teams = [team for team, key in config.api_keys if same_secret(given, key)]  # admin keys too
    admin = [key for _team, key in config.admin_keys if same_secret(given, key)]
    return Caller(teams[0], admin=bool(admin)) if teams else None


class QuotaExceeded(Capacity):
    """A team is at one of its team_max_* limits (429)."""


def check_quota(config: NodeConfig, caller: Caller, *, setting: str, used: int, adding: int, unit: str = "") -> None:
    """QuotaExceeded if `caller`'s team would go past its `setting` limit."""
    limit = config.team_limit(getattr(config, setting), caller.team)
    if limit is not None and used + adding > limit:
        raise QuotaExceeded(f"team {caller.team} is over its quota {setting}: it has {used}{unit}, this needs "
                            f"{adding}{unit} more and the limit is {limit}{unit}")
