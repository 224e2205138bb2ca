"""The plain-loop yardstick (scripts/gpu_check.py's "yardstick" section): relay's learner rank and reference
forward beside a plain PyTorch loop on the same model, batch and lengths, in the same run.

The model is Qwen2.5-0.5B's shape, randomly initialised (24 x 896, 14 heads / 2 KV heads, vocabulary 151,936;
--quick: a small one); the batch has realistic variable lengths (prompts 64-256 tokens, responses log-normal
around 256, 16-1024). The plain loop keeps bf16 weights (float32 on a CPU), packs each micro-batch's sequences
into rows as relay does (no longer than the longest; transformers' packed position ids), attends with SDPA and
steps a fused AdamW: no DeepSpeed, no chunked logprobs, no metrics. Both do the same work per update: a forward
and a backward per micro-batch, and a no-grad forward for the old logprobs only where relay makes one (this
section's single on-policy epoch takes them from the update's own forward). Figures: real tokens/s, MFU (6 or
8 x parameters per token for an update, 2 for the reference forward), and the plain loop's seconds over relay's
(relay's tokens/s as a share of the plain loop's).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch

QWEN_05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151_936,
    max_position_embeddings=2048,
)
SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=1000,
    max_position_embeddings=256,
)


def build_model(root: Path, quick: bool) -> str:
    """A random Qwen2 at the 0.5B shape (or SMALL) saved as a Hugging Face folder with a tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.tiny_gpt import char_tokenizer

    torch.manual_seed(0)
    shape = SMALL if quick else QWEN_05B
    config = Qwen2Config(**shape, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    folder = root / "qwen"
    Qwen2ForCausalLM(config).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)  # relay reads the pad id from it; the ids are random anyway
    return str(folder)


