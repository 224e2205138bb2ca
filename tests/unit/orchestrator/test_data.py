"""Prompt data: files, bad lines named by file and line, tasks, the resumable sampler."""

import json

import pytest

from orchestrator.config.schema import BadLinePolicy, DataConfig
from orchestrator.data.prompts import DataError, PromptSampler, load_examples, load_split
from orchestrator.data.tasks import ONE_PROMPT_TASKS, TINY_TASKS, make_task, reserved
from tests.helpers import REPO


def write(tmp_path, lines):
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


GOOD = json.dumps({"prompt": "1+1=", "answer": 2, "source": "hand"})


def test_jsonl_fields_answer_and_metadata(tmp_path):
    chat = json.dumps({"q": [{"role": "user", "content": "hi"}], "a": "x"})
    examples, skipped = load_examples([write(tmp_path, [chat])], DataConfig(prompt_key="q", answer_key="a"))
    assert examples == [{"prompt": [{"role": "user", "content": "hi"}], "answer": "x", "metadata": {}}] and skipped == 0
    examples, _ = load_examples([write(tmp_path, [GOOD])], DataConfig())
    assert examples[0] == {"prompt": "1+1=", "answer": "2", "metadata": {"source": "hand"}}


@pytest.mark.parametrize(
    "bad, why",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"text": "x"}), "no 'prompt' field (data.prompt_key)"),
        (json.dumps({"prompt": ""}), "must be non-empty text"),
        (json.dumps({"prompt": 5}), "must be non-empty text"),
        (json.dumps([1, 2]), "expected a JSON object, got list"),
        (
            json.dumps({"prompt": []}),
            "'prompt' must be non-empty text, a list of chat messages or a list of non-negative token ids",
        ),
        (json.dumps({"prompt": [3, -1]}), "'prompt' must be non-empty text"),
        (json.dumps({"prompt": [3, 1.5]}), "'prompt' must be non-empty text"),
        (json.dumps({"prompt": [True, 2]}), "'prompt' must be non-empty text"),
        (json.dumps({"prompt": [3, "4"]}), "'prompt' must be non-empty text"),
    ],
)
def test_a_bad_line_is_named_by_file_and_line(tmp_path, bad, why):
    path = write(tmp_path, [GOOD, "", bad, GOOD])
    with pytest.raises(DataError) as e:
        load_examples([path], DataConfig(on_bad_line=BadLinePolicy.error))
    assert str(e.value).startswith(f"{path}:3: ") and why in str(e.value)
    examples, skipped = load_examples([path], DataConfig(on_bad_line=BadLinePolicy.skip))
    assert len(examples) == 2 and skipped == 1


def test_token_id_prompts_load_unchanged(tmp_path):
    lines = [json.dumps({"ids": [5, 6, 7], "answer": 1}), json.dumps({"ids": [0], "source": "x"})]
    examples, skipped = load_examples([write(tmp_path, lines)], DataConfig(prompt_key="ids"))
    assert skipped == 0 and examples == [
        {"prompt": [5, 6, 7], "answer": "1", "metadata": {}},
        {"prompt": [0], "answer": None, "metadata": {"source": "x"}},
    ]


def test_token_id_prompts_display_as_numbers():
    from orchestrator.loop.step_metrics import prompt_text

    assert prompt_text([5, 6, 7]) == "token ids: 5 6 7"
    assert prompt_text([{"role": "system", "content": "s"}, {"role": "user", "content": "1+1="}]) == "1+1="
    assert prompt_text("1+1=") == "1+1="


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}), path)
    examples, _ = load_examples([str(path)], DataConfig())
    assert [e["answer"] for e in examples] == ["2", "4"]


def test_tasks_and_held_out_split():
    train, held_out, _ = load_split(DataConfig(task="addition_2digit", task_size=50, eval_size=10), seed=0)
    assert len(train) == 50 and len(held_out) == 10 and train != held_out
    a, b = (int(x) for x in train[0]["prompt"].rstrip("=").split("+"))
    assert int(train[0]["answer"]) == a + b
    gym = make_task("basic_arithmetic", 3, seed=1)
    assert gym[0]["metadata"]["entry"]["answer"] == gym[0]["answer"]
    # asked as reasoning-gym asks: a system prompt that wants the answer in tags its scorers read
    assert [m["role"] for m in gym[0]["prompt"]] == ["system", "user"] and "<answer>" in gym[0]["prompt"][0]["content"]
    assert gym[0]["prompt"][1]["content"] == gym[0]["metadata"]["entry"]["question"]
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        make_task("nope", 1, 0)


