"""The agent endpoint's key (runtime/endpoint_auth.py): through the real `openai` client against the real
server (Gateway, uvicorn on a port) with a stand-in engine. Beyond loopback the endpoint needs a key;
with one, a call without it or with another gets 401 and is counted (endpoint/unauthorized), so no one
who merely reaches it can post rewards that train the policy, or use the engines."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import httpx
import pytest

from learner.tiny_gpt import DEFAULT_ALPHABET, char_tokenizer
from rollout.config import EndpointConfig, SamplingConfig
from rollout.gateway import Gateway

QUESTION = [{"role": "user", "content": "1+2="}]


class SevenEngine:
    """A rollout worker's `complete` as the Batcher calls it: every prompt is answered "7" + EOS."""

    def __init__(self, tok):
        self.tok, self.complete, self.calls = tok, self, 0

    def remote(self, prompts, params):
        self.calls += len(prompts)
        reply = self.tok.encode("7", add_special_tokens=False) + [self.tok.eos_token_id]
        future = Future()
        future.set_result(([(reply, [-0.5] * len(reply), "7", "stop") for _ in prompts], 0))
        return SimpleNamespace(future=lambda: future)


@pytest.fixture
def start(tmp_path):
    """start(key, host) -> (gateway, engine): the endpoint on a free port, shut down after the test."""
    tok = char_tokenizer(DEFAULT_ALPHABET + "<|>")
    tok.save_pretrained(tmp_path / "tok")  # the Gateway loads its tokenizer from the model's folder
    made = []

    def serve(key: str, host: str = "127.0.0.1"):
        engine = SevenEngine(tok)
        endpoint = EndpointConfig(host=host, port=0, batch_wait_ms=1.0)
        made.append(Gateway([engine], str(tmp_path / "tok"), endpoint, SamplingConfig(max_new_tokens=8), 32, 64, key))
        return made[-1], engine

    yield serve
    for g in made:
        g.shutdown()


def ask(gateway, episode: str, key: str):
    from openai import OpenAI

    client = OpenAI(base_url=f"{gateway.url()}/episodes/{episode}/v1", api_key=key, max_retries=0)
    return client.chat.completions.create(model="relay-policy", messages=QUESTION)


def test_a_call_without_the_key_or_with_another_is_refused_401_and_counted(start):
    import openai

    gateway, engine = start("s3cret-key")
    for wrong in ("unused", "s3cret-ke", "s3cret-key-and-more"):  # an agent left with a placeholder, near misses
        with pytest.raises(openai.AuthenticationError) as refused:
            ask(gateway, "e", wrong)
        assert refused.value.status_code == 401 and "Authorization: Bearer <key>" in refused.value.message
    assert ask(gateway, "e", "s3cret-key").choices[0].message.content == "7"
    assert engine.calls == 1  # the refused calls never reached an engine
    url = gateway.url()
    # without any Authorization header, every route: the models, a reward, a plain /v1 call
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.post(f"{url}/episodes/e/reward", json={"reward": 1.0}).status_code == 401
    assert httpx.post(f"{url}/v1/chat/completions", json={"messages": QUESTION}).status_code == 401
    wrong = {"Authorization": "Basic s3cret-key"}  # the right secret in another scheme is not the key
    assert httpx.post(f"{url}/episodes/e/reward", json={"reward": 1.0}, headers=wrong).status_code == 401
    right = {"Authorization": "Bearer s3cret-key"}
    assert httpx.post(f"{url}/episodes/e/reward", json={"reward": 1.0}, headers=right).status_code == 200
    batch, counts = gateway.take(1, timeout_s=5.0, step=0)
    assert batch.env_return == [1.0]  # the key holder's reward, the only one that reached the episode
    assert counts["endpoint/unauthorized"] == 7  # 3 wrong keys, 3 calls without one, 1 in another scheme


def test_on_loopback_without_a_key_any_call_is_served_as_before(start):
    gateway, _ = start("")
    assert ask(gateway, "e", "anything").choices[0].message.content == "7"
    assert httpx.post(f"{gateway.url()}/episodes/e/reward", json={"reward": 0.5}).status_code == 200
    assert gateway.take(1, timeout_s=5.0, step=0)[1]["endpoint/unauthorized"] == 0


def test_the_endpoint_refuses_to_listen_beyond_loopback_without_a_key(start):
    for host in ("0.0.0.0", "192.168.1.7", "myhost"):
        with pytest.raises(ValueError, match=r"rollout.endpoint.host: listening on .* RELAY_ENDPOINT_KEY"):
            start("", host)
    gateway, _ = start("s3cret-key", "0.0.0.0")  # with a key it serves every interface
    assert httpx.get(f"http://127.0.0.1:{gateway.port}/v1/models").status_code == 401
