"""Evaluation suites: their prompts (never training ones), their metrics apart, the report's table."""

import json

import pytest

from orchestrator.config.load import load_config
from orchestrator.data.prompts import DataError, load_split
from orchestrator.data.tasks import prompt_id
from orchestrator.tools.eval_report import summary_table
from orchestrator.tools.evaluate import evaluate_suites
from orchestrator.tools.suites import Suite, load_suites, markdown_table
from reward_service.types import ScoredBatch
from rollout.types import RolloutBatch
from tests.small_loop import DEFAULT

SUITE = "eval.suites=[{name: harder, task: addition_3digit, size: 12}, {name: same, task: addition_2digit, size: 20}]"


def test_a_task_suite_holds_the_tasks_reserved_prompts_and_a_file_suite_leaves_training_prompts_out(tmp_path):
    cfg = load_config(DEFAULT, [SUITE])
    train, held_out, _ = load_split(cfg.data, cfg.seed)
    harder, same = load_suites(cfg, train)
    assert len(harder.prompts) == 12 and all(len(p.split("+")[0]) == 3 for p in harder.prompts)
    trained = {prompt_id(e["prompt"]) for e in train}
    assert len(same.prompts) == 20 and not {prompt_id(p) for p in same.prompts} & trained  # the training task's
    assert load_suites(load_config(DEFAULT, [SUITE, "seed=1"]), train)[0].prompts != harder.prompts  # the run seed's
    lines = [train[0], {"prompt": "1+1=", "answer": "2"}, train[1], {"prompt": "2+2=", "answer": "4"}]
    path = tmp_path / "suite.jsonl"
    path.write_text("".join(json.dumps({"prompt": e["prompt"], "answer": e["answer"]}) + "\n" for e in lines))
    cfg = load_config(DEFAULT, [f"eval.suites=[{{name: file, file: {path}, size: 1}}]"])
    (suite,) = load_suites(cfg, train)
    assert suite.prompts == ["1+1="] and suite.left_out == 1  # the first training prompt before it, counted
    cfg = load_config(DEFAULT, [f"eval.suites=[{{name: file, file: {path}, size: 10}}]"])
    assert load_suites(cfg, train)[0].left_out == 2 and load_suites(cfg, train)[0].meta[1]["answer"] == "4"


@pytest.mark.parametrize(
    ("suites", "key"),
    [
        ("[{name: sampled, task: addition_3digit}]", "eval.suites.0.name"),
        ("[{name: a, task: addition_3digit}, {name: a, task: addition_2digit}]", "eval.suites.1.name"),
        ("[{name: a, task: addition_3digit, file: x.jsonl}]", "eval.suites.0"),
        ("[{name: a, task: addition_3digit, size: 0}]", "eval.suites.0.size"),
        ("[{name: a, task: addition_3digit, sources: [{kind: function}]}]", "eval.suites.0.sources.0.function"),
    ],
)
def test_a_bad_suite_is_named_by_its_key(suites, key):
    with pytest.raises(Exception, match=key.replace(".", r"\.")):
        load_config(DEFAULT, [f"eval.suites={suites}"])


def test_a_task_too_small_for_a_suite_fails_naming_it():
    cfg = load_config(DEFAULT, ["eval.suites=[{name: huge, task: addition_2digit, size: 1100}]"])
    with pytest.raises(DataError, match="eval.suites 'huge'"):
        load_suites(cfg, [])


def test_each_suite_is_generated_and_scored_as_itself_and_reported_under_its_name():
    calls = []

    def generate(prompts, greedy, meta):
        calls.append(("generate", tuple(prompts), greedy, meta[0]["answer"]))
        n = 1 if greedy else 2
        rows = [j for j in range(len(prompts)) for _ in range(n)]
        return RolloutBatch(
            rows, [[1]] * len(rows), [[2]] * len(rows), [[0.0]] * len(rows), ["7"] * len(rows), ["stop"] * len(rows)
        )

    def score(batch, meta, temperature, with_ref, suite):
        calls.append(("score", suite))
        right = [1.0 if meta[j]["answer"] == "7" else 0.0 for j in batch.prompt_index]
        n = len(batch)
        return ScoredBatch(right, {"math_answer": right}, [True] * n, [False] * n, [[0.0]] * n, raw=right)

    cfg = load_config(DEFAULT, ["eval.n_samples=2"])
    suites = [
        Suite("a", ["3+4="], [{"answer": "7"}], 0),
        Suite("b", ["1+1=", "2+5="], [{"answer": "2"}, {"answer": "7"}], 3),
    ]
    m, notes = evaluate_suites(suites, generate, score, cfg, lambda b: [[0.0]] * len(b))
    assert notes == []  # a math_answer source: maj@k votes on its answers
    assert [c for c in calls if c[0] == "score"] == [("score", "a")] * 2 + [("score", "b")] * 2
    assert m["eval/a/greedy/reward/accuracy"] == 1.0 and m["eval/b/greedy/reward/accuracy"] == 0.5
    assert m["eval/b/sampled/pass@2"] == 0.5 and m["eval/b/prompts"] == 2 and m["eval/b/left_out"] == 3
    assert not any(k.startswith(("eval/greedy", "eval/sampled")) for k in m)  # the main set's keys untouched
    table = summary_table({}, m)
    assert "a greedy accuracy" in table and "b pass@2" in table
    md = markdown_table({"eval/b/sampled/pass@2": 0.25}, m)
    assert "| b | pass@2 | 0.250 | 0.500 ± 0.500 | 2 x 2 |" in md
    assert "| a | greedy accuracy | - | 1.000 | 1 x 2 |" in md
