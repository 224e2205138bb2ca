"""The agent endpoint's recorder: calls become samples token for token, continued conversations
extend their sample with masked message tokens, finished episodes become a training batch."""

import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from learner.tiny_gpt import DEFAULT_ALPHABET, char_tokenizer
from rollout.recorder import Recorder
from runtime.prompts import encode_chat


@pytest.fixture
def tok():
    t = char_tokenizer(DEFAULT_ALPHABET + "<|>")
    t.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return t


def test_a_continued_conversation_extends_its_sample_and_only_sampled_tokens_train(tok):
    rec = Recorder(tok, max_prompt_tokens=64, max_model_len=256)
    first = [{"role": "user", "content": "1+2="}]
    call = rec.prepare("ep", first, 8)
    sample, ids = call.sample, call.ids
    assert ids == encode_chat(tok, first)
    reply = tok.encode("call 1+2", add_special_tokens=False) + [tok.eos_token_id]  # as the engine sampled it
    rec.record("ep", call, reply, [-0.5] * len(reply), "call 1+2", "stop", version=3)
    second = first + [{"role": "assistant", "content": "call 1+2"}, {"role": "tool", "content": "3"}]
    call2 = rec.prepare("ep", second, 8)
    assert call2.sample is sample
    ids2 = call2.ids
    # the engine continues the episode's own tokens, which are the whole conversation, token for token
    assert ids2 == encode_chat(tok, second)
    answer = tok.encode("3", add_special_tokens=False) + [tok.eos_token_id]
    rec.record("ep", call2, answer, [-0.25] * len(answer), "3", "stop", version=4)
    other = rec.prepare("ep", [{"role": "user", "content": "rewritten history"}], 8)  # not a continuation: a new sample
    rec.record("ep", other, [5, tok.eos_token_id], [-1.0, -1.0], "x", "length", version=4)
    assert rec.finish("ep", 1.5) == 2 and rec.finish("nope", 1.0) is None
    batch, counts = rec.take(2, timeout_s=1.0, step=4)
    assert counts["endpoint/episodes"] == 1 and counts["endpoint/abandoned_episodes"] == 0
    assert batch.prompt_index == [0, 1] and batch.env_return == [1.5, 1.5]
    delta = len(ids2) - len(ids) - len(reply)
    assert batch.response_ids[0] == reply + ids2[len(ids) + len(reply) :] + answer
    assert batch.action_mask[0] == [1] * len(reply) + [0] * delta + [1] * len(answer)
    assert batch.logprobs[0] == [-0.5] * len(reply) + [0.0] * delta + [-0.25] * len(answer)
    assert (batch.version_first, batch.version_last, batch.turns) == ([3, 4], [4, 4], [2, 1])
    assert batch.finish_reason == ["stop", "length"] and batch.response_text == ["3", "x"]


def test_take_waits_for_finished_episodes_and_says_how_many_came(tok):
    rec = Recorder(tok, max_prompt_tokens=64, max_model_len=256)
    call = rec.prepare("a", [{"role": "user", "content": "hi"}], 8)
    rec.record("a", call, [5], [-1.0], "x", "stop", 0)
    rec.finish("a", 0.0)
    with pytest.raises(TimeoutError, match=r"1 of 2 samples .*\(rollout.endpoint.wait_timeout_s"):
        rec.take(2, timeout_s=0.2, step=0)
    idle = Recorder(tok, max_prompt_tokens=64, max_model_len=256, idle_timeout_s=0.05)
    call = idle.prepare("crashed agent", [{"role": "user", "content": "hi"}], 8)
    idle.record("crashed agent", call, [5], [-1.0], "x", "stop", 0)
    time.sleep(0.1)
    idle.prepare("next", [{"role": "user", "content": "hi"}], 8)  # any call drops episodes idle too long, counted
    assert "crashed agent" not in idle.episodes and idle.abandoned == 1 and idle.finish("crashed agent", 1.0) is None
    with pytest.raises(ValueError, match="max_prompt_tokens 4"):
        Recorder(tok, max_prompt_tokens=4, max_model_len=256).prepare(
            "b", [{"role": "user", "content": "a long question"}], 8
        )


