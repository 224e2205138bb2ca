"""Token log-probabilities and entropy of a causal LM's logits, at the sampler's temperature and
filters: the one home of this math, for the learner (old and new logprobs), the reference model in
the scoring service, the SFT/RM stages and the tests. Pure torch: no model, no config, nothing
distributed (tests/unit/test_architecture.py).

`logprobs_from_logits`, `filtered_logprobs` and `entropy_from_logits` hold a float32 copy of all the
logits: the reference math. The chunked versions compute the same numbers a chunk of tokens at a
time, so no (B, T, V) float32 tensor is ever held.

Memory: each chunk of `chunk_tokens` tokens is upcast to float32 inside the chunk only (chunk *
V * 4 bytes, plus a few temporaries of that size). Backward does not keep the float32 chunks
either: `_ChunkedLogprobs` saves only the logits (alive anyway) and recomputes each chunk's
softmax in backward, writing its gradient into one preallocated tensor of the logits' dtype. This
is what torch.utils.checkpoint per chunk would do, minus its cost: there each chunk's slice
backward materialises a zero-filled full-size gradient that autograd then adds up (n_chunks full
(B, T, V) passes and two full gradients alive at once); here there is one, written in place.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch
from torch import Tensor

DEFAULT_CHUNK_TOKENS = 1024


@dataclass(frozen=True)
class SamplerSettings:
    """How the rollout engines sample, as far as the processes that recompute their logprobs need
    it: the distribution (temperature, top_k, top_p) the learner's logprobs are taken under, the
    group size (samples of one prompt) and the response budget (max_new_tokens, seq_sum_norm's
    default norm). The field names and values are rollout.sampling's (`of`)."""

    temperature: float = 1.0
    """softmax temperature the engines sample at"""
    top_k: int = -1
    """the engines sample among the k most likely tokens; -1 = off"""
    top_p: float = 1.0
    """nucleus filter of the engines; 1.0 = off"""
    n_samples_per_prompt: int = 4
    """samples of one prompt, contiguous in a batch (GRPO groups)"""
    max_new_tokens: int = 64
    """response length cap, in tokens"""

    @classmethod
    def of(cls, sampling) -> SamplerSettings:
        """These fields of a sampling config (rollout.config.SamplingConfig), unchanged."""
        return cls(**{f.name: getattr(sampling, f.name) for f in fields(cls)})


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log p(label) per position: logits (B, T, V), labels (B, T) -> (B, T).
    Holds a float32 copy of all the logits: the learner and the reference model use the chunked
    version below (the same numbers, a chunk of tokens at a time)."""
    logits = logits.float()
    return torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)


def filtered_logprobs(logits: Tensor, labels: Tensor, top_k: int = -1, top_p: float = 1.0) -> Tensor:
    """log p(label) under the distribution a sampler draws from after top-k / top-p filtering and
    renormalising (as vLLM's processed logprobs are); -inf for a label outside the kept set.
    logits (B, T, V) already divided by the temperature; top_k -1 and top_p 1 keep everything."""
    logits = logits.float()
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # keep the smallest set of most likely tokens whose mass reaches top_p (always the top one)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logprobs_from_logits(logits, labels)


def entropy_from_logits(logits: Tensor, mask: Tensor) -> Tensor:
    """Per-token entropy of the categorical distribution, (B, T, V) -> (B, T), 0 on padding."""
    logits = logits.float()
    logp = torch.log_softmax(logits, -1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(mask > 0, ent, 0.0)


def chunk_spans(B: int, T: int, chunk_tokens: int) -> Iterator[tuple[slice, slice]]:
    """(rows, positions) spans covering (B, T) with at most chunk_tokens tokens each: whole rows
    when a row fits, else one row at a time in slices of chunk_tokens. Slicing (B, T, V) logits by
    a span is a view (no copy), even when they are a non-contiguous [:, :-1] slice."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    if T <= chunk_tokens:
        rows = max(1, chunk_tokens // max(T, 1))
        for r in range(0, B, rows):
            yield slice(r, r + rows), slice(0, T)
    else:
        for r in range(B):
            for t in range(0, T, chunk_tokens):
                yield slice(r, r + 1), slice(t, t + chunk_tokens)


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """A float32 copy of a chunk's logits / temperature, ours to overwrite in place."""
    x = logits.to(torch.float32, copy=True)
    return x.div_(temperature) if temperature != 1.0 else x


def _chunk_logprobs(logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool):
    """float32 (log p(label) (b, t), entropy (b, t) or None, logsumexp (b, t)) of one chunk.

    gather - logsumexp, as logprobs_from_logits computes it, with or without
    the entropy (so a forward with the entropy metric gives the very numbers of one without); the
    entropy from the same log-softmax, x - lse in place. A full-vocabulary pass costs as much as a
    small model's layer on a CPU: one exp pass in the logsumexp, one for p."""
    x = _scaled(logits, temperature)
    lse = torch.logsumexp(x, -1)
    label_logp = x.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return label_logp, None, lse
    logp = x.sub_(lse.unsqueeze(-1))  # x is ours: log_softmax in place, then p, then p log p in p
    return label_logp, -logp.exp().mul_(logp).sum(-1), lse


def _chunk_grad(
    logits: Tensor, labels: Tensor, temperature: float, g_logp: Tensor | None, g_ent: Tensor | None, lse: Tensor
) -> Tensor:
    """d loss / d logits of one chunk, recomputed from the chunk (float32 (b, t, V)); `lse` is the
    forward's logsumexp. d log p(y) / dx = onehot(y) - p and, through log_softmax,
    d H / dx = -p (log p + H), with x = logits / temperature. Without an entropy gradient (the
    usual case) it is one exp pass, in place: p = exp(x - lse), then -g p + onehot g."""
    if g_ent is None and g_logp is not None:
        p = _scaled(logits, temperature).sub_(lse.unsqueeze(-1)).exp_()
        g = p.mul_(-g_logp.unsqueeze(-1))
        g.scatter_add_(-1, labels.unsqueeze(-1), g_logp.unsqueeze(-1))
        return g.div_(temperature) if temperature != 1.0 else g
    x = _scaled(logits, temperature)
    g = torch.zeros_like(x)
    if g_ent is not None:
        logp = torch.log_softmax(x, -1)
        p, g_out = logp.exp(), -g_ent.unsqueeze(-1)
        g_logp_ent = g_out * p + (g_out * logp) * p
        g = g_logp_ent - p * g_logp_ent.sum(-1, keepdim=True)
    if g_logp is not None:
        g_lse = -g_logp.unsqueeze(-1)
        g = g + g_lse * (x - torch.logsumexp(x, -1, keepdim=True)).exp()  # exact: this path is rare (entropy_coef != 0)
        g.scatter_add_(-1, labels.unsqueeze(-1), g_logp.unsqueeze(-1))
    return g / temperature


class _ChunkedLogprobs(torch.autograd.Function):
    """(logprobs, entropy) (B, T) of logits (B, T, V); backward recomputes each chunk."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_tokens, with_entropy, entropy_grad):
        B, T = labels.shape
        logprobs = logits.new_empty((B, T), dtype=torch.float32)
        entropy = logits.new_zeros((B, T), dtype=torch.float32)
        lse = logits.new_empty((B, T), dtype=torch.float32)
        for rows, pos in chunk_spans(B, T, chunk_tokens):
            lp, ent, lse[rows, pos] = _chunk_logprobs(logits[rows, pos], labels[rows, pos], temperature, with_entropy)
            logprobs[rows, pos] = lp
            if ent is not None:
                entropy[rows, pos] = ent
        # the logits are alive anyway: no extra memory; lse is (B, T), and saves backward an exp pass
        ctx.save_for_backward(logits, labels, lse)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: skipped
        ctx.temperature, ctx.chunk_tokens, ctx.entropy_grad = temperature, chunk_tokens, with_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)  # a metric only: it stays out of the graph
        return logprobs, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, labels, lse = ctx.saved_tensors
        g_ent = g_ent if ctx.entropy_grad else None
        grad = torch.empty_like(logits)  # the one full-size gradient, in the logits' dtype
        B, T = labels.shape
        for rows, pos in chunk_spans(B, T, ctx.chunk_tokens):
            grad[rows, pos] = _chunk_grad(
                logits[rows, pos],
                labels[rows, pos],
                ctx.temperature,
                None if g_logp is None else g_logp[rows, pos],
                None if g_ent is None else g_ent[rows, pos],
                lse[rows, pos],
            )
        return grad, None, None, None, None, None


def chunked_logprobs_entropy(
    logits: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    """(log p(label), entropy) per position, float32 (B, T), of softmax(logits / temperature).

    logits (B, T, V) in any dtype, labels (B, T). Differentiable w.r.t. logits through the
    logprobs; through the entropy only with entropy_grad (else it has no grad_fn: a metric).
    Padding positions get values like any other: mask them where they are used."""
    logprobs, entropy = _ChunkedLogprobs.apply(
        logits, labels, float(temperature), int(chunk_tokens), True, entropy_grad
    )
    return logprobs, entropy


def chunked_logprobs(
    logits: Tensor, labels: Tensor, temperature: float = 1.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> Tensor:
    """log p(label) per position, float32 (B, T), of softmax(logits / temperature); differentiable."""
    return _ChunkedLogprobs.apply(logits, labels, float(temperature), int(chunk_tokens), False, False)[0]


@torch.no_grad()
def map_chunks(
    fn, logits: Tensor, labels: Tensor, temperature: float = 1.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> Tensor:
    """fn(float32 logits / temperature (b, t, V), labels (b, t)) -> (b, t), chunk by chunk, no grad:
    for per-token quantities with their own math (e.g. top-k/top-p filtered logprobs)."""
    B, T = labels.shape
    out = logits.new_empty((B, T), dtype=torch.float32)
    for rows, pos in chunk_spans(B, T, chunk_tokens):
        out[rows, pos] = fn(logits[rows, pos].float() / temperature, labels[rows, pos])
    return out
