"""The GPU paths that need neither vLLM nor Ray, run on one machine, with figures.

    python scripts/gpu_check.py [--device cuda|cpu] [--quick]     (scripts/gpu_check.sh wraps it)

Sections, each printing one JSON line (and "skipped" with the reason when it cannot run here):
  learner   one DeepSpeed rank (ZeRO 0 and 2) in bf16 on a tiny GPT, a few GRPO updates:
            tokens/s, peak memory, MFU; the loss must fall
  logprobs  chunked logprobs/entropy against the unchunked ones, and their peak memory
  scoring   the reference model on the device, in bf16, against float32 on the CPU
  sync      a weight broadcast between two processes (NCCL on GPUs, gloo on CPUs), GB/s
  scale     one learner rank at a realistic size: a GPT-2-small shape (12 x 768), 64 sequences of 128 prompt
            + 384 response tokens in micro-batches of 16, bf16, ZeRO 2: tokens/s, peak memory, MFU
  yardstick relay's learner rank and reference forward beside a plain bf16 PyTorch loop (SDPA, packing, fused
            AdamW) at Qwen2.5-0.5B's shape and varied lengths: tokens/s, MFU, ratios (scripts/yardstick.py)
On a CPU (`--device cpu`, what tests/e2e/scripts/test_gpu_check.py runs) the same code runs with gloo, so the
script itself is tested; the figures that matter come from a GPU (docs/gpu.md), where tests/gpu checks them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense, per GPU (vendor figures)


def report(section: str, **figures) -> None:
    print(json.dumps({"section": section, **figures}), flush=True)


def peak_memory_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def tiny_model(root: Path, quick: bool) -> str:
    from learner.tiny_gpt import init_tiny_gpt

    shape = dict(n_layer=2, n_embd=128, n_head=4) if quick else dict(n_layer=8, n_embd=512, n_head=8)
    return str(init_tiny_gpt(root / "policy", n_positions=128, **shape))


def rank_config(model: str, device: torch.device, zero: int, lr: float):
    """A learner rank's section: bf16 on CUDA, float32 on the CPU, in the precision `relay train` chooses there
    (learner.precision auto: bf16 weights with float32 masters on CUDA, which run ZeRO 2 at least)."""
    from learner.config import Dtype, LearnerConfig
    from orchestrator.config.dtype import choose_precision

    dtype = Dtype.bfloat16 if device.type == "cuda" else Dtype.float32
    cfg = LearnerConfig(model_path=model, lr=lr, zero_stage=zero, dtype=dtype)
    cfg.precision = choose_precision(dtype.value, device.type)[0]
    return cfg


def learner_rank(model: str, device: torch.device, zero: int, lr: float, n: int, micro: int):
    """One DeepSpeed learner rank (a Learner outside Ray) of rank_config's section."""
    from learner.config import AlgorithmConfig
    from learner.engine import RankAddress
    from learner.worker import Learner
    from runtime.logprobs import SamplerSettings
    from runtime.ports import free_port

    cfg = rank_config(model, device, zero, lr)
    algo = AlgorithmConfig(mini_batch_size=n, micro_batch_size=micro, init_kl_coef=0.01)
    return Learner(cfg, algo, SamplerSettings(n_samples_per_prompt=4), 0, RankAddress(0, 1, "127.0.0.1", free_port()))


def timed_updates(rank, batch, scored, device: torch.device, steps: int) -> dict:
    """One untimed update (it pays CUDA's start-up and kernel choice), then `steps` timed ones: the figures
    every learner section reports. MFU counts 6 x parameters per token for the update's forward and backward, 8
    where the rank also makes a forward for the old logprobs (not in one on-policy epoch: experience.single_pass)."""
    from learner.experience import single_pass

    rank.update(batch, scored, 0)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        rank.update(batch, scored, step)
    seconds = time.perf_counter() - start
    tokens = steps * sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    params = sum(p.numel() for p in rank.policy.parameters())
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    flops = 6 if rank.single_pass and single_pass(rank.algo, len(batch)) else 8
    return dict(
        device=name,
        params_m=round(params / 1e6, 1),
        tokens_per_s=round(tokens / seconds, 1),
        seconds_per_update=round(seconds / steps, 3),
        peak_memory_gb=peak_memory_gb(device),
        mfu=round(flops * params * tokens / seconds / (peak * 1e12), 4) if peak else None,
    )