def test_the_http_api_refuses_what_it_cannot_record_with_the_key_named(tok):
    from fastapi.testclient import TestClient

    from rollout.config import SamplingConfig
    from rollout.gateway import Batcher, build_app

    client = TestClient(build_app(Recorder(tok, 64, 256), Batcher([], 0.01), SamplingConfig(), "relay-policy"))
    chat = "/episodes/e1/v1/chat/completions"
    assert client.get("/v1/models").json()["data"][0]["id"] == "relay-policy"
    for body, key in [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
        # the learner trains under the config's distribution: a call may not sample another
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 0.7}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 0.9}, "top_p"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 1.0}, "presence_penalty"),
    ]:
        r = client.post(chat, json=body)
        assert r.status_code == 400 and r.json()["detail"].startswith(key)
    assert client.post("/episodes/nope/reward", json={"reward": 1}).status_code == 404
    assert client.post("/episodes/nope/reward", json={"score": 1}).status_code == 400
    for bad in (True, "0.7", None, [1.0]):  # a reward is a number, never what float() would make of it
        r = client.post("/episodes/nope/reward", json={"reward": bad})
        assert r.status_code == 400 and r.json()["detail"].startswith("reward"), bad
    r = client.post("/episodes/nope/reward", content=b'{"reward": NaN}', headers={"content-type": "application/json"})
    assert r.status_code == 400


class FakeEngine:
    """A rollout worker's `complete` as the Batcher calls it (`.remote(...).future()`): every prompt
    gets the reply "7" + EOS at policy `version`. Like vLLM, one prompt that does not fit
    max_model_len fails the whole call; `fail` makes every call fail."""

    def __init__(self, tok, max_model_len: int):
        self.tok, self.max_model_len, self.version, self.fail, self.calls = tok, max_model_len, 0, False, []
        self.complete = self

    def remote(self, prompts, params):
        from concurrent.futures import Future

        self.calls.append(len(prompts))
        future, reply = Future(), self.tok.encode("7", add_special_tokens=False) + [self.tok.eos_token_id]
        if self.fail or any(len(p) + s.max_new_tokens > self.max_model_len for p, s in zip(prompts, params)):
            future.set_exception(RuntimeError("engine failed"))
        else:
            future.set_result(([(reply, [-0.5] * len(reply), "7", "stop") for _ in prompts], self.version))
        return SimpleNamespace(future=lambda: future)


def endpoint(tok, max_model_len=48, wait_s=0.05, **recorder_kw):
    from fastapi.testclient import TestClient

    from rollout.config import SamplingConfig
    from rollout.gateway import Batcher, build_app

    engine = FakeEngine(tok, max_model_len)
    rec = Recorder(tok, 32, max_model_len, **recorder_kw)
    app = build_app(rec, Batcher([engine], wait_s), SamplingConfig(max_new_tokens=8, temperature=1.0), "relay-policy")
    return TestClient(app), rec, engine


def chat(client, episode, messages, **extra):
    return client.post(f"/episodes/{episode}/v1/chat/completions", json={"messages": messages, **extra})


