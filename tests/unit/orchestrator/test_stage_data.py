"""The SFT/RM data path without Ray: generated sets, the reader's errors, encoding, metrics."""

import json
import random

import pytest

from learner.tiny_gpt import char_tokenizer, train_bpe_tokenizer
from orchestrator.config.schema import BadLinePolicy, RejectedFrom, StageConfig
from orchestrator.data.generate import corrupt, demonstrations, preferences
from orchestrator.data.prompts import DataError
from orchestrator.data.tasks import make_task
from orchestrator.stages.supervised import encode_rm, encode_sft, load_supervised
from orchestrator.tools.evaluate import distinct_n, win_rate
from tests.helpers import REPO


def stage(tmp_path, **data) -> StageConfig:
    cfg = StageConfig(name="s", run_root=str(tmp_path))
    for k, v in data.items():
        setattr(cfg.data, k, v)
    cfg.train.max_length = 16
    return cfg


def test_generated_sets_have_the_user_formats_and_pairs_disagree():
    demos = demonstrations(make_task("addition_2digit", 50, seed=0))
    a, b = (int(x) for x in demos[0]["prompt"].removesuffix("=").split("+"))
    assert demos[0] == {"prompt": f"{a}+{b}=", "response": str(a + b)}
    pairs = preferences(make_task("addition_2digit", 200, seed=0), seed=0)
    assert all(p["chosen"] != p["rejected"] and abs(int(p["chosen"]) - int(p["rejected"])) <= 10 for p in pairs)
    rng = random.Random(0)
    assert all(corrupt(w, rng) != w for w in ["abc", "x", "", "12"])


def test_bad_lines_are_named_or_skipped_and_counted(tmp_path):
    path = tmp_path / "demos.jsonl"
    path.write_text(
        '{"prompt": "1+1=", "response": "2"}\n{"prompt": "2+2="}\nnot json\n'
        + "".join(json.dumps({"prompt": f"{i}+0=", "response": str(i)}) + "\n" for i in range(10))
    )
    with pytest.raises(DataError, match=r"demos.jsonl:2: field 'response' must be non-empty text"):
        load_supervised(stage(tmp_path, train_files=[str(path)], eval_size=2), "sft", tmp_path)
    train, held_out, skipped = load_supervised(
        stage(tmp_path, train_files=[str(path)], eval_size=2, on_bad_line=BadLinePolicy.skip), "sft", tmp_path
    )
    assert skipped == 2 and len(held_out) == 2 and len(train) == 9


def test_sft_encoding_masks_the_prompt_and_skips_overlong_samples(tmp_path):
    tok = char_tokenizer()
    rows = [{"prompt": "12+34=", "response": "46"}, {"prompt": "9" * 20, "response": "1"}]
    batch, too_long = encode_sft(tok, rows, stage(tmp_path))
    assert too_long == 1 and batch["input_ids"].shape == (1, 9)  # 6 prompt + 2 response + EOS
    # targets are input_ids[1:]: the mask covers "4", "6" and EOS, not the prompt
    assert batch["loss_mask"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 1]]
    assert tok.decode(batch["input_ids"][0, 6:8]) == "46" and batch["input_ids"][0, 8] == tok.eos_token_id


def test_sft_prompts_get_the_bos_the_rollout_workers_give_them(tmp_path):
    from bos_tokenizer import bos_tokenizer  # tests/, on the path through its conftest

    from runtime.prompts import PromptOverflow, encode_prompt

    bt = bos_tokenizer()
    rows = [{"prompt": "1+2=", "response": "3"}, {"prompt": "<s>1+2=", "response": "3"}]
    for chat in (False, True):
        cfg = stage(tmp_path, apply_chat_template=chat)
        cfg.train.max_length = 64
        batch, _ = encode_sft(bt, rows, cfg)
        prompt = [{"role": "user", "content": "1+2="}] if chat else "1+2="
        ids = encode_prompt(bt, prompt, 64, PromptOverflow.error)[0]  # what the policy is given in RL
        n = len(ids)
        assert batch["input_ids"][0, :n].tolist() == ids and ids.count(bt.bos_token_id) == 1
        assert bt.decode(batch["input_ids"][0, n : n + 2]) == "3</s>"
        assert batch["loss_mask"][0].nonzero().flatten().tolist() == [n - 1, n]  # targets "3" and EOS only
        if not chat:
            assert batch["input_ids"][1].tolist() == batch["input_ids"][0].tolist()  # its own BOS: not doubled


