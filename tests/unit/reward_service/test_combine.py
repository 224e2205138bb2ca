"""Failure isolation, weights and shaping of rewards, without any model."""

import sys
import threading
from pathlib import Path

import pytest

from reward_service.combine import combine, run_source
from reward_service.config import Normalization, RewardConfig, RewardSource, SourceKind
from reward_service.service import RewardFunction, source_names
from reward_service.shaping import RunningMeanStd, shape
from reward_service.sources import build_source

sys.path.insert(0, str(Path(__file__).parent))
import user_rewards  # noqa: E402  (the same module FunctionSource loads by "user_rewards:...")

FN = "user_rewards:"


def fn_source(name, **kw):
    return build_source(RewardSource(kind=SourceKind.function, function=FN + name, **kw))


def run(source, responses, timeout_s=5.0):
    return run_source(source, ["p"] * len(responses), responses, [{}] * len(responses), timeout_s)


def test_user_function_loaded_by_path():
    assert run(fn_source("length"), ["ab", "abcd"]).scores == [2.0, 4.0]
    with pytest.raises(ValueError, match="user_rewards:nope"):
        fn_source("nope")


def test_an_exception_marks_only_the_culprit():
    r = run(fn_source("fragile"), ["ok", "boom!", "fine"])
    assert r.scores == [1.0, None, 1.0]
    assert "RuntimeError: boom in the batch" in r.errors[0]


def test_nan_marks_only_that_sample():
    assert run(fn_source("fragile"), ["ok", "nan"]).scores == [1.0, None]


def test_wrong_length_falls_back_to_one_by_one():
    r = run(fn_source("short"), ["a", "b", "c"])
    assert r.scores == [1.0, 1.0, 1.0] and "returned 2 scores for 3 samples" in r.errors[0]


def helper_threads():
    return [t for t in threading.enumerate() if t.name.startswith("relay-reward")]


@pytest.fixture
def hang():
    """user_rewards.hangs, reset; released at the end even if the test fails, so no thread lingers."""
    for event in (user_rewards.RELEASE, user_rewards.STARTED, user_rewards.FINISHED):
        event.clear()
    yield user_rewards
    user_rewards.RELEASE.set()


def test_a_hanging_function_is_cut_at_its_deadline(hang):
    r = run(fn_source("hangs"), ["a", "b"], timeout_s=0.5)
    # hangs cannot finish until released below: the result came back without waiting for the work
    assert not hang.FINISHED.is_set()
    assert r.scores == [None, None] and r.timeouts == 1 and r.errors[0].startswith("no result within 0.5 s")
    hang.RELEASE.set()
    for t in helper_threads():
        t.join(timeout=30)
    assert not helper_threads()  # the helper thread ends with its work: nothing outlives the test
    # the deadline either cancelled the call before it began or abandoned it mid-call; the error says which
    how = "(abandoned, still running)" if hang.STARTED.is_set() else "(cancelled before it started)"
    assert r.errors[0].endswith(how)


def test_combination_weights_and_invalid():
    runs = {"a": run(fn_source("length"), ["ab", "nan"]), "b": run(fn_source("fragile"), ["ab", "nan"])}
    total, invalid = combine(runs, {"a": 0.5, "b": 2.0})
    assert total[0] == 0.5 * 2 + 2.0 * 1 and invalid == [False, True]


def test_reward_function_combines_configured_sources():
    cfg = RewardConfig(
        sources=[
            RewardSource(kind=SourceKind.math_answer, weight=1.0),
            RewardSource(kind=SourceKind.format, pattern=r"^#### ", weight=0.5),
            RewardSource(kind=SourceKind.length_penalty, target_length=10, weight=0.1),
        ]
    )
    reward = RewardFunction(cfg)
    scores = reward(["q", "q", "q"], ["#### 42", "#### 41", "42"], [{"answer": "42"}, {"answer": "42"}, {}])
    # 1 + .5 + .1*(-3/10); 0 + .5 - .03; third: no reference -> cannot judge -> None
    assert scores[0] == pytest.approx(1.47) and scores[1] == pytest.approx(0.47) and scores[2] is None


def test_a_weight_0_source_that_cannot_judge_changes_nothing():
    """Issue 25, item 4: a reported-only source (weight 0) is a metric; its None (here: no reference
    answer for math_answer) used to mark the sample invalid and so replace the trained reward."""
    length = RewardSource(kind=SourceKind.function, function=FN + "length")
    reported = RewardSource(kind=SourceKind.math_answer, weight=0.0)
    prompts, responses, meta = ["q"] * 3, ["#### 42", "7", "abc"], [{"answer": "42"}, {}, {}]
    runs, total, invalid = RewardFunction(RewardConfig(sources=[length, reported])).run(prompts, responses, meta)
    _, alone, alone_invalid = RewardFunction(RewardConfig(sources=[length])).run(prompts, responses, meta)
    assert total == alone == [7.0, 1.0, 3.0] and invalid == alone_invalid == [False] * 3
    assert runs["math_answer"].scores == [1.0, None, None]  # still judged and reported
    assert runs["math_answer"].scores.count(None) == 2  # reported: reward/math_answer/invalid_frac 2/3
    # with weight != 0 the same source's None is a sample it could not judge
    trained = RewardFunction(RewardConfig(sources=[length, RewardSource(weight=0.5)]))
    assert trained.run(prompts, responses, meta)[2] == [False, True, True]


def test_source_names_are_unique():
    cfg = RewardConfig(
        sources=[RewardSource(), RewardSource(), RewardSource(kind=SourceKind.format, pattern="x", name="fmt")]
    )
    assert source_names(cfg) == ["math_answer", "math_answer#2", "fmt"]


def test_shaping_clip_batch_and_running():
    assert shape([5.0, -5.0, 1.0], [False, False, True], 2.0, Normalization.none, RunningMeanStd()) == [2.0, -2.0, 0.0]
    # batch: valid [1, 3] -> mean 2, unbiased std sqrt(2) -> [-.7071, .7071]; invalid stays 0
    out = shape([1.0, 3.0, 100.0], [False, False, True], 0.0, Normalization.batch, RunningMeanStd())
    assert out == pytest.approx([-0.70711, 0.70711, 0.0], abs=1e-5)
    running = RunningMeanStd()
    shape([1.0, 3.0], [False, False], 0.0, Normalization.running, running)
    out = shape([5.0], [False], 0.0, Normalization.running, running)
    # after [1, 3, 5]: mean 3, unbiased std 2 -> (5 - 3) / 2 = 1
    assert out == pytest.approx([1.0]) and running.count == 3


def test_running_normaliser_state_survives_resume():
    a = RunningMeanStd()
    a.update([1.0, 2.0, 7.0])
    b = RunningMeanStd()
    b.load_state_dict(a.state_dict())
    a.update([4.0]), b.update([4.0])
    assert (
        (a.mean, a.std)
        == (b.mean, b.std)
        == pytest.approx((3.5, (sum((x - 3.5) ** 2 for x in [1, 2, 7, 4]) / 3) ** 0.5))
    )