def check_learner(device: torch.device, model: str, quick: bool) -> None:
    try:  # DS_ACCELERATOR (set in main) is read when deepspeed is first imported
        import deepspeed  # noqa: F401
    except ImportError:
        return report("learner", skipped="deepspeed is not installed")
    from learner.algorithms import grpo_advantages
    from tests.helpers import make_scored_batch

    batch, scored = make_scored_batch(model, n_prompts=4 if quick else 16, group=4, seed=0)
    advantages = grpo_advantages(torch.tensor(scored.rewards), 4).tolist()
    from learner.precision import zero_stage

    for zero in dict.fromkeys(zero_stage(rank_config(model, device, z, 1e-4)) for z in (0, 2)):  # CUDA: 2 only
        reset_peak(device)
        rank = learner_rank(model, device, zero, 1e-4, len(batch), len(batch))
        before = surrogate(rank, batch, advantages)
        figures = timed_updates(rank, batch, scored, device, 1 if quick else 4)
        report(
            "learner",
            zero_stage=zero,
            dtype="bfloat16" if device.type == "cuda" else "float32",
            precision=rank.cfg.precision.value,
            **figures,
            surrogate_before=before,
            surrogate_after=surrogate(rank, batch, advantages),
        )


def long_batch(n: int, group: int, prompt_len: int, response_len: int, vocab: int, seed: int):
    """Random token sequences of fixed lengths and rewards; reference logprobs of 0 (the KL term's size
    does not change the work): a learner's input at a realistic length without a rollout."""
    from reward_service.types import ScoredBatch
    from rollout.types import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(n // group)]
    responses = [torch.randint(3, vocab, (response_len,), generator=g).tolist() for _ in range(n)]
    batch = RolloutBatch(
        [i // group for i in range(n)],
        [prompts[i // group] for i in range(n)],
        responses,
        [[-1.0] * response_len for _ in range(n)],
        ["x"] * n,
        ["length"] * n,
    )
    rewards = torch.rand(n, generator=g).tolist()
    zeros = [[0.0] * response_len for _ in range(n)]
    return batch, ScoredBatch(rewards, {}, [True] * n, [False] * n, zeros, raw=list(rewards))


def check_scale(device: torch.device, root: Path, quick: bool) -> None:
    """Tokens/s and MFU of one bf16 ZeRO-2 rank at GPT-2-small's shape and 512-token sequences."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return report("scale", skipped="deepspeed is not installed")
    from learner.tiny_gpt import init_tiny_gpt

    shape = dict(n_layer=2, n_embd=64, n_head=4) if quick else dict(n_layer=12, n_embd=768, n_head=12)
    n, micro, (p_len, r_len) = (8, 4, (16, 16)) if quick else (64, 16, (128, 384))
    model = str(init_tiny_gpt(root / "scale", n_positions=p_len + r_len, **shape))
    batch, scored = long_batch(n, 4, p_len, r_len, vocab=60, seed=0)
    rank = learner_rank(model, device, 2, 1e-5, n, micro)
    reset_peak(device)
    figures = timed_updates(rank, batch, scored, device, 2 if quick else 4)
    report("scale", sequences=n, tokens_per_sequence=p_len + r_len, micro_batch=micro, **figures)


def check_yardstick(device: torch.device, root: Path, quick: bool) -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return report("yardstick", skipped="deepspeed is not installed")
    from scripts.yardstick import run

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    report("yardstick", device=name, **run(device, root, quick, learner_rank, peak))


def surrogate(rank, batch, advantages: list[float]) -> float:
    """Sum over samples of advantage x mean logprob of the response: what a GRPO update raises."""
    logprobs = rank.policy_logprobs(batch)
    return sum(a * sum(lp) / len(lp) for a, lp in zip(advantages, logprobs))


def check_logprobs(device: torch.device, quick: bool) -> None:
    from runtime.logprobs import chunked_logprobs_entropy, entropy_from_logits, logprobs_from_logits

    B, T, V = (2, 64, 1000) if quick else (4, 4096, 151_936)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    logits = torch.randn(B, T, V, device=device, dtype=dtype, generator=None)
    labels = torch.randint(0, V, (B, T), device=device)
    reset_peak(device)
    lp, ent = chunked_logprobs_entropy(logits, labels, 1.0, 1024)
    chunked_peak = peak_memory_gb(device)
    reset_peak(device)
    mask = torch.ones(B, T, device=device)
    want_lp, want_ent = logprobs_from_logits(logits, labels), entropy_from_logits(logits, mask)
    report(
        "logprobs",
        shape=[B, T, V],
        dtype=str(dtype),
        max_diff_logprobs=float((lp - want_lp).abs().max()),
        max_diff_entropy=float((ent - want_ent).abs().max()),
        peak_gb_chunked=chunked_peak,
        peak_gb_unchunked=peak_memory_gb(device),
    )


def check_scoring(device: torch.device, model: str) -> None:
    """The reference computing the learner's function (rank_config's: bf16 weights on CUDA) against float32."""
    from learner.precision import policy_function
    from reward_service.reference import ReferenceModel
    from runtime.forward import PolicyFunction
    from tests.helpers import make_scored_batch

    batch, _ = make_scored_batch(model, n_prompts=4, group=4, seed=1)
    function = policy_function(rank_config(model, device, 0, 1e-4))
    on_device = ReferenceModel(model, function, 8, device).logprobs(batch)
    on_cpu = ReferenceModel(model, PolicyFunction("float32"), 8, torch.device("cpu")).logprobs(batch)
    diff = max(abs(a - b) for x, y in zip(on_device, on_cpu) for a, b in zip(x, y))
    report("scoring", device=str(device), dtype=function.dtype, weights=function.weights, max_diff_vs_cpu_float32=diff)


def _sync_rank(rank: int, port: int, backend: str, numel: int, out) -> None:
    from rollout.weight_sync import SyncGroup

    if backend == "nccl":
        torch.cuda.set_device(rank)
    group = SyncGroup("127.0.0.1", port, rank, 2, backend, timeout_s=60)
    t = torch.full((numel,), float(rank == 0), device=group.device)
    group.broadcast(t)  # warm-up
    start = time.perf_counter()
    for _ in range(5):
        group.broadcast(t)
    if backend == "nccl":
        torch.cuda.synchronize()
    if rank == 1:
        out.put((time.perf_counter() - start) / 5 if t.min().item() == 1.0 else None)


def check_sync(device: torch.device, quick: bool) -> None:
    import multiprocessing as mp

    from runtime.device import collective_backend
    from runtime.ports import free_port

    backend = collective_backend(device)
    if backend == "nccl" and torch.cuda.device_count() < 2:
        return report("sync", skipped="NCCL needs two GPUs for two processes; this machine has one")
    numel = (1 << 20) if quick else (256 << 20)
    ctx, port = mp.get_context("spawn"), free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=_sync_rank, args=(r, port, backend, numel, out)) for r in range(2)]
    for p in procs:
        p.start()
    seconds = out.get(timeout=120)
    for p in procs:
        p.join(60)
    report(
        "sync",
        backend=backend,
        bytes=numel * 4,
        arrived=seconds is not None,
        gb_per_s=round(numel * 4 / seconds / 1e9, 2) if seconds else None,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="small shapes (the CPU test)")
    args = p.parse_args()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device(args.device)
    os.environ["RELAY_DEVICE"] = str(device)  # the processes' device decision outside Ray (runtime.device)
    os.environ["DS_ACCELERATOR"] = device.type  # before deepspeed's import, which reads it (tests/conftest sets cpu)
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp), args.quick)
        check_logprobs(device, args.quick)
        check_scoring(device, model)
        check_sync(device, args.quick)
        check_learner(device, model, args.quick)
        check_scale(device, Path(tmp), args.quick)
        check_yardstick(device, Path(tmp), args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
