"""Remote rewards over loopback HTTP: relay serve-reward, a slow server, a garbage server, a dead one."""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from reward_service.combine import call_counts, run_source
from reward_service.config import RewardSource, SourceKind
from reward_service.remote import RemoteReward, serve
from reward_service.sources import build_source
from runtime.ports import free_port
from tests.helpers import REPO


class Server:
    """A loopback HTTP server whose reply is `reply(payload) -> (status, bytes)`; counts requests and
    answers (as each answer starts). A request with `hold(payload)` true waits for release(), which
    the test calls, before its answer; the bound on that wait only keeps a broken client from
    hanging the test forever."""

    HOLD_LIMIT_S = 60.0

    def __init__(self, reply, hold=lambda payload: False):
        self.requests, self.answered = 0, 0
        self.released = threading.Event()
        lock, outer = threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                with lock:
                    outer.requests += 1
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if hold(payload):
                    outer.released.wait(Server.HOLD_LIMIT_S)
                status, body = reply(payload)
                with lock:
                    outer.answered += 1  # before the write: the client may return as soon as it reads
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the client gave up on this request long ago

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = False  # so close() joins the handlers: none outlives the test
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def release(self):
        self.released.set()

    def close(self):
        self.release()
        self.httpd.shutdown()
        self.httpd.server_close()


def first_attempt_of_each_chunk():
    """A hold: the first request for each distinct chunk waits; a retry of it is answered at once."""
    seen, lock = set(), threading.Lock()

    def hold(payload):
        key = tuple(payload["responses"])
        with lock:
            first = key not in seen
            seen.add(key)
        return first

    return hold


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


def test_a_hanging_server_cannot_hang_the_run():
    s = Server(lengths, hold=lambda payload: True)
    try:
        r = client(s.url, timeout_s=0.3, retries=1, concurrency=2).score(["p"] * 5, RESPONSES, [{}] * 5)
        # the server answers nothing until released below: the client came back without it
        assert s.answered == 0
        assert r.scores == [None] * 5
        # each of the 2 chunks is lost to a timeout, counted once whether it ran out of attempts or, on
        # a stalled machine, hit the call's hard deadline: both name the deadline that cut it
        assert len(r.errors) == 2 and r.timeouts == 2 and r.retried == 0
        assert all("timed out after 0.3 s" in e or "s deadline" in e for e in r.errors), r.errors
    finally:
        s.close()


def test_a_timed_out_attempt_is_retried():
    s = Server(lengths, hold=first_attempt_of_each_chunk())
    try:
        r = client(s.url, timeout_s=1.0, retries=1, concurrency=2).score(["p"] * 5, RESPONSES, [{}] * 5)
        assert r.scores == [1.0, 2.0, 3.0, 4.0, 5.0] and not r.errors
        # each chunk: a first attempt still held now, then a retry that was answered: no sample lost
        assert r.timeouts == 0 and r.retried == 2 and s.requests == 4 and s.answered == 2
    finally:
        s.close()


@pytest.mark.parametrize(
    "reply, error",
    [
        (lambda p: (200, b"<html>oops</html>"), "garbage reply"),
        (lambda p: (200, json.dumps({"rewards": [1.0]}).encode()), "expected 5 rewards, got 1"),
        (lambda p: (200, json.dumps({"score": 1}).encode()), "garbage reply"),
        (lambda p: (500, b"{}"), "HTTP 500"),
        (lambda p: (400, b"{}"), "HTTP 400"),
    ],
)
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


def test_serve_reward_answers_a_departed_client_without_a_traceback(capsys):
    release = threading.Event()
    server = serve(lambda p, r, m: [1.0] * len(r) if release.wait(60) else [], port=0)
    server.daemon_threads = False  # so server_close() joins the late handler
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/score"
        r = client(url, timeout_s=0.3, retries=0).score(["p"], ["a"], [{}])
        assert r.scores == [None] and r.timeouts == 1
    finally:
        release.set()  # the answer now goes to a client that has gone
        server.shutdown()
        server.server_close()
    assert "Traceback" not in capsys.readouterr().err


def test_unreachable_server():
    r = client(f"http://127.0.0.1:{free_port()}/score", retries=0).score(["p"], ["a"], [{}])
    assert r.scores == [None] and "unreachable" in r.errors[0]


def test_remote_source_through_relay_serve_reward(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(
        "reward:\n  sources:\n    - kind: math_answer\n    - kind: format\n      pattern: '^####'\n      weight: 0.5\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "serve-reward", str(cfg), "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "serve-reward", str(cfg)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "reward.sources.0.url: a remote source needs url" in out.stderr


def remote_reward(url, timeout_s, retries=1, concurrency=2):
    """The configured remote source, as the scoring service builds and runs it (issue 25, item 3)."""
    from reward_service.config import RewardConfig
    from reward_service.service import RewardFunction

    source = RewardSource(
        kind=SourceKind.remote, url=url, timeout_s=timeout_s, max_retries=retries, max_concurrency=concurrency
    )
    return RewardFunction(RewardConfig(sources=[source]))


def test_the_service_waits_for_a_retry_of_a_timed_out_attempt():
    # chunk ["a", "bb", "ccc"] hangs on its first attempt only; its retry answers. The service's
    # deadline used to be one attempt's timeout: it cut the call before the retry and voided both chunks
    hold = first_attempt_of_each_chunk()
    s = Server(lengths, hold=lambda payload: payload["responses"][0] == "a" and hold(payload))
    try:
        runs, total, invalid = remote_reward(s.url, timeout_s=1.0).run(["p"] * 5, RESPONSES, [{}] * 5)
        assert total == [1.0, 2.0, 3.0, 4.0, 5.0] and invalid == [False] * 5
        # review A, item 12: reward/timeouts counted this attempt, though no sample was lost
        assert call_counts(runs)["reward/timeouts"] == 0 and call_counts(runs)["reward/retried_attempts"] == 1
        assert s.requests == 3 and s.answered == 2  # 2 chunks, one retried: the first attempt is still held
    finally:
        s.close()


def test_a_chunk_that_fails_for_good_marks_only_its_own_samples():
    s = Server(lengths, hold=lambda payload: payload["responses"][0] == "a")  # every attempt of chunk 1 hangs
    try:
        runs, total, invalid = remote_reward(s.url, timeout_s=0.5).run(["p"] * 5, RESPONSES, [{}] * 5)
        assert invalid == [True, True, True, False, False] and total[3:] == [4.0, 5.0]
        assert runs["remote"].scores == [None, None, None, 4.0, 5.0]
        # one chunk lost, whether both its attempts timed out or (a stalled machine) its hard deadline hit
        assert call_counts(runs)["reward/timeouts"] == 1 and call_counts(runs)["reward/retried_attempts"] == 0
    finally:
        s.close()
