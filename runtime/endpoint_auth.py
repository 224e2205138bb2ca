"""Keys for relay's HTTP endpoints: the agent endpoint (rollout/gateway.py) and `relay serve-reward`.

On loopback an endpoint answers anyone on the machine, as before, unless a key is set. Listening on
any other address (e.g. "0.0.0.0" for agents on other machines) needs a key: whoever reaches the
endpoint could otherwise post rewards that train the policy, or use the engines. Clients send the key
as OpenAI's clients do, `Authorization: Bearer <key>`; a call without it, or with another, gets 401
and is counted.

The keys live in environment variables only, never in the YAML: the config is written to the run
folder, sent to wandb and stored in every checkpoint.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import threading

ENDPOINT_KEY_ENV = "RELAY_ENDPOINT_KEY"  # the agent endpoint's key (rollout.endpoint)
REWARD_KEY_ENV = "RELAY_REWARD_KEY"  # `relay serve-reward`'s key, which remote reward sources send


def env_key(env: str) -> str:
    """The key set in the environment variable `env` ("" if none)."""
    return os.environ.get(env, "").strip()


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (a name other than localhost may not be)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def keyless_exposure(host: str, key: str, env: str) -> str:
    """Why serving on `host` without a key is refused ("" if it is not)."""
    if key or is_loopback(host):
        return ""
    return (
        f"listening on {host!r} (beyond loopback) needs a key, or anyone who reaches it can use it: set the "
        f"environment variable {env} (clients send it as `Authorization: Bearer <key>`, an OpenAI client as "
        "its api_key), or listen on 127.0.0.1"
    )


def bearer(key: str) -> dict[str, str]:
    """The header a client sends the key in (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


class KeyCheck:
    """One endpoint's key and the calls it refused (thread-safe: the servers answer on threads).
    Without a key every call passes."""

    def __init__(self, key: str = ""):
        self.key, self.refused, self.lock = key.encode(), 0, threading.Lock()

    def __call__(self, authorization: str | None) -> bool:
        """Whether a call with this Authorization header may pass; a refusal is counted."""
        if not self.key:
            return True
        scheme, _, given = (authorization or "").partition(" ")
        # constant time: a comparison that stops at the first wrong byte tells an attacker how many were right
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.key):
            return True
        with self.lock:
            self.refused += 1
        return False


UNAUTHORIZED = {
    "error": {
        "message": "a missing or wrong key: send the endpoint's key as `Authorization: Bearer <key>`",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
}  # OpenAI's own 401 body, so an OpenAI client raises its AuthenticationError with this message


def protect(app, check: KeyCheck) -> None:
    """Answer every route of the FastAPI `app` with 401 unless `check` passes the call's key."""
    from starlette.responses import JSONResponse

    @app.middleware("http")
    async def authenticate(request, call_next):
        if not check(request.headers.get("authorization")):
            return JSONResponse(UNAUTHORIZED, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)
