"""Prompt data: files, bad lines named by file and line, tasks, the resumable sampler."""
import json

import pytest

from orchestrator.config import BadLinePolicy, DataConfig
from orchestrator.data import DataError, PromptSampler, load_examples, load_split
from orchestrator.tasks import make_task


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


@pytest.mark.parametrize("bad, why", [
    ("{not json", "not valid JSON"),
    (json.dumps({"text": "x"}), "no 'prompt' field (data.prompt_key)"),
    (json.dumps({"prompt": ""}), "must be non-empty text"),
    (json.dumps({"prompt": 5}), "must be non-empty text"),
    (json.dumps([1, 2]), "expected a JSON object, got list"),
    (json.dumps({"prompt": []}), "'prompt' must be non-empty text, a list of chat messages or a list of non-negative token ids"),
    (json.dumps({"prompt": [3, -1]}), "'prompt' must be non-empty text"),
    (json.dumps({"prompt": [3, 1.5]}), "'prompt' must be non-empty text"),
    (json.dumps({"prompt": [True, 2]}), "'prompt' must be non-empty text"),
    (json.dumps({"prompt": [3, "4"]}), "'prompt' must be non-empty text"),
])
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
    assert skipped == 0 and examples == [{"prompt": [5, 6, 7], "answer": "1", "metadata": {}},
                                         {"prompt": [0], "answer": None, "metadata": {"source": "x"}}]


def test_token_id_prompts_display_as_numbers():
    from orchestrator.phases import prompt_text

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
