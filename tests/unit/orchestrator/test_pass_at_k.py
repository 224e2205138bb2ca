"""pass@k, maj@k, avg@n: against hand examples and brute force over every k-subset; through the evaluation."""

import itertools
import math
import statistics

import pytest

from orchestrator.config.load import load_config
from orchestrator.tools.evaluate import NO_VOTE, eval_ks, eval_sampling, evaluate_policy
from orchestrator.tools.pass_at_k import majority_correct, pass_at_k, sample_metrics
from reward_service.rules import answer_key, same_answer
from reward_service.types import ScoredBatch
from rollout.types import RolloutBatch
from tests.small_loop import DEFAULT

nan = float("nan")


def test_pass_at_k_by_hand():
    # 5 samples, 2 correct, k = 2: of the C(5,2) = 10 pairs, C(3,2) = 3 hold no correct one
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # pass@1 = c / n
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0  # fewer wrong samples than k: always
    with pytest.raises(ValueError, match="n=3, c=1, k=4"):
        pass_at_k(3, 1, 4)


@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_pass_at_k_equals_the_share_of_k_subsets_holding_a_correct_sample(n):
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_maj_votes_over_equivalent_answers_and_breaks_ties_to_the_first_sampled():
    exact = lambda a, b: a == b  # noqa: E731
    assert majority_correct(["7", "8", "8"], [True, False, False], exact) is False
    assert majority_correct(["7", "8"], [True, False], exact) is True  # a tie: the answer sampled first
    assert majority_correct(["8", "7"], [False, True], exact) is False
    # math-verify's equivalence: 0.5, 1/2 and \frac{1}{2} are one answer, outvoting two 3s
    answers = ["3", "0.5", "\\frac{1}{2}", "3", "1/2"]
    assert majority_correct(answers, [False, True, True, False, True], same_answer) is True
    assert majority_correct(answers, [False, True, True, False, True], lambda a, b: a == b) is False


def test_sample_metrics_average_over_prompts_with_their_standard_error_and_skip_unjudged():
    exact = lambda a, b: a == b  # noqa: E731
    prompts = [
        ([True, False, False, False], ["7", "1", "2", "3"]),  # pass@1 1/4, pass@4 1, maj@4: a 4-way tie -> "7"
        ([False, False, True, True], ["1", "1", "7", "7"]),  # maj@4: a tie, "1" first -> wrong
        ([True, True], ["5", "5"]),  # two samples judged of four: out of pass@4, in avg and pass@1
        ([], []),  # none judged (an infra failure): in no figure
    ]
    m = sample_metrics(prompts, 4, [1, 4], exact)
    assert m["prompts_judged"] == 3
    assert m["avg@4"] == pytest.approx(statistics.fmean([0.25, 0.5, 1.0]))
    assert m["avg@4/se"] == pytest.approx(statistics.stdev([0.25, 0.5, 1.0]) / math.sqrt(3))
    assert m["pass@1"] == pytest.approx(statistics.fmean([0.25, 0.5, 1.0]))
    assert m["pass@4"] == 1.0 and m["pass@4/se"] == 0.0
    assert m["maj@4"] == 0.5  # the first prompt's vote right, the second's wrong
    assert "maj@1" not in m  # a vote of one sample: pass@1 says it with all n
    empty = sample_metrics([([], [])], 4, [1], exact)
    assert math.isnan(empty["pass@1"]) and empty["prompts_judged"] == 0


