"""Which preference data teaches a reward model the mistakes a policy makes? (configs/pipeline_tiny_cpu.yaml)

    .venv/bin/python -m bench.rm_data --sft runs/pipeline_tiny_cpu/sft/model [--steps 800 2400]

From one SFT model (relay sft's output, on 2-digit addition), RMs are trained from it on 4,000 prompts whose
rejected answers are
  corrupt   the right sum moved by 1-10 (orchestrator/data/generate.preferences)
  samples   the SFT model's own wrong samples, 16 per prompt (sampled_preferences; corrupt where it made none)
and every RM is scored on the same held-out set: 200 reserved prompts, 64 samples each, kept where the SFT model
made a mistake, that mistake as the rejected answer. That is what PPO's policy will offer the RM.
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from learner.sft import sample_answers
from learner.supervised import RM
from orchestrator.config.schema import StageConfig, WandbMode
from orchestrator.data.generate import preferences, sampled_preferences, write_jsonl
from orchestrator.data.prompts import task_split
from orchestrator.stages.supervised import run_stage
from reward_service.rules import math_answer
from runtime.seeds import stream_seed


def wrong(answer: str, reference: str) -> bool:
    return math_answer(answer, reference) != 1.0


def datasets(sft: str, root: Path, seed: int) -> dict[str, Path]:
    train, held = task_split("addition_2digit", 4000, 200, seed)
    samples = sample_answers(sft, [e["prompt"] for e in train], 16, stream_seed(seed, "rejected"))
    held_samples = sample_answers(sft, [e["prompt"] for e in held], 64, stream_seed(seed, "held_out_rejected"))
    held_pairs, _ = sampled_preferences(held, held_samples, wrong, stream_seed(seed, "held_out_rejected_pick"))
    made_one = [any(a.strip() and wrong(a, e["answer"]) for a in s) for e, s in zip(held, held_samples)]
    return {
        "corrupt": write_jsonl(preferences(train, stream_seed(seed, "rejected")), root / "corrupt.jsonl"),
        "samples": write_jsonl(
            sampled_preferences(train, samples, wrong, stream_seed(seed, "rejected_pick"))[0], root / "samples.jsonl"
        ),
        "eval": write_jsonl([p for p, m in zip(held_pairs, made_one) if m], root / "eval.jsonl"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft", required=True, help="relay sft's model folder")
    ap.add_argument("--steps", type=int, nargs="+", default=[800, 2400])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = datasets(args.sft, Path(tmp), args.seed)
        held_out = len(files["eval"].read_text().splitlines())
        for data in ("corrupt", "samples"):
            for steps in args.steps:
                cfg = StageConfig(name=f"rm_{data}_{steps}", run_root=tmp, seed=args.seed)
                cfg.data = dataclasses.replace(
                    cfg.data, train_files=[str(files[data])], eval_files=[str(files["eval"])], eval_size=held_out
                )
                cfg.learner = dataclasses.replace(cfg.learner, model_path=args.sft, lr=1e-3, zero_stage=0)
                cfg.train = dataclasses.replace(
                    cfg.train, steps=steps, batch_size=64, micro_batch_size=64, max_length=64, eval_every=steps
                )
                cfg.logging.wandb.mode = WandbMode.disabled
                model = run_stage(cfg, RM)
                stats = json.loads((model / "relay_reward_stats.json").read_text())
                accuracy = stats["after"]["eval/pairwise_accuracy"]
                rows.append({"data": data, "steps": steps, "pairwise_accuracy": accuracy})
    print(f"\nheld-out: {held_out} of the SFT model's own mistakes\n{'data':10s} {'steps':>6s} {'pairwise acc.':>14s}")
    for r in rows:
        print(f"{r['data']:10s} {r['steps']:6d} {r['pairwise_accuracy']:14.3f}")
    print(json.dumps({"sft": args.sft, "held_out_pairs": held_out, "rows": rows}))


if __name__ == "__main__":
    main()
