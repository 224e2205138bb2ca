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
