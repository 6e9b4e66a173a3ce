"""API key checks for the elastic EP endpoints, mirroring SGLang's admin rule.

SGLang 0.5.23 (``sglang.srt.utils.auth.decide_request_auth``) marks admin endpoints
``AuthLevel.ADMIN_OPTIONAL``, reads such as ``GET /is_scaling_elastic_ep`` and
``GET /hicache/storage-backend`` as well as writes. Its rule for those:

| server configured with          | request must carry                     |
|---------------------------------|----------------------------------------|
| ``--admin-api-key`` (any other) | ``Authorization: Bearer <admin key>``  |
| only ``--api-key``              | ``Authorization: Bearer <api key>``    |
| neither                         | nothing                                |

With both keys set the plain API key is refused. Only paths starting with ``/health``,
``/ready`` or ``/metrics`` skip the check (probes, scrapers); ``/elastic_ep/health`` does not
start with ``/health`` and is an admin report, so it follows the admin rule too. Every
elastic EP endpoint, read or write, is ``ADMIN_OPTIONAL``: this module decides exactly as
SGLang does for that level (a test compares both over every combination).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

# (authorization header, is_write) -> None when allowed, else the HTTP status to answer.
ApiKeyCheck = Callable[[str | None, bool], "AuthFailure | None"]


@dataclass(frozen=True)
class AuthFailure:
    status: int
    message: str


def _bearer_matches(authorization: str | None, expected: str) -> bool:
    if not authorization:
        return False
    parts = authorization.split(" ", 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    return secrets.compare_digest(parts[1], expected)


def decide_admin_optional(
    authorization: str | None, *, api_key: str | None, admin_api_key: str | None
) -> bool:
    """SGLang's ``AuthLevel.ADMIN_OPTIONAL`` decision: is this request allowed?"""
    if admin_api_key:
        return _bearer_matches(authorization, admin_api_key)
    if api_key:
        return _bearer_matches(authorization, api_key)
    return True


def sglang_admin_auth(api_key: str | None, admin_api_key: str | None) -> ApiKeyCheck | None:
    """The check for a server started with ``--api-key``/``--admin-api-key``; None if open."""
    if not api_key and not admin_api_key:
        return None
    flag = "--admin-api-key" if admin_api_key else "--api-key"

    def check(authorization: str | None, is_write: bool) -> AuthFailure | None:
        if decide_admin_optional(authorization, api_key=api_key, admin_api_key=admin_api_key):
            return None
        what = "change" if is_write else "read"
        return AuthFailure(
            status=401,
            message=(
                f"Unauthorized: to {what} elastic EP state send 'Authorization: Bearer <key>' "
                f"with the key the server was started with ({flag})"
            ),
        )

    return check
