"""The built-in agents' demonstrations are laid out exactly as episodes are played, and play the game
by its rules (orchestrator/data/agent_policies.py)."""

import random

from learner.tiny_gpt import char_tokenizer
from orchestrator.data.agent_policies import calculator_turns, guess_turns, transcript
from rollout.episodes import observation_ids


def test_a_demonstration_is_the_episode_token_for_token_with_the_models_tokens_marked():
    tok = char_tokenizer()
    ids, acts = transcript(tok, "12+34=", ["call 12+34", "46", "46"])
    eos = tok.eos_token_id
    call, answer = (
        tok.encode("call 12+34", add_special_tokens=False) + [eos],
        tok.encode("46", add_special_tokens=False) + [eos],
    )
    obs = observation_ids(tok, "46", "user", eos)  # what rollout/episodes.py appends after the call
    prompt = tok.encode("12+34=", add_special_tokens=False)
    assert ids == prompt + call + obs + answer
    assert acts == [0] * len(prompt) + [1] * len(call) + [0] * len(obs) + [1] * len(answer)


def test_demonstrations_follow_the_rules():
    rng = random.Random(0)
    example = {"prompt": "347+589=", "answer": "936"}
    turns = [calculator_turns(example, rng, tool_rate=0.5) for _ in range(200)]
    assert {tuple(t) for t in turns} == {("936",), ("call 347+589", "936", "936")}
    for secret in range(1, 16):
        for _ in range(20):
            turns = guess_turns({"answer": str(secret)}, rng)
            low, high = 1, 15
            for k in range(0, len(turns), 2):
                guess = int(turns[k])
                assert low <= guess <= high  # only numbers the feedback so far allows
                if k + 1 < len(turns):
                    assert turns[k + 1] == ("higher" if guess < secret else "lower")
                    low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
            assert len(turns) <= 7 and (int(turns[-1]) == secret or len(turns) == 7)
