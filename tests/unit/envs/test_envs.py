"""The environment interface: loading by name, the deadline and failure isolation of calls, the
built-in environments, and the observation tokens the chat template gives."""

import asyncio
import threading

import pytest

from envs.base import Environment, call_all, step_result
from envs.builtin import Calculator, GuessNumber
from envs.registry import load_env, make_factory
from learner.tiny_gpt import DEFAULT_ALPHABET, char_tokenizer
from rollout.episodes import observation_ids


class Hangs(Environment):
    """A step that hangs until `release` is set: the test releases it only after call_all came back."""

    release = threading.Event()

    def step(self, action):
        self.release.wait(60)  # were call_all to wait for it, it would return None (no "timeout") and fail


class Raises(Environment):
    def step(self, action):
        raise RuntimeError("tool crashed")


class Async(Environment):
    async def step(self, action):
        await asyncio.sleep(0.01)
        return f"echo {action}", 0.5, False, {}


def test_call_all_isolates_a_hanging_and_a_raising_step_within_the_deadline():
    Hangs.release.clear()
    try:
        out = call_all(
            [
                (Hangs().step, ("a",)),
                (Raises().step, ("b",)),
                (Async().step, ("c",)),
                (lambda a: ("ok", 1.0, True, {}), ("d",)),
            ],
            timeout_s=1.0,
        )
    finally:
        Hangs.release.set()  # the abandoned thread ends with the test
    # back while the hanging step still hung (it returns only once released): abandoned, not waited for
    assert out[0][0] == "timeout" and out[1] == ("error", "RuntimeError: tool crashed")
    assert out[2] == ("", ("echo c", 0.5, False, {})) and out[3] == ("", ("ok", 1.0, True, {}))
    results = [step_result(o) for o in out]
    assert [r.failure for r in results] == ["timeout", "error", "", ""]
    assert results[2].observation == "echo c" and results[2].reward == 0.5 and not results[2].done


@pytest.mark.parametrize(
    "bad", [None, ("obs", float("nan"), True, {}), ("obs", "x", True, {}), (3, 1.0, False, {}), ("obs", 1.0)]
)
def test_malformed_step_results_are_errors(bad):
    r = step_result(("", bad))
    assert r.failure == "error" and r.message


def test_load_env_by_builtin_name_or_module_path_and_errors_name_the_key():
    assert load_env("calculator") is Calculator and load_env("envs.builtin:GuessNumber") is GuessNumber
    with pytest.raises(ValueError, match=r"env\.name: 'nope' is neither a built-in"):
        load_env("nope")
    with pytest.raises(ValueError, match=r"env\.name: cannot load 'envs.builtin:Nope'"):
        load_env("envs.builtin:Nope")
    with pytest.raises(ValueError, match=r"env\.options: guess_number does not take"):
        make_factory("guess_number", {"lowest": 3})
    env = make_factory("guess_number", {"low": 1, "high": 3})()
    assert (env.low, env.high) == (1, 3)


def test_calculator_answers_tool_calls_and_rewards_the_final_answer():
    env = Calculator()
    assert env.reset({"prompt": "347+589=", "answer": "936"}, 0) is None
    assert env.step("call 347+589") == ("936", 0.0, False, {"tool_call": True})
    assert env.step("call 12*-3") == ("-36", 0.0, False, {"tool_call": True})
    assert env.step("call 3/0") == ("error", 0.0, False, {"tool_call": True})  # malformed: said so, episode goes on
    assert env.step(" 936 ") == (None, 1.0, True, {"tool_call": False})
    assert env.step("935") == (None, 0.0, True, {"tool_call": False})


def test_guess_number_answers_higher_lower_and_ends_on_the_secret():
    env = GuessNumber(1, 15)
    env.reset({"answer": "11"}, 0)
    assert env.step("8") == ("higher", 0.0, False, {})
    assert env.step("12") == ("lower", 0.0, False, {})
    assert env.step("x") == ("bad", 0.0, False, {})
    assert env.step("11") == (None, 1.0, True, {})
    with pytest.raises(ValueError, match="outside"):
        env.reset({"answer": "16"}, 0)


def test_observation_tokens_follow_the_template_and_do_not_repeat_the_turns_end():
    tok = char_tokenizer(DEFAULT_ALPHABET + "<|>")
    # a ChatML-like template whose assistant turn ends with EOS, as Qwen's and SmolLM2's do
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    eos = tok.eos_token_id
    model_turn = tok.encode("call 1+2", add_special_tokens=False) + [eos]  # as sampled: closed by EOS
    obs = observation_ids(tok, "3", "tool", last_token=eos)
    assert tok.decode(obs) == "\n<|tool|>3<eos>\n<|assistant|>"  # EOS not written twice
    prompt = tok.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True)
    episode = tok.encode(prompt, add_special_tokens=False) + model_turn + obs
    whole = tok.apply_chat_template(
        [
            {"role": "user", "content": "1+2="},
            {"role": "assistant", "content": "call 1+2"},
            {"role": "tool", "content": "3"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert episode == tok.encode(whole, add_special_tokens=False)  # the episode is the conversation, token for token
    cut = observation_ids(
        tok, "3", "tool", last_token=tok.encode("2", add_special_tokens=False)[0]
    )  # turn cut by length
    assert tok.decode(cut) == "<eos>\n<|tool|>3<eos>\n<|assistant|>"  # the template closes it
    plain = char_tokenizer()  # relay's tiny models: contents one per line
    assert plain.decode(observation_ids(plain, "higher", "user", plain.eos_token_id)) == "\nhigher\n"
