"""What rollout/ returns: one generated batch. Ragged lists on the wire, padded tensors on demand."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# A prompt as the data gives it: text, chat messages [{"role", "content"}], or token ids.
Prompt = str | list[dict] | list[int]


@dataclass
class RolloutBatch:
    """B samples; the n samples of one prompt are contiguous and share `prompt_index`."""

    prompt_index: list[int]  # (B,) index into the prompts of this step
    prompt_ids: list[list[int]]  # (B, ragged) the prompt tokens the engine saw (after truncation)
    response_ids: list[list[int]]  # (B, ragged) every sampled token, EOS and stop-string tokens included
    logprobs: list[list[float]]  # (B, ragged) behaviour logprob of each sampled token (engine's own)
    response_text: list[str]  # (B,) decoded, stop string excluded
    finish_reason: list[str]  # (B,) "stop" (EOS or stop string) or "length"
    skipped: list[tuple[int, str]] = field(default_factory=list)  # prompts with no samples, and why

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        """Join shards in order; each shard's prompt_index is already global."""
        out = RolloutBatch([], [], [], [], [], [], [])
        for b in batches:
            for name in ("prompt_index", "prompt_ids", "response_ids", "logprobs", "response_text",
                         "finish_reason", "skipped"):
                getattr(out, name).extend(getattr(b, name))
        return out

    def select(self, rows: list[int]) -> RolloutBatch:
        """The samples at `rows`, in that order (the skipped-prompt list is not carried over)."""
        pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
        return RolloutBatch(pick(self.prompt_index), pick(self.prompt_ids), pick(self.response_ids), pick(self.logprobs),
                            pick(self.response_text), pick(self.finish_reason))

    def padded(self, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded (response_ids (B, T) long, logprobs (B, T) float, mask (B, T) float)."""
        T = max(self.response_lengths, default=0)
        ids = torch.full((len(self), T), pad_id, dtype=torch.long)
        lps = torch.zeros(len(self), T)
        mask = torch.zeros(len(self), T)
        for i, (r, lp) in enumerate(zip(self.response_ids, self.logprobs)):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            lps[i, : len(lp)] = torch.tensor(lp)
            mask[i, : len(r)] = 1.0
        return ids, lps, mask


def pack(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Model inputs for prompt + response, right-padded, for scoring the response tokens.

    Returns input_ids (B, L), attention_mask (B, L), position_ids (B, L) and response_mask (B, L-1),
    which marks the targets `input_ids[:, 1:]` that are response tokens (so it lines up with the
    logits `[:, :-1]`). Position ids are given explicitly: a forward pass that derives them from
    nothing would score left-padded or packed tokens at the wrong positions.
    """
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    B, L = len(lengths), max(lengths, default=1)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, L, dtype=torch.long)
    response_mask = torch.zeros(B, max(L - 1, 1))
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[i, : lengths[i]] = torch.tensor(p + r, dtype=torch.long)
        attention_mask[i, : lengths[i]] = 1
        response_mask[i, len(p) - 1: len(p) - 1 + len(r)] = 1.0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids, response_mask


def unpad(values: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """Rows of `values` where `mask` is set, as ragged lists (e.g. per-token logprobs of responses)."""
    return [row[m > 0].tolist() for row, m in zip(values, mask)]
