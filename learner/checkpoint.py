"""Save and load the full learner state.

    <dir>/policy/           the policy as a plain Hugging Face folder (safetensors + tokenizer):
                            loadable by transformers and vLLM as is (LoRA merged in)
    <dir>/adapter/          the LoRA adapter alone (peft format), when LoRA is on
    <dir>/value_head.pt     the shared value head, when there is one
    <dir>/critic/           the separate critic's trunk (HF folder) and critic_head.pt
    <dir>/deepspeed_*/      DeepSpeed engine state: weights, optimizer, LR scheduler (all ranks)
    <dir>/rng_rank<r>.pt    RNG states of each rank
    <dir>/learner.json      KL controller and update count

Every rank writes into the same directory; making it appear atomically (temp dir + rename) is the
caller's job, once every rank has returned (see LearnerGroup.save).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from learner.precision import policy_function, zero_stage

TAG = "state"


def _gathered(module, zero3: bool):
    if zero3:
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(module.parameters()))
    from contextlib import nullcontext

    return nullcontext()


def publish(tmp: Path, final: Path) -> None:
    """Move a complete `tmp` folder to `final`. An existing `final` is set aside as `final.old`
    until the new one is in place, so a crash at any point leaves a complete copy on disk
    (`recover` puts a set-aside one back)."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def recover(final: Path) -> None:
    """After a crash inside `publish`: if `final` is missing but its set-aside copy exists, restore it."""
    old = final.with_name(final.name + ".old")
    if old.exists() and not final.exists():
        os.replace(old, final)


def save_learner(learner, path: str) -> None:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    zero3 = learner.cfg.zero_stage == 3
    state = learner.policy_state()  # every rank: ZeRO-3 gathers are collective
    if learner.rank == 0:
        lm = learner.policy.lm
        base = lm.get_base_model() if hasattr(lm, "peft_config") else lm
        base.save_pretrained(out / "policy", state_dict=state, safe_serialization=True)
        learner.tokenizer.save_pretrained(out / "policy")
        if hasattr(lm, "peft_config"):
            lm.save_pretrained(out / "adapter")
    if learner.policy.value_head is not None:
        with _gathered(learner.policy.value_head, zero3):
            if learner.rank == 0:
                torch.save(
                    {k: v.detach().cpu() for k, v in learner.policy.value_head.state_dict().items()},
                    out / "value_head.pt",
                )
    if learner.critic is not None:
        with _gathered(learner.critic, zero3):
            if learner.rank == 0:
                learner.critic.trunk.save_pretrained(out / "critic", safe_serialization=True)
                torch.save(
                    {k: v.detach().cpu() for k, v in learner.critic.head.state_dict().items()},
                    out / "critic" / "critic_head.pt",
                )
    learner.policy_engine.save_checkpoint(str(out / "deepspeed_policy"), tag=TAG)
    if learner.critic_engine is not None:
        learner.critic_engine.save_checkpoint(str(out / "deepspeed_critic"), tag=TAG)
    torch.save(
        {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        out / f"rng_rank{learner.rank}.pt",
    )
    if learner.rank == 0:
        (out / "learner.json").write_text(
            json.dumps({"kl_controller": learner.kl_ctl.state_dict(), "updates": learner.updates} | layout(learner.cfg))
        )
    if learner.world > 1:
        dist.barrier()


def layout(cfg) -> dict:
    """How the DeepSpeed state is laid out: the weights' dtype (float32, or bf16 with float32 masters) and the
    ZeRO stage run (learner.config.zero_stage). A resume must run the same, or DeepSpeed cannot load it."""
    return {"weights": policy_function(cfg).weights, "zero_stage": zero_stage(cfg)}


def check_layout(src: Path, saved: dict, cfg) -> None:
    """A checkpoint from before the layout was recorded held float32 weights at learner.zero_stage."""
    want, have = layout(cfg), {"weights": saved.get("weights", "float32"), "zero_stage": saved.get("zero_stage")}
    have["zero_stage"] = cfg.zero_stage if have["zero_stage"] is None else have["zero_stage"]
    if have != want:
        precision = "master_weights" if have["weights"] == "bfloat16" else "autocast"
        raise ValueError(
            f"{src}: saved with {have['weights']} weights at ZeRO {have['zero_stage']}, and this run has "
            f"{want['weights']} weights at ZeRO {want['zero_stage']} (learner.precision, learner.zero_stage): resume "
            f"with learner.precision={precision} and learner.zero_stage={have['zero_stage']}"
        )


def load_learner(learner, path: str) -> None:
    src = Path(path)
    check_layout(src, json.loads((src / "learner.json").read_text()), learner.cfg)
    _load_engine(learner.policy_engine, src / "deepspeed_policy")
    if learner.critic_engine is not None:
        _load_engine(learner.critic_engine, src / "deepspeed_critic")
    rng = torch.load(src / f"rng_rank{learner.rank}.pt", weights_only=False)
    torch.set_rng_state(rng["torch"]), random.setstate(rng["python"]), np.random.set_state(rng["numpy"])
    state = json.loads((src / "learner.json").read_text())
    learner.kl_ctl.load_state_dict(state["kl_controller"])
    learner.updates = state["updates"]


def _load_engine(engine, path: Path) -> None:
    loaded, _ = engine.load_checkpoint(str(path), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True)
    if loaded is None:
        raise FileNotFoundError(f"{path}: no DeepSpeed state to resume from")