def variable_batch(n: int, group: int, vocab: int, quick: bool, seed: int = 0):
    """A rollout batch of random tokens at realistic, varied lengths, with random rewards."""
    from reward_service.types import ScoredBatch
    from rollout.types import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    p_lo, p_hi, r_median, r_lo, r_hi = (8, 24, 16, 4, 48) if quick else (64, 256, 256, 16, 1024)
    prompt_lengths = torch.randint(p_lo, p_hi + 1, (n // group,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (k,), generator=g).tolist() for k in prompt_lengths]
    spread = torch.randn(n, generator=g).tolist()  # log-normal response lengths: most near the median, a long tail
    lengths = [min(r_hi, max(r_lo, round(r_median * math.exp(0.7 * z)))) for z in spread]
    responses = [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]
    batch = RolloutBatch(
        [i // group for i in range(n)],
        [prompts[i // group] for i in range(n)],
        responses,
        [[-1.0] * k for k in lengths],
        ["x"] * n,
        ["stop"] * n,
    )
    rewards = torch.rand(n, generator=g).tolist()
    return batch, ScoredBatch(rewards, {}, [True] * n, [False] * n, [[0.0] * k for k in lengths], raw=list(rewards))


def plain_logprobs(model, batch, rows: list[int], device: torch.device):
    """Each response token's logprob (B, L-1) for samples `rows` and their mask: the micro-batch packed into rows
    no longer than its longest sequence (relay's default rule, runtime.packing.plan_rows), one forward, the next
    token's logprob read in the packed rows and laid back out as the padded ones."""
    from rollout.types import pack
    from runtime.packing import plan_rows

    ids, attention, positions, mask = pack(
        [batch.prompt_ids[i] for i in rows], [batch.response_ids[i] for i in rows], 0
    )
    plan = plan_rows(attention)
    packed, packed_positions = (t.to(device) for t in plan.pack(ids, positions))
    logits = model(input_ids=packed, position_ids=packed_positions, use_cache=False).logits[:, :-1].float()
    following = torch.log_softmax(logits, -1).gather(-1, packed[:, 1:, None]).squeeze(-1)  # slot k: token k + 1's
    # a sequence's last slot reads the next sequence's first token: off the response mask, as padding is
    return plan.unpack(torch.nn.functional.pad(following, (0, 1)))[:, :-1], mask.to(device)


def plain_update(model, optimizer, batch, advantages: torch.Tensor, micro: int, old_forward: bool) -> None:
    """The plain loop's update: the old logprobs (a no-grad forward when relay makes one too: old_forward), then
    a clipped policy-gradient step over micro-batches."""
    device = next(model.parameters()).device
    rows = [list(range(i, min(i + micro, len(batch)))) for i in range(0, len(batch), micro)]
    with torch.no_grad():
        old = [plain_logprobs(model, batch, r, device)[0] for r in rows] if old_forward else [None] * len(rows)
    tokens = sum(len(r) for r in batch.response_ids)
    for r, before in zip(rows, old):
        logprobs, mask = plain_logprobs(model, batch, r, device)
        ratio = torch.exp(logprobs - (logprobs.detach() if before is None else before))
        adv = advantages[r].to(device)[:, None]
        loss = -(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask).sum() / tokens
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() after one untimed call (start-up, kernel choice)."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def run(device: torch.device, root: Path, quick: bool, learner_rank, peak_tflops: float | None) -> dict:
    """relay's learner rank and reference against the plain loop: the figures of the yardstick section.
    learner_rank(model, device, zero, lr, n, micro): gpu_check's rank (bf16 on CUDA, float32 on a CPU)."""
    from transformers import AutoModelForCausalLM

    from learner.algorithms import grpo_advantages
    from learner.experience import single_pass
    from learner.precision import policy_function
    from reward_service.reference import ReferenceModel

    path, (n, group, micro), repeats = build_model(root, quick), (8, 4, 4) if quick else (64, 4, 8), 2 if quick else 3
    batch, scored = variable_batch(n, group, (SMALL if quick else QWEN_05B)["vocab_size"], quick)
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rank, steps = learner_rank(path, device, 0, 1e-6, n, micro), iter(range(10**6))
    params = sum(p.numel() for p in rank.policy.parameters())
    # one epoch of one mini-batch is on-policy: relay takes the old logprobs from the update's own forward
    old_forward = not (rank.single_pass and single_pass(rank.algo, n))
    relay_update = timed(lambda: rank.update(batch, scored, next(steps)), device, repeats)
    ref = ReferenceModel(path, dataclasses.replace(policy_function(rank.cfg), packing=0), micro, device)
    relay_ref = timed(lambda: ref.logprobs(batch), device, repeats)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-6, fused=device.type == "cuda")
    advantages = grpo_advantages(torch.tensor(scored.rewards), group)
    plain_s = timed(
        lambda: plain_update(plain.train(), optimizer, batch, advantages, micro, old_forward), device, repeats
    )
    rows = [list(range(i, min(i + micro, n))) for i in range(0, n, micro)]
    plain_ref = timed(lambda: plain_reference(plain.eval(), batch, rows, device), device, repeats)

    def mfu(flops_per_token: int, seconds: float) -> float | None:
        return round(flops_per_token * params * tokens / seconds / (peak_tflops * 1e12), 4) if peak_tflops else None

    return dict(
        shape="small" if quick else "qwen2.5-0.5b",
        params_m=round(params / 1e6, 1),
        sequences=n,
        tokens=tokens,
        micro_batch=micro,
        relay_update_tokens_per_s=round(tokens / relay_update, 1),
        plain_update_tokens_per_s=round(tokens / plain_s, 1),
        update_ratio=round(plain_s / relay_update, 3),
        old_logprob_forward=old_forward,  # counted in both sides' FLOPs: 8 x params per token with it, else 6
        relay_update_mfu=mfu(8 if old_forward else 6, relay_update),
        plain_update_mfu=mfu(8 if old_forward else 6, plain_s),
        relay_reference_tokens_per_s=round(tokens / relay_ref, 1),
        plain_reference_tokens_per_s=round(tokens / plain_ref, 1),
        reference_ratio=round(plain_ref / relay_ref, 3),
        relay_reference_mfu=mfu(2, relay_ref),
        plain_reference_mfu=mfu(2, plain_ref),
    )


@torch.no_grad()
def plain_reference(model, batch, rows: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """The plain loop's reference forward: each micro-batch's response logprobs (B, L-1), zero off the responses."""
    return [logprobs * mask for logprobs, mask in (plain_logprobs(model, batch, r, device) for r in rows)]