def test_sampler_epochs_and_resume():
    s = PromptSampler(5, seed=0, shuffle=True)
    first = s.next(3) + s.next(3)  # crosses into epoch 1
    assert sorted(first[:5]) == [0, 1, 2, 3, 4] and s.epoch == 1
    resumed = PromptSampler(5, seed=0, shuffle=True)
    resumed.load_state_dict(s.state_dict())
    assert resumed.next(4) == s.next(4)


def config_task_sizes():
    """(task, task_size, eval_size) of every task a shipped config generates, RL and SFT/RM stages."""

    import yaml

    sections = []
    for path in sorted((REPO / "configs").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        sections += [raw.get("data", {})] + [raw[s].get("data", {}) for s in ("sft", "rm", "ppo") if s in raw]
    stage = {"task_size": 2000, "eval_size": 200}  # StageConfig's defaults (RL: 1000, 64)
    return sorted(
        {
            (d["task"], d.get("task_size", stage["task_size"]), d.get("eval_size", stage["eval_size"]))
            for d in sections
            if d.get("task")
        }
    )


def prompts(rows, key="prompt"):
    return {json.dumps(r[key], sort_keys=True) for r in rows}


BUILTIN_SIZES = [
    t
    for t in config_task_sizes()
    if t[0] in {"addition_2digit", "addition_3digit", "chat_addition_2digit", "repeat_longtail"}
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "task, task_size, eval_size", [*BUILTIN_SIZES, ("basic_arithmetic", 2000, 128), ("gsm_symbolic", 100, 20)]
)
def test_held_out_prompts_of_a_task_are_never_training_prompts(task, task_size, eval_size, seed):
    if task not in TINY_TASKS and task != "repeat_longtail":
        pytest.importorskip("reasoning_gym")
    train, held_out, _ = load_split(DataConfig(task=task, task_size=task_size, eval_size=eval_size), seed=seed)
    assert len(train) == task_size and len(held_out) == len(prompts(held_out)) == eval_size  # distinct held-out prompts
    assert not prompts(train) & prompts(held_out)
    again = load_split(DataConfig(task=task, task_size=task_size, eval_size=eval_size), seed=seed)
    assert again[:2] == (train, held_out)  # reproducibly


def test_the_shipped_configs_tasks_are_all_checked():
    assert {t[0] for t in config_task_sizes()} - {t[0] for t in BUILTIN_SIZES} == {"guess_number", "gsm_symbolic"}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_one_prompt_task_holds_out_fresh_episodes(seed):
    # guess_number: every example is the prompt "guess 1-15:"; the secret (answer) is hidden from the
    # policy, so no held-out prompt can be unseen: the held-out set is fresh episodes, of other secrets
    assert "guess_number" in ONE_PROMPT_TASKS
    train, held_out, _ = load_split(DataConfig(task="guess_number", task_size=2000, eval_size=128), seed=seed)
    assert len(prompts(train + held_out)) == 1 and len(train) == 2000 and len(held_out) == 128
    assert [e["answer"] for e in held_out] != [e["answer"] for e in train[:128]]  # another stream


def test_a_task_with_too_few_distinct_prompts_fails_naming_the_keys():
    # addition_2digit has 90 x 90 = 8100 prompts, of which 1035 are reserved for held-out sets (1 in 8)
    assert sum(reserved(f"{a}+{b}=") for a in range(10, 100) for b in range(10, 100)) == 1035
    assert len(load_split(DataConfig(task="addition_2digit", task_size=10, eval_size=1035), seed=0)[1]) == 1035
    with pytest.raises(
        DataError,
        match=r"data.task 'addition_2digit': .* only 1035 distinct prompts reserved .*"
        r"data.task_size: 2000, data.eval_size: 1036",
    ):
        load_split(DataConfig(task="addition_2digit", task_size=2000, eval_size=1036), seed=0)


def test_held_out_file_prompts_are_never_training_prompts(tmp_path, caplog):
    # 30 distinct prompts, each on 1-3 lines: a held-out prompt takes all its copies out of training
    lines = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(30) for _ in range(1 + i % 3)]
    path = write(tmp_path, lines)
    for seed in (0, 1, 2):
        train, held_out, _ = load_split(DataConfig(train_files=[path], eval_size=10), seed=seed)
        assert len(held_out) == len(prompts(held_out)) == 10 and not prompts(train) & prompts(held_out)
        assert len(train) + sum(1 + int(e["prompt"].split("+")[0]) % 3 for e in held_out) == len(lines)
    with pytest.raises(DataError, match="30 distinct prompts leave none to train on"):
        load_split(DataConfig(train_files=[path], eval_size=30), seed=0)
    # with eval files: the training lines whose prompt is held out are dropped, and counted
    eval_path = tmp_path / "eval.jsonl"
    eval_path.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in (0, 1, 2, 99)))
    with caplog.at_level("WARNING", logger="orchestrator.data.prompts"):
        train, held_out, _ = load_split(DataConfig(train_files=[path], eval_files=[str(eval_path)]), seed=0)
    assert len(held_out) == 4 and not prompts(train) & prompts(held_out) and len(train) == len(lines) - 6
    assert "6 training examples have a prompt of data.eval_files: dropped from training" in caplog.text


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_pipeline_stage_trains_on_a_prompt_the_rl_stage_holds_out(tmp_path, seed):
    # review A 2: every stage drew from the same task stream with its own size: 39 of the 128 PPO
    # held-out prompts were SFT training prompts and 21 RM training prompts
    import dataclasses

    from orchestrator.config.load import load_config
    from orchestrator.config.schema import PipelineConfig, RejectedFrom
    from orchestrator.stages.supervised import load_supervised

    cfg = load_config(REPO / "configs" / "pipeline_tiny_cpu.yaml", root=PipelineConfig)
    _, rl_held_out, _ = load_split(cfg.ppo.data, seed)
    # the RM's prompts are the task split's whichever answers it rejects (corrupted here: no SFT model to sample)
    rm = dataclasses.replace(cfg.rm, data=dataclasses.replace(cfg.rm.data, rejected_from=RejectedFrom.corrupt))
    for kind, stage in (("sft", cfg.sft), ("rm", rm)):
        train, held_out, _ = load_supervised(dataclasses.replace(stage, seed=seed), kind, tmp_path / kind)
        assert len(train) == stage.data.task_size and not prompts(train) & prompts(rl_held_out), kind
        assert not prompts(train) & prompts(held_out)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_builtin_starting_policies_never_train_on_a_held_out_prompt(seed):
    # review A 2: tiny-addition-gpt's SFT set held 54, 67 and 71 of relay train's 128 held-out prompts
    from orchestrator.data.agent_policies import AGENTS, agent_examples
    from orchestrator.data.builtin_models import builtin_folder, tiny_policy_data

    sft_set, probe, _ = tiny_policy_data("addition_2digit", seed=0)  # what build_tiny_policy trains and stops on
    sets = {
        "tiny-addition-gpt": ("addition_2digit", sft_set + probe),
        **{name: (AGENTS[name][0], agent_examples(name, seed=0)) for name in AGENTS},
    }
    for name, (task, seen) in sets.items():
        assert len(seen) >= 5000
        if task in ONE_PROMPT_TASKS:
            continue  # one prompt: nothing can be unseen (its held-out set is fresh episodes)
        _, held_out, _ = load_split(DataConfig(task=task, task_size=2000, eval_size=128), seed=seed)
        assert not prompts(seen) & prompts(held_out), name
        assert "-v2" in builtin_folder(f"builtin://{name}", "runs").name  # a model cached before this is not reused