def test_rm_encoding_matches_how_the_reward_service_scores(tmp_path):
    tok = char_tokenizer()
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "13"}, {"prompt": "10+1=", "chosen": "11", "rejected": "9"}]
    batch, _ = encode_rm(tok, rows, stage(tmp_path))
    # the text the reward service scores is prompt + response, through the same tokenizer call
    assert batch["chosen_ids"][0].tolist() == tok("1+1=2").input_ids + [tok.pad_token_id] * 2  # right-padded
    assert batch["rejected_ids"][1].tolist() == tok("10+1=9").input_ids
    assert batch["chosen_attention"].tolist() == [[1] * 5 + [0] * 2, [1] * 7]


def test_bpe_tokenizer_is_trained_locally_and_round_trips():
    texts = [f"{a}+{b}={a + b}" for a in range(10, 60) for b in range(10, 30)]
    tok = train_bpe_tokenizer(texts, vocab_size=300)
    assert 259 < len(tok) <= 300 and tok.pad_token_id == 0 and tok.eos_token_id == 1
    ids = tok("12+34=46").input_ids
    assert tok.decode(ids) == "12+34=46" and len(ids) < len("12+34=46")  # merges were learned


def test_distinct_n_and_win_rate_hand_examples():
    # unigrams: 1 2 1 | 3 -> {1,2,3} of 4 = 0.75; bigrams: (1,2) (2,1) -> 2 of 2 = 1.0
    assert distinct_n([[1, 2, 1], [3]], 1) == 0.75 and distinct_n([[1, 2, 1], [3]], 2) == 1.0
    assert distinct_n([[5, 5], [5, 5]], 2) == 0.5 and distinct_n([[1]], 2) == 0.0
    assert win_rate([2.0, 1.0, 0.0], [1.0, 1.0, 3.0]) == pytest.approx(0.5)  # win, tie (half), loss


def test_stage_config_errors_name_the_key(tmp_path):
    from orchestrator.config.load import ConfigError, load_config

    bad = tmp_path / "s.yaml"
    bad.write_text("train:\n  batch_size: 10\n  micro_batch_size: 4\ndata:\n  task: addition_2digit\n")
    with pytest.raises(ConfigError, match=r"s.yaml:2: train.batch_size: must be a multiple"):
        load_config(bad, [], root=StageConfig)


def test_cli_data_and_a_bad_sft_file_named_before_any_training(tmp_path):
    import subprocess
    import sys

    repo = REPO

    def relay(*args):
        return subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", *args],
            capture_output=True,
            text=True,
            cwd=repo,
            timeout=120,
            check=False,
        )

    out = relay("data", "prefs", "--task", "addition_2digit", "--n", "5", "--out", str(tmp_path / "p.jsonl"))
    assert out.returncode == 0 and len((tmp_path / "p.jsonl").read_text().splitlines()) == 5
    bad = tmp_path / "demos.jsonl"
    bad.write_text('{"prompt": "1+1=", "response": "2"}\n{"prompt": "1+2=", "response": 3}\n')
    out = relay(
        "sft",
        str(repo / "configs" / "sft_tiny_cpu.yaml"),
        "data.task=",
        f"data.train_files=[{bad}]",
        f"run_root={tmp_path}",
    )
    assert out.returncode == 2 and f"{bad}:2: field 'response' must be non-empty text" in out.stderr


@pytest.mark.parametrize("kind", ["sft", "rm"])
def test_stage_held_out_prompts_are_never_training_prompts(tmp_path, kind):
    def prompts(rows):
        return {r["prompt"] for r in rows}

    for seed in (0, 1, 2):  # the configs' sizes: sft_tiny_cpu 5000, rm_tiny_cpu 4000, 200 held out
        cfg = stage(tmp_path, task="addition_2digit", task_size=5000, eval_size=200)
        cfg.seed = seed
        train, held_out, _ = load_supervised(cfg, kind, tmp_path)
        assert len(train) == 5000 and len(held_out) == len(prompts(held_out)) == 200
        assert not prompts(train) & prompts(held_out)
    path = tmp_path / "demos.jsonl"  # a file with repeated prompts, no eval file: a held-out prompt takes every copy
    path.write_text(
        "".join(
            json.dumps({"prompt": f"{i}+0=", "response": str(i), "chosen": str(i), "rejected": "x"}) + "\n"
            for i in range(20)
            for _ in range(1 + i % 2)
        )
    )
    train, held_out, _ = load_supervised(stage(tmp_path, train_files=[str(path)], eval_size=5), kind, tmp_path)
    assert len(held_out) == len(prompts(held_out)) == 5 and not prompts(train) & prompts(held_out)
    assert prompts(held_out) != {f"{i}+0=" for i in range(5)}  # a random draw, not the first lines