def test_a_continued_conversation_over_the_length_limit_fails_only_its_own_call(tok):
    client, rec, engine = endpoint(tok, max_model_len=48)
    with client:
        first = [{"role": "user", "content": "1+2="}]
        assert chat(client, "long", first).status_code == 200
        too_long = first + [{"role": "assistant", "content": "7"}, {"role": "tool", "content": "9" * 30}]
        with ThreadPoolExecutor(2) as pool:  # within one batch window: one engine call would hold both
            long, other = pool.map(lambda a: chat(client, *a), [("long", too_long), ("other", first)])
        assert long.status_code == 400 and "rollout.max_model_len 48" in long.json()["detail"]
        assert other.status_code == 200 and other.json()["choices"][0]["message"]["content"] == "7"
        assert sum(engine.calls) == 2  # the over-long call never reached an engine
        assert client.post("/episodes/long/reward", json={"reward": 1.0}).status_code == 200
    batch, _ = rec.take(1, timeout_s=1.0, step=0)
    reply = tok.encode("7", add_special_tokens=False) + [tok.eos_token_id]
    assert batch.response_ids == [reply] and batch.action_mask == [[1] * len(reply)]  # its sample is as it was


def test_an_engine_failure_marks_its_episode_failed_and_the_run_goes_on(tok):
    client, rec, engine = endpoint(tok, max_model_len=128)
    first = [{"role": "user", "content": "1+2="}]
    with client:
        assert chat(client, "a", first).status_code == 200
        engine.fail = True
        r = chat(client, "a", first + [{"role": "assistant", "content": "7"}, {"role": "user", "content": "again"}])
        assert r.status_code == 503 and "marked failed" in r.json()["detail"]
        assert chat(client, "c", first).status_code == 503  # an episode whose only call failed
        engine.fail = False
        assert chat(client, "b", first).status_code == 200
        for episode, reward in [("a", 1.0), ("c", 1.0), ("b", 0.5)]:  # the agents post their rewards anyway
            assert client.post(f"/episodes/{episode}/reward", json={"reward": reward}).status_code == 200
    batch, counts = rec.take(2, timeout_s=1.0, step=0)  # no IndexError: every sample has its engine calls
    reply = tok.encode("7", add_special_tokens=False) + [tok.eos_token_id]
    assert batch.env_return == [None, 0.5] and batch.env_failure == ["error", ""]  # could not judge, not a score
    assert batch.response_ids == [reply, reply]  # the failed call's message tokens were taken back out
    assert counts["endpoint/failed_episodes"] == 2 and not rec.finished  # "c" had nothing to train on


def finished_episode(rec, episode: str, samples: int, version: int, reward: float) -> None:
    for k in range(samples):  # each call rewrites the history: a sample of its own
        call = rec.prepare(episode, [{"role": "user", "content": f"q{k}"}], 8)
        rec.record(episode, call, [5], [-1.0], "x", "stop", version)
    assert rec.finish(episode, reward) == samples


def test_take_cuts_the_batch_exactly_and_drops_samples_past_the_staleness_bound(tok):
    rec = Recorder(tok, 32, 64, max_staleness=1)
    finished_episode(rec, "old", 2, version=0, reward=0.0)
    finished_episode(rec, "three", 3, version=2, reward=1.0)
    finished_episode(rec, "one", 1, version=3, reward=2.0)
    batch, counts = rec.take(2, timeout_s=1.0, step=3)  # "old" is 3 versions behind: dropped, counted
    assert len(batch) == 2 and batch.env_return == [1.0, 1.0] and counts["endpoint/dropped_stale"] == 2
    batch, counts = rec.take(2, timeout_s=1.0, step=3)  # the rest of "three" waited for this batch
    assert len(batch) == 2 and batch.env_return == [1.0, 2.0] and batch.version_first == [2, 3]
    assert counts["endpoint/episodes"] == 2 and not rec.finished


def test_a_reward_for_an_unknown_episode_is_404_and_counted_as_after_a_resume(tok):
    """The endpoint keeps no state across a resume: an agent posting the reward of an episode of the run
    before gets 404, and the count shows it (endpoint/unknown_rewards) rather than nothing."""
    client, rec, _ = endpoint(tok, max_model_len=128)
    with client:
        assert chat(client, "a", [{"role": "user", "content": "1+2="}]).status_code == 200
        assert client.post("/episodes/from-before/reward", json={"reward": 1.0}).status_code == 404
        assert client.post("/episodes/a/reward", json={"reward": 1.0}).status_code == 200
        assert client.post("/episodes/a/reward", json={"reward": 1.0}).status_code == 404  # already ended
    _, counts = rec.take(1, timeout_s=1.0, step=0)
    assert counts["endpoint/unknown_rewards"] == 2


