"""Remote rewards over loopback HTTP: relay serve-reward, a slow server, a garbage server, a dead one."""
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from reward_service.combine import run_source
from reward_service.config import RewardSource, SourceKind
from reward_service.remote import RemoteReward
from reward_service.sources import build_source
from rollout.weight_sync import free_port

REPO = Path(__file__).resolve().parents[2]


class Server:
    """A loopback HTTP server whose reply is `reply(payload) -> (status, bytes)`; counts requests."""

    def __init__(self, reply, delay_s=0.0):
        self.requests = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                outer.requests += 1
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                time.sleep(delay_s)
                status, body = reply(payload)
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def lengths(payload):
    return 200, json.dumps({"rewards": [len(r) for r in payload["responses"]]}).encode()


RESPONSES = ["a", "bb", "ccc", "dddd", "eeeee"]


def client(url, timeout_s=2.0, retries=1, concurrency=2):
    return RemoteReward(url, timeout_s, retries, concurrency, backoff_s=0.05)


def test_good_server_in_concurrent_chunks():
    s = Server(lengths)
    try:
        r = client(s.url, concurrency=3).score(["p"] * 5, RESPONSES, [{}] * 5)
        assert r.scores == [1.0, 2.0, 3.0, 4.0, 5.0] and r.timeouts == 0 and not r.errors
        assert s.requests == 3  # 5 samples in 3 concurrent chunks
    finally:
        s.close()


def test_slow_server_trips_the_timeout_and_cannot_hang_the_run():
    s = Server(lengths, delay_s=5.0)
    try:
        c = client(s.url, timeout_s=0.3, retries=1, concurrency=2)
        start = time.monotonic()
        r = c.score(["p"] * 5, RESPONSES, [{}] * 5)
        elapsed = time.monotonic() - start
        assert elapsed < c.deadline_s < 3.0
        assert r.scores == [None] * 5 and r.timeouts == 4  # 2 chunks x 2 attempts
        assert "timed out after 0.3 s" in r.errors[0]
    finally:
        s.close()


@pytest.mark.parametrize("reply, error", [
    (lambda p: (200, b"<html>oops</html>"), "garbage reply"),
    (lambda p: (200, json.dumps({"rewards": [1.0]}).encode()), "expected 5 rewards, got 1"),
    (lambda p: (200, json.dumps({"score": 1}).encode()), "garbage reply"),
    (lambda p: (500, b"{}"), "HTTP 500"),
    (lambda p: (400, b"{}"), "HTTP 400"),
])
def test_garbage_and_errors_mark_the_chunk_invalid(reply, error):
    s = Server(reply)
    try:
        r = client(s.url, concurrency=1).score(["p"] * 5, RESPONSES, [{}] * 5)
        assert r.scores == [None] * 5 and error in r.errors[0]
    finally:
        s.close()


def test_non_finite_entries_mark_single_samples():
    s = Server(lambda p: (200, b'{"rewards": [1, NaN, "x", true, 2.5]}'))
    try:
        assert client(s.url, concurrency=1).score(["p"] * 5, RESPONSES, [{}] * 5).scores == [1.0, None, None, None, 2.5]
    finally:
        s.close()


def test_unreachable_server():
    r = client(f"http://127.0.0.1:{free_port()}/score", retries=0).score(["p"], ["a"], [{}])
    assert r.scores == [None] and "unreachable" in r.errors[0]


def test_remote_source_through_relay_serve_reward(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("reward:\n  sources:\n    - kind: math_answer\n    - kind: format\n      pattern: '^####'\n      weight: 0.5\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve-reward", str(cfg), "--port", str(port)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert f"on http://127.0.0.1:{port}/score" in line, proc.stderr.read() if proc.poll() is not None else line
        source = build_source(RewardSource(kind=SourceKind.remote, url=f"http://127.0.0.1:{port}/score", timeout_s=5))
        responses = ["#### 42", "#### 41", "42", "#### 1"]
        meta = [{"answer": "42"}, {"answer": "42"}, {"answer": "42"}, {}]
        run = run_source(source, ["q"] * 4, responses, meta, timeout_s=5)
        # 1 + .5; 0 + .5; 1 + 0; no reference -> the server cannot judge -> invalid here
        assert run.scores == [1.5, 0.5, 1.0, None] and run.timeouts == 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_serve_reward_rejects_a_bad_config(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("reward:\n  sources:\n    - kind: remote\n")
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "serve-reward", str(cfg)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "reward.sources.0.url: a remote source needs url" in out.stderr
