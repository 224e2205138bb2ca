"""`relay serve-reward`'s key (runtime/endpoint_auth.py): its server and its client over loopback HTTP.
Beyond loopback the server needs a key; with one, a call without it or with another gets 401 and is
counted, and the client (a remote reward source) sends RELAY_REWARD_KEY."""

import threading

import pytest

from reward_service.config import RewardSource, SourceKind
from reward_service.remote import RemoteReward, serve
from reward_service.sources import build_source


@pytest.fixture
def keyed():
    """A serve-reward server on a free loopback port scoring len(response), with key "s3cret-key"."""
    server = serve(lambda prompts, responses, metadata: [len(r) for r in responses], port=0, key="s3cret-key")
    server.daemon_threads = False  # so server_close() joins its handlers
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()
    server.server_close()


def test_only_calls_with_the_key_are_scored_and_the_others_counted(keyed):
    server, url = keyed
    for key in ("", "wrong", "s3cret-ke"):
        r = RemoteReward(url, 2.0, max_retries=2, max_concurrency=1, key=key).score(["p"], ["abc"], [{}])
        # refused, not retried (a retry cannot bring the key), and the line says where the key goes
        assert r.scores == [None] and r.retried == 0 and "HTTP 401" in r.errors[0] and "RELAY_REWARD_KEY" in r.errors[0]
    assert server.check.refused == 3
    r = RemoteReward(url, 2.0, max_retries=0, max_concurrency=2, key="s3cret-key").score(
        ["p"] * 2, ["a", "bb"], [{}] * 2
    )
    assert r.scores == [1.0, 2.0] and not r.errors and server.check.refused == 3


def test_a_remote_source_sends_relay_reward_key(keyed, monkeypatch):
    """The source as the scoring service builds it reads the key from its environment, where the
    trainer forwards the driver's (orchestrator/loop/roles.py)."""
    server, url = keyed
    source = RewardSource(kind=SourceKind.remote, url=url, timeout_s=2.0, max_retries=0)
    assert build_source(source).score(["p"], ["abc"], [{}]).scores == [None]  # no key in the environment
    monkeypatch.setenv("RELAY_REWARD_KEY", "s3cret-key")
    assert build_source(source).score(["p"], ["abc"], [{}]).scores == [3.0]
    assert server.check.refused == 1


def test_serve_reward_refuses_to_listen_beyond_loopback_without_a_key(tmp_path, monkeypatch, capsys):
    from orchestrator.cli import main

    for host in ("0.0.0.0", "10.0.0.5", "rewards.example"):
        with pytest.raises(ValueError, match=r"--host: listening on .* RELAY_REWARD_KEY"):
            serve(lambda p, r, m: [], host=host, port=0)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("reward:\n  sources:\n    - kind: math_answer\n")
    monkeypatch.delenv("RELAY_REWARD_KEY", raising=False)
    assert main(["serve-reward", str(cfg), "--host", "0.0.0.0", "--port", "0"]) == 2  # before it serves anything
    err = capsys.readouterr().err
    assert "--host: listening on '0.0.0.0' (beyond loopback) needs a key" in err and "RELAY_REWARD_KEY" in err