def test_a_call_cut_at_its_max_tokens_counts_as_a_clipped_turn(tok):
    rec = Recorder(tok, 32, 64)
    call = rec.prepare("e", [{"role": "user", "content": "q"}], 2)
    rec.record("e", call, [5, 6], [-1.0, -1.0], "xy", "length", 0)
    call = rec.prepare(
        "e",
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "xy"},
            {"role": "user", "content": "go on"},
        ],
        2,
    )
    rec.record("e", call, [5], [-1.0], "x", "stop", 0)
    rec.finish("e", 1.0)
    batch, _ = rec.take(1, timeout_s=1.0, step=0)
    assert batch.turns == [2] and batch.clipped_turns == [1] and batch.finish_reason == ["stop"]


def test_a_call_continues_its_sample_only_when_it_sends_back_the_tool_calls_it_was_given(tok):
    """The agent's copy of a reply with tool calls may re-serialise the arguments (spacing) and carry
    other call ids; a changed call or other `tools` rewrite the history: a new sample."""
    question = [{"role": "user", "content": "1+2="}]
    tools = [{"type": "function", "function": {"name": "add"}}]
    given = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    result = {"role": "tool", "tool_call_id": "c1", "content": "3"}

    def continues(sent: dict, tools_sent) -> bool:
        rec = Recorder(tok, 64, 256)
        call = rec.prepare("e", question, 8, tools=tools)
        reply = {"role": "assistant", "content": None, "tool_calls": [given]}
        rec.record("e", call, [5, tok.eos_token_id], [-1.0, -1.0], "call", "stop", 0, message=reply)
        messages = [*question, {"role": "assistant", "tool_calls": [sent]}, result]
        return not rec.prepare("e", messages, 8, tools=tools_sent).new

    respaced = {**given, "id": "other", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}
    assert continues(given, tools) and continues(respaced, tools)
    assert not continues({**given, "function": {"name": "add", "arguments": '{"a": 1, "b": 3}'}}, tools)
    assert not continues({**given, "function": {"name": "sub", "arguments": '{"a": 1, "b": 2}'}}, tools)
    assert not continues(given, None)


def test_each_token_carries_the_version_of_the_call_that_sampled_it(tok):
    """A two-call episode whose calls ran at different weight versions: each call's tokens report
    its own version (the staleness histogram and the bound read them), the message tokens between
    them the version of the call before; a failed call in between leaves no versions behind."""
    client, rec, engine = endpoint(tok, max_model_len=128)
    first = [{"role": "user", "content": "1+2="}]
    second = first + [{"role": "assistant", "content": "7"}, {"role": "user", "content": "sure"}]
    with client:
        engine.version = 3
        assert chat(client, "e", first).status_code == 200
        engine.version, engine.fail = 4, True
        assert chat(client, "e", second).status_code == 503  # its message tokens are taken back out
        engine.fail = False
        assert chat(client, "e", second).status_code == 200
        assert client.post("/episodes/e/reward", json={"reward": 1.0}).status_code == 200
    batch, _ = rec.take(1, timeout_s=1.0, step=4)
    reply = tok.encode("7", add_special_tokens=False) + [tok.eos_token_id]
    message = len(batch.response_ids[0]) - 2 * len(reply)
    assert batch.token_versions == [[3] * len(reply) + [3] * message + [4] * len(reply)]
    assert batch.model_token_versions() == [3] * len(reply) + [4] * len(reply)
    assert (batch.version_first, batch.version_last, batch.oldest_versions) == ([3], [4], [3])