def test_the_evaluation_reports_pass_at_k_from_the_verifiable_source_leaving_out_what_it_could_not_judge():
    # two prompts x 3 samples; the third sample of prompt 1 could not be judged
    texts = ["7", "8", "7", "1/2", "0.5", "x"]
    batch = RolloutBatch([0, 0, 0, 1, 1, 1], [[1]] * 6, [[2]] * 6, [[0.0]] * 6, texts, ["stop"] * 6)
    math_scores = [1.0, 0.0, 1.0, 0.0, 0.0, nan]
    scored = ScoredBatch(
        [0.0] * 6,
        {"format": [1.0] * 6, "math_answer": math_scores},
        [True] * 5 + [False],
        [False] * 5 + [True],
        [[0.0]] * 6,
        raw=[1.0] * 6,
    )
    ev = evaluate_policy(
        lambda p, greedy: batch, lambda *a: scored, ["", ""], [{}, {}], False, 1.0, lambda b: [[0.0]] * 6, [1, 2, 3]
    )
    m = ev.metrics
    assert m["eval/sampled/pass@1"] == pytest.approx((2 / 3 + 0) / 2)
    assert m["eval/sampled/pass@2"] == pytest.approx((1 - 0 / 3 + 0) / 2)  # prompt 0: C(1,2)=0 all-wrong pairs
    assert m["eval/sampled/pass@3"] == 1.0  # prompt 1 has two judged samples: left out of k = 3
    assert m["eval/sampled/maj@2"] == 0.5 and m["eval/sampled/avg@3"] == pytest.approx(1 / 3)
    without = ScoredBatch([0.0] * 6, {"format": [1.0] * 6}, [True] * 6, [False] * 6, [[0.0]] * 6, raw=[1.0] * 6)
    ev = evaluate_policy(
        lambda p, g: batch, lambda *a: without, [""] * 2, [{}] * 2, False, 1.0, lambda b: [[0.0]] * 6, [1]
    )
    assert not any("pass@" in k for k in ev.metrics)  # no verifiable source: no correctness to count


def test_eval_n_samples_and_pass_k_come_from_the_config_and_are_checked():
    cfg = load_config(DEFAULT, [])
    n = cfg.rollout.sampling.n_samples_per_prompt
    assert eval_sampling(cfg).n_samples_per_prompt == n and eval_ks(cfg) == sorted({1, n})
    cfg = load_config(DEFAULT, ["eval.n_samples=16", "eval.pass_k=[1,4,16]"])
    assert eval_sampling(cfg).n_samples_per_prompt == 16 and eval_ks(cfg) == [1, 4, 16]
    assert eval_sampling(cfg).temperature == cfg.rollout.sampling.temperature
    with pytest.raises(Exception, match=r"eval\.pass_k.*got 32"):
        load_config(DEFAULT, ["eval.n_samples=16", "eval.pass_k=[1,32]"])


def test_maj_reads_each_responses_final_answer_as_the_grader_does():
    # review: prose with commas and brackets was taken whole as a LaTeX reference and split equal answers
    prose = [
        "First, (3+4) = 7, so the answer is 7",
        "Adding 3 and 4, we get 7",
        "We compute 3 + 4 (carefully), which is 7",
        "The answer is 8",
        "The answer is 8",
    ]
    keys = [answer_key(p) for p in prose]
    assert keys == ["7", "7", "7", "8", "8"]
    assert majority_correct(keys, [True, True, True, False, False], same_answer) is True
    # an exact_match grader votes on the text itself: "1.0" and "1" are two answers there
    assert answer_key("1.0", math=False) != answer_key("1", math=False)
    assert same_answer(answer_key("\\boxed{\\frac{1}{2}}"), answer_key("0.5"))


def one_prompt(texts: list[str], components: dict[str, list[float]]):
    """The sampled batch and its scoring of one prompt with these responses (what the grader said in
    `components`), as evaluate_policy receives them."""
    n = len(texts)
    batch = RolloutBatch([0] * n, [[1]] * n, [[2]] * n, [[0.0]] * n, texts, ["stop"] * n)
    first = next(iter(components.values()))
    scored = ScoredBatch(list(first), components, [True] * n, [False] * n, [[0.0]] * n, raw=list(first))
    return batch, scored


def test_maj_votes_on_the_reasoning_gym_answer_not_on_the_whole_response():
    """Issue 40, item 4: maj@k voted on whole texts, so five right answers reasoned five ways lost to
    three identical wrong responses."""
    import reasoning_gym

    from reward_service.sources import ReasoningGymSource

    entry = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=0)[0]
    right, wrong = entry["answer"], str(int(entry["answer"]) + 1)
    texts = [f"<think>{how}</think>\n<answer>{right}</answer>" for how in ("a", "b", "c", "d", "e")]
    texts += [f"<think>guess</think>\n<answer>{wrong}</answer>"] * 3
    scores = ReasoningGymSource().score([""] * 8, texts, [{"entry": entry}] * 8)  # the task's own grader
    assert scores == [1.0] * 5 + [0.0] * 3
    batch, scored = one_prompt(texts, {"reasoning_gym": scores})
    ev = evaluate_policy(lambda p, g: batch, lambda *a: scored, [""], [{}], False, 1.0, lambda b: [[0.0]] * 8, [8])
    assert ev.metrics["eval/sampled/maj@8"] == 1.0 and not ev.notes
    # a response without <answer> tags votes for "no answer", which the task scores wrong
    texts = [f"{right}, surely"] * 3 + [f"<answer>{right}</answer>"] * 2
    scores = ReasoningGymSource().score([""] * 5, texts, [{"entry": entry}] * 5)
    batch, scored = one_prompt(texts, {"reasoning_gym": scores})
    ev = evaluate_policy(lambda p, g: batch, lambda *a: scored, [""], [{}], False, 1.0, lambda b: [[0.0]] * 5, [5])
    assert ev.metrics["eval/sampled/maj@5"] == 0.0 and ev.metrics["eval/sampled/pass@5"] == 1.0


