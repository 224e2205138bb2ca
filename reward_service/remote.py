"""Rewards over HTTP: a client with hard deadlines, and the server behind `relay serve-reward`.

Wire format: POST {"prompts": [...], "responses": [...], "metadata": [...]} -> {"rewards": [...]}.
With a key (RELAY_REWARD_KEY, runtime/endpoint_auth.py) the server answers only calls that send it as
`Authorization: Bearer <key>` (401 otherwise, counted), and the client sends it; beyond loopback the
server requires one.
"""

from __future__ import annotations

import json
import logging
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from runtime.endpoint_auth import REWARD_KEY_ENV, UNAUTHORIZED, KeyCheck, bearer, keyless_exposure

log = logging.getLogger(__name__)


@dataclass
class RemoteResult:
    """A remote source's answer for one call: a score per sample (None: lost), with lost and retried chunks."""

    scores: list[float | None]  # None: this sample got no usable reward
    timeouts: int = 0  # chunks lost to a timeout (their last attempt timed out, or the call's deadline hit)
    errors: list[str] = field(default_factory=list)  # one line per lost chunk
    retried: int = 0  # failed attempts of chunks that a retry then answered


class RemoteReward:
    """POSTs the batch in up to `max_concurrency` chunks at once. Each chunk gets `timeout_s` per
    attempt and `max_retries` retries with exponential backoff; the whole call has a hard deadline,
    so a server that hangs, trickles or dies costs at most that long and marks only its samples.
    `key`: sent as `Authorization: Bearer <key>` (the server's RELAY_REWARD_KEY); "" sends none."""

    def __init__(
        self,
        url: str,
        timeout_s: float,
        max_retries: int,
        max_concurrency: int,
        backoff_s: float = 0.2,
        key: str = "",
    ):
        self.url, self.timeout_s, self.max_retries = url, timeout_s, max_retries
        self.max_concurrency, self.backoff_s, self.key = max(1, max_concurrency), backoff_s, key

    @property
    def deadline_s(self) -> float:
        attempts = self.max_retries + 1
        return attempts * self.timeout_s + self.backoff_s * (2**attempts - 1) + 1.0

    def score(self, prompts: list[str], responses: list[str], metadata: list[dict]) -> RemoteResult:
        n = len(responses)
        size = max(1, math.ceil(n / self.max_concurrency))
        chunks = [(i, min(i + size, n)) for i in range(0, n, size)]
        result = RemoteResult([None] * n)
        # a fresh pool per call: threads stuck on a dead server never block the next call
        pool = ThreadPoolExecutor(max_workers=len(chunks) or 1, thread_name_prefix="relay-remote")
        futures = {pool.submit(self._post, prompts[a:b], responses[a:b], metadata[a:b]): (a, b) for a, b in chunks}
        done, late = wait(futures, timeout=self.deadline_s)
        pool.shutdown(wait=False, cancel_futures=True)
        for _ in late:
            result.timeouts += 1
            result.errors.append(f"{self.url}: no answer within the {self.deadline_s:.1f} s deadline")
        for fut in done:
            a, b = futures[fut]
            scores, error, failed, timed_out = fut.result()
            if scores is None:
                result.timeouts += timed_out
                result.errors.append(f"{self.url}: {error}")
            else:
                result.retried += failed
                result.scores[a:b] = scores
        return result

    def _post(self, prompts, responses, metadata) -> tuple[list[float | None] | None, str, int, bool]:
        """(scores or None, the last error, the failed attempts, whether the last failure was a timeout)."""
        body = json.dumps({"prompts": prompts, "responses": responses, "metadata": metadata}).encode()
        error, timed_out = "", False
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            headers = {"Content-Type": "application/json", **bearer(self.key)}
            request = urllib.request.Request(self.url, data=body, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    raw = reply.read()
            except urllib.error.HTTPError as e:
                error, timed_out = f"HTTP {e.code}", False
                if e.code == 401:
                    error += f": the server wants its key: set {REWARD_KEY_ENV} to it where relay runs"
                if e.code < 500:
                    return None, error, attempt + 1, False  # the request itself is wrong: retrying will not help
                continue
            except (TimeoutError, urllib.error.URLError, ConnectionError, OSError) as e:
                reason = getattr(e, "reason", e)
                timed_out = isinstance(reason, TimeoutError)
                error = (
                    f"timed out after {self.timeout_s} s (attempt {attempt + 1})"
                    if timed_out
                    else f"unreachable: {reason}"
                )
                continue
            scores, error = _parse(raw, len(responses))
            return scores, error, attempt, False  # a garbage reply is an error, not retried
        return None, error, self.max_retries + 1, timed_out


def _parse(raw: bytes, n: int) -> tuple[list[float | None] | None, str]:
    """Validate a reply: {"rewards": [n numbers]}; non-finite entries become None."""
    try:
        rewards = json.loads(raw)["rewards"]
    except (ValueError, KeyError, TypeError):
        return None, f"garbage reply: {raw[:60]!r}"
    if not isinstance(rewards, list) or len(rewards) != n:
        return (
            None,
            f"expected {n} rewards, got {len(rewards) if isinstance(rewards, list) else type(rewards).__name__}",
        )
    ok = lambda r: isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r)  # noqa: E731
    return [float(r) if ok(r) else None for r in rewards], ""


def _length(headers) -> int:
    """The body's Content-Length; a malformed one reads as no body (then a 400)."""
    try:
        return max(0, int(headers.get("Content-Length", 0)))
    except ValueError:
        return 0


def serve(score_fn, host: str = "127.0.0.1", port: int = 8000, key: str = "") -> ThreadingHTTPServer:
    """An HTTP server answering POST /score with score_fn(prompts, responses, metadata) -> floats.
    With `key`, only calls that send it (`Authorization: Bearer <key>`) are scored, the others answered
    401 and counted (the server's `check.refused`); beyond loopback a key is required (ValueError).
    Returns the server; call serve_forever() (or run it in a thread)."""
    refused = keyless_exposure(host, key, REWARD_KEY_ENV)
    if refused:
        raise ValueError(f"--host: {refused}")
    check = KeyCheck(key)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            raw = self.rfile.read(_length(self.headers))  # read even if refused: closing on unread data resets
            if not check(self.headers.get("Authorization")):
                log.warning(
                    "serve-reward: refused a call from %s without the right key (%d so far)",
                    self.client_address[0],
                    check.refused,
                )
                return self._reply(401, json.dumps(UNAUTHORIZED))
            try:
                payload = json.loads(raw)
                n = len(payload["responses"])
                rewards = score_fn(payload["prompts"], payload["responses"], payload.get("metadata") or [{}] * n)
                body, code = (
                    json.dumps({"rewards": [None if r is None or not math.isfinite(r) else r for r in rewards]}),
                    200,
                )
            except (ValueError, KeyError, TypeError) as e:
                body, code = json.dumps({"error": f"bad request: {e}"}), 400
            except Exception as e:  # a failing reward must answer, not hang the client
                log.exception("serve-reward: scoring failed")
                body, code = json.dumps({"error": f"{type(e).__name__}: {e}"}), 500
            self._reply(code, body)

        def _reply(self, code: int, body: str) -> None:
            data = body.encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # one line, not a traceback per late answer
                log.warning("serve-reward: the client left before its answer (past its timeout?)")

        def log_message(self, fmt, *args):
            log.debug("serve-reward: " + fmt, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.check = check  # its refusals, for whoever serves it
    return server
