"""The reasoning-gym source hands the task's own scorer the `<answer>` its trainers extract."""

import pytest

from reward_service.combine import run_source
from reward_service.config import RewardSource, SourceKind
from reward_service.sources import build_source


@pytest.fixture(scope="module")
def arithmetic():
    import reasoning_gym

    data = reasoning_gym.create_dataset("basic_arithmetic", size=3, seed=0)
    return data, list(data)


def test_right_and_wrong_answers_in_answer_tags(arithmetic):
    data, entries = arithmetic
    entry = entries[1]  # "Calculate 5 - 3 - 6." -> "-4"
    assert entry["answer"] == "-4"
    right = f"<think>5 - 3 = 2, 2 - 6 = -4</think>\n<answer>{entry['answer']}</answer>"
    wrong = "<think>5 - 3 - 6 = -5</think>\n<answer>-5</answer>"
    wordy = "<answer>the result is -4</answer>"
    untagged = "5 - 3 - 6 = -4, so the answer is -4"
    twice = "<answer>-5</answer> no, <answer>-4</answer>"
    source = build_source(RewardSource(kind=SourceKind.reasoning_gym))
    responses = [right, wrong, wordy, untagged, twice, right]
    metadata = [{"entry": entry}] * 5 + [{}]
    run = run_source(source, ["q"] * 6, responses, metadata, 30.0)
    # the task decides: exact 1, wrong 0, its own partial credit for extra words inside the tags,
    # no <answer> tag is no answer (as in reasoning-gym's trainers), the last tag wins, no entry: None
    assert run.scores == [1.0, 0.0, data.score_answer("the result is -4", entry), 0.0, 1.0, None]
    assert 0.0 < run.scores[2] < 1.0
    assert run.errors == []


def test_every_entry_scores_its_own_answer(arithmetic):
    data, entries = arithmetic
    source = build_source(RewardSource(kind=SourceKind.reasoning_gym))
    responses = [f"<answer>{e['answer']}</answer>" for e in entries]
    assert source.score(["q"] * 3, responses, [{"entry": e} for e in entries]) == [1.0, 1.0, 1.0]
    shifted = responses[1:] + responses[:1]  # each entry gets another entry's answer
    assert source.score(["q"] * 3, shifted, [{"entry": e} for e in entries]) == [0.0, 0.0, 0.0]