def test_relay_data_draws_rejected_answers_from_their_own_stream_and_trainable_prompts_only(tmp_path):
    # review A 18: `relay data` seeded the sums and the rejected answers with one seed, so the wrong
    # answers replayed the sums' random sequence; it also wrote prompts reserved for held-out sets
    from types import SimpleNamespace

    from orchestrator.cli import _data
    from orchestrator.data.tasks import reserved
    from runtime.seeds import stream_seed

    out = tmp_path / "prefs.jsonl"
    _data(SimpleNamespace(kind="prefs", task="addition_2digit", n=300, seed=3, out=str(out)))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    offsets = [int(r["rejected"]) - int(r["chosen"]) for r in rows]
    examples = make_task("addition_2digit", 2000, stream_seed(3, "task"))
    assert [r["prompt"] for r in rows] == [e["prompt"] for e in examples if not reserved(e["prompt"])][:300]
    task_rng = random.Random(stream_seed(3, "task"))  # the sums' own sequence, replayed as the old code did
    assert offsets != [int(corrupt(r["chosen"], task_rng)) - int(r["chosen"]) for r in rows]
    rng = random.Random(stream_seed(3, "rejected"))
    assert offsets == [int(corrupt(r["chosen"], rng)) - int(r["chosen"]) for r in rows]


def test_sampled_preferences_reject_the_models_own_misses_by_frequency_else_a_corrupted_answer():
    from orchestrator.data.generate import sampled_preferences

    examples = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    samples = [["2", "3", "3", "3", " 5 ", "", "  "], ["4", "4"]]  # empty ones are no answer to rank
    picks = []
    for seed in range(200):
        pairs, sampled = sampled_preferences(examples, samples, lambda a, ref: a.strip() != ref, seed)
        assert sampled == 1 and pairs[0]["chosen"] == "2" and pairs[1]["chosen"] == "4"
        assert pairs[1]["rejected"] != "4" and abs(int(pairs[1]["rejected"]) - 4) <= 10  # no miss: corrupted
        picks.append(pairs[0]["rejected"])
    assert set(picks) == {"3", "5"} and 0.6 < picks.count("3") / len(picks) < 0.9  # 3 of the 4 misses are '3'
    with pytest.raises(ValueError):
        sampled_preferences(examples, samples[:1], lambda a, ref: True, 0)  # one sample list per example


def test_rm_pairs_from_the_models_own_samples_are_wrong_answers_it_made(tmp_path, policy):
    from orchestrator.config.validate import validate_stage
    from orchestrator.stages.supervised import model_preferences
    from reward_service.rules import math_answer

    cfg = stage(tmp_path, task="addition_2digit", task_size=300, eval_size=20, rejected_from=RejectedFrom.samples)
    with pytest.raises(DataError, match="data.rejected_from: samples needs learner.model_path"):
        load_supervised(cfg, "rm", tmp_path)
    cfg.learner.model_path, cfg.data.rejected_samples = policy, 4
    train, held_out, _ = load_supervised(cfg, "rm", tmp_path)
    assert all(math_answer(r["rejected"], r["chosen"]) == 0.0 for r in train + held_out)
    counts = json.loads((tmp_path / "data" / "rejected_counts.jsonl").read_text())
    # the tiny policy (tests/assets) is right on ~42% of sums: most prompts get a wrong sample of its own at 4 samples
    assert counts["pairs"] == 300 and 0.3 * 300 < counts["rejected_sampled"] < 300, counts
    # the same prompts: the run seed and the stream (train or held-out) each change the sampled answers
    examples = [{"prompt": r["prompt"], "answer": r["chosen"]} for r in train]
    again = model_preferences(cfg, examples, "rejected", tmp_path)
    assert [r["rejected"] for r in again] == [r["rejected"] for r in train]  # a seed replays
    other_stream = model_preferences(cfg, examples, "held_out_rejected", tmp_path)
    cfg.seed = 1
    other_seed = model_preferences(cfg, examples, "rejected", tmp_path)
    for other in (other_stream, other_seed):
        assert [r["rejected"] for r in other] != [r["rejected"] for r in train]
    with pytest.raises(DataError, match="data.rejected_from: samples needs answers math-verify grades"):
        model_preferences(cfg, [{"prompt": "1+1=", "answer": "two"}], "rejected", tmp_path)
    cfg.data.task, cfg.data.train_files = "", ["x.jsonl"]
    assert ("data.rejected_from", "samples needs data.task (its answers grade the samples)") in list(
        validate_stage(cfg)
    )
    cfg.data.task, cfg.data.train_files, cfg.data.apply_chat_template = "addition_2digit", [], True
    assert ("data.rejected_from", "samples samples text prompts only, not data.apply_chat_template") in list(
        validate_stage(cfg)
    )
