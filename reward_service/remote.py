"""Rewards over HTTP: a client with hard deadlines, and the server behind `relay serve-reward`.

Wire format: POST {"prompts": [...], "responses": [...], "metadata": [...]} -> {"rewards": [...]}.
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

log = logging.getLogger(__name__)


@dataclass
class RemoteResult:
    scores: list[float | None]  # None: this sample got no usable reward
    timeouts: int = 0  # chunks that missed their deadline
    errors: list[str] = field(default_factory=list)  # one line per failed chunk


class RemoteReward:
    """POSTs the batch in up to `max_concurrency` chunks at once. Each chunk gets `timeout_s` per
    attempt and `max_retries` retries with exponential backoff; the whole call has a hard deadline,
    so a server that hangs, trickles or dies costs at most that long and marks only its samples."""

    def __init__(self, url: str, timeout_s: float, max_retries: int, max_concurrency: int, backoff_s: float = 0.2):
        self.url, self.timeout_s, self.max_retries = url, timeout_s, max_retries
        self.max_concurrency, self.backoff_s = max(1, max_concurrency), backoff_s

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
            scores, error, timed_out = fut.result()
            result.timeouts += timed_out
            if error:
                result.errors.append(f"{self.url}: {error}")
            else:
                result.scores[a:b] = scores
        return result

    def _post(self, prompts, responses, metadata) -> tuple[list[float | None] | None, str, int]:
        body = json.dumps({"prompts": prompts, "responses": responses, "metadata": metadata}).encode()
        error, timeouts = "", 0
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    raw = reply.read()
            except TimeoutError:
                error, timeouts = f"timed out after {self.timeout_s} s (attempt {attempt + 1})", timeouts + 1
                continue
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}"
                if e.code < 500:
                    return None, error, timeouts  # the request itself is wrong: retrying will not help
                continue
            except (urllib.error.URLError, ConnectionError, OSError) as e:
                reason = getattr(e, "reason", e)
                if isinstance(reason, TimeoutError):
                    error, timeouts = f"timed out after {self.timeout_s} s (attempt {attempt + 1})", timeouts + 1
                else:
                    error = f"unreachable: {reason}"
                continue
            return (*_parse(raw, len(responses)), timeouts)
        return None, error, timeouts


def _parse(raw: bytes, n: int) -> tuple[list[float | None] | None, str]:
    """Validate a reply: {"rewards": [n numbers]}; non-finite entries become None."""
    try:
        rewards = json.loads(raw)["rewards"]
    except (ValueError, KeyError, TypeError):
        return None, f"garbage reply: {raw[:60]!r}"
    if not isinstance(rewards, list) or len(rewards) != n:
        return None, f"expected {n} rewards, got {len(rewards) if isinstance(rewards, list) else type(rewards).__name__}"
    ok = lambda r: isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r)  # noqa: E731
    return [float(r) if ok(r) else None for r in rewards], ""


def serve(score_fn, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """An HTTP server answering POST /score with score_fn(prompts, responses, metadata) -> floats.
    Returns the server; call serve_forever() (or run it in a thread)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            try:
                payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                n = len(payload["responses"])
                rewards = score_fn(payload["prompts"], payload["responses"], payload.get("metadata") or [{}] * n)
                body, code = json.dumps({"rewards": [None if r is None or not math.isfinite(r) else r for r in rewards]}), 200
            except (ValueError, KeyError, TypeError) as e:
                body, code = json.dumps({"error": f"bad request: {e}"}), 400
            except Exception as e:  # a failing reward must answer, not hang the client
                log.exception("serve-reward: scoring failed")
                body, code = json.dumps({"error": f"{type(e).__name__}: {e}"}), 500
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

    return ThreadingHTTPServer((host, port), Handler)
