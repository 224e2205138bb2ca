"""The agent endpoint's recorder: calls become samples token for token, continued conversations
extend their sample with masked message tokens, finished episodes become a training batch."""
import time

import pytest

from learner.tiny_gpt import DEFAULT_ALPHABET, char_tokenizer
from rollout.gateway import Recorder
from rollout.prompts import encode_chat


@pytest.fixture
def tok():
    t = char_tokenizer(DEFAULT_ALPHABET + "<|>")
    t.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>\n{% endfor %}"
                       "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return t


def test_a_continued_conversation_extends_its_sample_and_only_sampled_tokens_train(tok):
    rec = Recorder(tok, max_prompt_tokens=64)
    first = [{"role": "user", "content": "1+2="}]
    sample, ids = rec.prepare("ep", first)
    assert ids == encode_chat(tok, first)
    reply = tok.encode("call 1+2", add_special_tokens=False) + [tok.eos_token_id]  # as the engine sampled it
    rec.record(sample, reply, [-0.5] * len(reply), "call 1+2", "stop", version=3)
    second = first + [{"role": "assistant", "content": "call 1+2"}, {"role": "tool", "content": "3"}]
    same, ids2 = rec.prepare("ep", second)
    assert same is sample
    # the engine continues the episode's own tokens, which are the whole conversation, token for token
    assert ids2 == encode_chat(tok, second)
    answer = tok.encode("3", add_special_tokens=False) + [tok.eos_token_id]
    rec.record(sample, answer, [-0.25] * len(answer), "3", "stop", version=4)
    other, _ = rec.prepare("ep", [{"role": "user", "content": "rewritten history"}])  # not a continuation: a new sample
    rec.record(other, [5, tok.eos_token_id], [-1.0, -1.0], "x", "length", version=4)
    assert rec.finish("ep", 1.5) == 2 and rec.finish("nope", 1.0) == 0
    batch, episodes, abandoned = rec.take(2, timeout_s=1.0)
    assert episodes == 1 and abandoned == 0 and batch.prompt_index == [0, 1] and batch.env_return == [1.5, 1.5]
    delta = len(ids2) - len(ids) - len(reply)
    assert batch.response_ids[0] == reply + ids2[len(ids) + len(reply):] + answer
    assert batch.action_mask[0] == [1] * len(reply) + [0] * delta + [1] * len(answer)
    assert batch.logprobs[0] == [-0.5] * len(reply) + [0.0] * delta + [-0.25] * len(answer)
    assert (batch.version_first, batch.version_last, batch.turns) == ([3, 4], [4, 4], [2, 1])
    assert batch.finish_reason == ["stop", "length"] and batch.response_text == ["3", "x"]


def test_take_waits_for_finished_episodes_and_says_how_many_came(tok):
    rec = Recorder(tok, max_prompt_tokens=64)
    sample, _ = rec.prepare("a", [{"role": "user", "content": "hi"}])
    rec.record(sample, [5], [-1.0], "x", "stop", 0)
    rec.finish("a", 0.0)
    with pytest.raises(TimeoutError, match=r"1 of 2 samples .*\(rollout.endpoint.wait_timeout_s\)"):
        rec.take(2, timeout_s=0.2)
    idle = Recorder(tok, max_prompt_tokens=64, idle_timeout_s=0.05)
    sample, _ = idle.prepare("crashed agent", [{"role": "user", "content": "hi"}])
    idle.record(sample, [5], [-1.0], "x", "stop", 0)
    time.sleep(0.1)
    idle.prepare("next", [{"role": "user", "content": "hi"}])  # any call drops episodes idle too long, counted
    assert "crashed agent" not in idle.episodes and idle.abandoned == 1 and idle.finish("crashed agent", 1.0) == 0
    with pytest.raises(ValueError, match="max_prompt_tokens 4"):
        Recorder(tok, max_prompt_tokens=4).prepare("b", [{"role": "user", "content": "a long question"}])


def test_the_http_api_refuses_what_it_cannot_record_with_the_key_named(tok):
    from fastapi.testclient import TestClient

    from rollout.config import SamplingConfig
    from rollout.gateway import Batcher, build_app

    client = TestClient(build_app(Recorder(tok, 64), Batcher([], 0.01), SamplingConfig(), "relay-policy"))
    chat = "/episodes/e1/v1/chat/completions"
    assert client.get("/v1/models").json()["data"][0]["id"] == "relay-policy"
    for body, key in [({"messages": []}, "messages"), ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
                      ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream"),
                      ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools")]:
        r = client.post(chat, json=body)
        assert r.status_code == 400 and r.json()["detail"].startswith(key)
    assert client.post("/episodes/nope/reward", json={"reward": 1}).status_code == 404
    assert client.post("/episodes/nope/reward", json={"score": 1}).status_code == 400
