"""relay's own starting policy for the default run: a tiny GPT trained from scratch on a task to
partial accuracy, so RL has something real to improve. Built once, cached as a HF folder."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from learner.sft import greedy_accuracy, sft
from learner.tiny_gpt import init_tiny_gpt
from orchestrator.tasks import make_task

BUILTIN = "builtin://"  # learner.model_path prefix: a policy relay builds itself under run_root/models


def resolve_model_path(model_path: str, run_root: str) -> str:
    """A local folder as is; `builtin://tiny-addition-gpt` -> built (once) under <run_root>/models."""
    if not model_path.startswith(BUILTIN):
        return model_path
    name = model_path.removeprefix(BUILTIN)
    if name != "tiny-addition-gpt":
        raise ValueError(f"learner.model_path: unknown built-in model {name!r}; known: tiny-addition-gpt")
    out = Path(run_root) / "models" / name
    if not (out / "relay_sft.json").exists():
        build_tiny_policy(out)
    return str(out)


def build_tiny_policy(out: Path, task: str = "addition_2digit", steps: int = 2000, seed: int = 0,
                      target_accuracy: float = 0.5) -> Path:
    """Train until held-out greedy accuracy first reaches `target_accuracy` (checked every 100
    steps; at most `steps`): partial skill, with room for RL, however fast this seed learns."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    start = time.time()
    print(f"relay: building the starting policy {out} (SFT from scratch on {task} to ~{target_accuracy:.0%} "
          "greedy accuracy)...", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    init_tiny_gpt(tmp, n_layer=2, n_embd=128, n_head=4, n_positions=64, seed=seed)
    model, tok = AutoModelForCausalLM.from_pretrained(tmp), AutoTokenizer.from_pretrained(tmp)
    train = make_task(task, 5000, seed=seed + 1)
    probe = make_task(task, 100, seed=seed + 3)
    losses = sft(model, tok, [(e["prompt"], e["answer"]) for e in train], steps=steps, seed=seed,
                 stop=lambda: greedy_accuracy(model, tok, probe) >= target_accuracy)
    accuracy = greedy_accuracy(model, tok, make_task(task, 200, seed=seed + 2))
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "relay_sft.json").write_text(json.dumps({"task": task, "steps": len(losses), "final_loss": losses[-1],
                                                    "greedy_accuracy": accuracy}))
    tmp.rename(out)
    print(f"relay: starting policy ready in {time.time() - start:.0f}s after {len(losses)} SFT steps: "
          f"held-out greedy accuracy {accuracy:.0%}", flush=True)
    return out