@pytest.mark.parametrize("task", sorted(TINY_TASKS))
def test_held_out_prompts_are_reserved_and_training_prompts_never_are(task):
    for seed in (0, 1, 2):
        train, held_out = load_split(DataConfig(task=task, task_size=3000, eval_size=200), seed=seed)[:2]
        assert all(reserved(e["prompt"]) for e in held_out) and not any(reserved(e["prompt"]) for e in train)


def test_the_long_tail_task_has_mostly_short_answers_and_a_fifth_long_ones_each_the_number_repeated():
    """tasks.repeat_longtail, the long-tail preset's task: "kxN=" -> N written k times; a fifth of the
    answers are 24-40 tokens, the rest 2-9, so a wave of samples waits for its longest ones."""
    from orchestrator.data.tasks import repeat_longtail

    examples = repeat_longtail(4000, seed=3)
    for e in examples[:200]:
        k, number = e["prompt"].removesuffix("=").split("x")
        assert e["answer"] == number * int(k) and e["metadata"] == {}
    lengths = [len(e["answer"]) for e in examples]
    long = [n for n in lengths if n >= 24]
    assert all(2 <= n <= 9 or 24 <= n <= 40 for n in lengths) and max(lengths) == 40
    assert 0.17 < len(long) / len(lengths) < 0.23
    assert make_task("repeat_longtail", 50, seed=3) == examples[:50]  # the same draw, by name
    assert repeat_longtail(50, seed=4) != examples[:50]  # the seed changes it