def test_an_environment_graded_evaluation_reports_no_maj_and_says_why():
    """Issue 40, item 4: an episode has no answer relay can read, so maj@k voted on the texts."""
    texts = ["move left", "move right", "move left", "wait"]
    batch, scored = one_prompt(texts, {"environment": [1.0, 0.0, 1.0, 0.0]})
    ev = evaluate_policy(lambda p, g: batch, lambda *a: scored, [""], [{}], False, 1.0, lambda b: [[0.0]] * 4, [1, 4])
    assert not any("maj@" in k for k in ev.metrics)
    assert ev.metrics["eval/sampled/pass@4"] == 1.0 and ev.metrics["eval/sampled/avg@4"] == 0.5
    assert ev.notes == [f"no maj@k: the environment source's {NO_VOTE['environment']}"]
    # relay eval's report says it under its table
    from orchestrator.tools.eval_report import labelled, markdown

    report = {"policy_path": "p", "reference_path": "r", "prompts": 1, "table": "", "notes": ev.notes}
    report |= {"policy": labelled(ev.metrics), "reference": labelled(ev.metrics)}
    text = markdown(report, {"policy": ev, "reference": ev}, [""], None, 1)
    assert f"- no maj@k: the environment source's {NO_VOTE['environment']}" in text


def test_maj_groups_exact_match_answers_as_the_grader_does():
    """exact_match grades "42." wrong against "42", so the vote must not count them as one answer (it did:
    answer_key strips a trailing period): "42." (twice) and "7" (twice) tie, the first sampled wins, wrong."""
    texts = ["42", "42.", "42.", "7", "7"]
    scores = [1.0, 0.0, 0.0, 0.0, 0.0]  # rules.exact_match against the reference "42"
    batch, scored = one_prompt(texts, {"exact_match": scores})
    ev = evaluate_policy(lambda p, g: batch, lambda *a: scored, [""], [{}], False, 1.0, lambda b: [[0.0]] * 5, [5])
    assert ev.metrics["eval/sampled/maj@5"] == 0.0 and ev.metrics["eval/sampled/pass@5"] == 1.0
    # what exact_match calls one answer (whitespace, NFKC) is one vote: three "42"s beat two "7"s
    texts = ["42", " 42 ", "４２", "7", "7"]
    batch, scored = one_prompt(texts, {"exact_match": [1.0, 1.0, 1.0, 0.0, 0.0]})
    ev = evaluate_policy(lambda p, g: batch, lambda *a: scored, [""], [{}], False, 1.0, lambda b: [[0.0]] * 5, [5])
    assert ev.metrics["eval/sampled/maj@5"] == 1.0


def test_maj_keeps_reasoning_gym_answers_apart_that_the_task_scores_apart():
    """rotate_matrix scores its grid with the rows' line breaks right and the same numbers on one line
    wrong: a vote that collapsed whitespace joined them, and the group took its first sample's mark."""
    import reasoning_gym

    from reward_service.sources import ReasoningGymSource

    entry = reasoning_gym.create_dataset("rotate_matrix", size=1, seed=0)[0]
    grid, flat = entry["answer"], " ".join(entry["answer"].split())
    texts = [f"<answer>{flat}</answer>"] * 2 + [f"<answer>{grid}</answer>"] * 3
    scores = ReasoningGymSource().score([""] * 5, texts, [{"entry": entry}] * 5)
    assert scores == [0.0] * 2 + [1.0] * 3
    batch, scored = one_prompt(texts, {"reasoning_gym": scores})
    ev = evaluate_policy(lambda p, g: batch, lambda *a: scored, [""], [{}], False, 1.0, lambda b: [[0.0]] * 5, [5])
    assert ev.metrics["eval/sampled/maj@5"] == 1.0  # three right grids outvote two wrong lines
