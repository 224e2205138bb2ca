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
    # (B,) the model's own text, stop string excluded: what text reward sources read. An episode's
    # (or an endpoint sample's) is its last model turn, never an observation's or a message's words
    response_text: list[str]
    # (B,) "stop" (EOS, stop string, or the environment ended it), "length" (the token budget ran
    # out: the model was cut, or no room was left for the next observation), "turns" (an episode
    # used its env.max_turns) or, until it is continued, "partial" (cut mid-sequence by a checkpoint:
    # partial_rows); only "length" counts as clipped
    finish_reason: list[str]
    skipped: list[tuple[int, str]] = field(default_factory=list)  # prompts with no samples, and why
    # the policy version (weight syncs the engine had received) at each sample's first and last
    # token; equal while an engine takes new weights only between calls (all modes but in_flight)
    version_first: list[int] = field(default_factory=list)  # (B,)
    version_last: list[int] = field(default_factory=list)  # (B,)
    # (B, ragged) the version that sampled each response token, from vLLM's spans (an episode's
    # observation tokens, an endpoint sample's message tokens: the version of the turn before)
    token_versions: list[list[int]] = field(default_factory=list)
    # multi-turn episodes (rollout/episodes.py); empty for single-turn samples
    action_mask: list[list[int]] = field(
        default_factory=list
    )  # (B, ragged) 1 = a model token, 0 = an observation token
    env_return: list[float | None] = field(
        default_factory=list
    )  # (B,) the environment's rewards summed; None: it failed
    turns: list[int] = field(default_factory=list)  # (B,) model turns played
    env_failure: list[str] = field(default_factory=list)  # (B,) "", "timeout" or "error"
    clipped_turns: list[int] = field(default_factory=list)  # (B,) model turns cut at max_new_tokens

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> list[int]:
        """Every token after the prompt (an episode's observations too): the tensors' widths."""
        return [len(r) for r in self.response_ids]

    @property
    def model_ids(self) -> list[list[int]]:
        """The tokens the model sampled (an episode's observation tokens left out): what every
        length, throughput and diversity metric counts."""
        if not self.action_mask:
            return self.response_ids
        return [[t for t, a in zip(r, m) if a] for r, m in zip(self.response_ids, self.action_mask)]

    @property
    def oldest_versions(self) -> list[int]:
        """Each sample's oldest token's version (its first, as versions only grow): what the staleness bound holds."""
        if not self.token_versions:
            return self.version_first
        return [min(v, default=f) for v, f in zip(self.token_versions, self.version_first)]

    def model_token_versions(self) -> list[int]:
        """The version of every model-sampled token of the batch (observation tokens left out)."""
        if not self.token_versions:
            return [v for v, n in zip(self.version_first, self.model_lengths) for _ in range(n)]
        masks = self.action_mask or [[1] * len(v) for v in self.token_versions]
        return [v for vs, m in zip(self.token_versions, masks) for v, a in zip(vs, m) if a]

    @property
    def model_lengths(self) -> list[int]:
        return [sum(m) for m in self.action_mask] if self.action_mask else self.response_lengths

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        """Join shards in order; each shard's prompt_index is already global."""
        out = RolloutBatch([], [], [], [], [], [], [])
        for b in batches:
            for name in SAMPLE_FIELDS + ("skipped",):
                getattr(out, name).extend(getattr(b, name))
        return out

    def select(self, rows: list[int]) -> RolloutBatch:
        """The samples at `rows`, in that order (the skipped-prompt list is not carried over)."""
        fields = {name: getattr(self, name) for name in SAMPLE_FIELDS}  # versions may be absent (built by hand)
        return RolloutBatch(**{name: [xs[i] for i in rows] if xs else [] for name, xs in fields.items()})

    def partial_rows(self) -> list[int]:
        """Samples cut mid-sequence (finish reason "partial": in_flight's checkpoints keep them), to continue."""
        return [i for i, f in enumerate(self.finish_reason) if f == "partial"]

    def continued(self, rows: list[int], more: RolloutBatch) -> RolloutBatch:
        """This batch with sample rows[k] continued by more's sample k: its tokens, logprobs and versions
        appended, its text, finish reason and last version replaced by the continuation's (whose text
        is the whole response's); a sample cut before its first token takes the continuation's first
        version too. Returns self."""
        if len(rows) != len(more):
            raise ValueError(f"{len(more)} continuations for {len(rows)} cut samples")
        for k, i in enumerate(rows):
            if not self.response_ids[i]:  # cut before its first token: the continuation is all of it
                self.version_first[i] = more.version_first[k]
            self.response_ids[i] = self.response_ids[i] + more.response_ids[k]
            self.logprobs[i] = self.logprobs[i] + more.logprobs[k]
            self.token_versions[i] = self.token_versions[i] + more.token_versions[k]
            self.response_text[i], self.finish_reason[i] = more.response_text[k], more.finish_reason[k]
            self.version_last[i] = more.version_last[k]
        return self

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


SAMPLE_FIELDS = (
    "prompt_index",
    "prompt_ids",
    "response_ids",
    "logprobs",
    "response_text",
    "finish_reason",
    "version_first",
    "version_last",
    "token_versions",
    "action_mask",
    "env_return",
    "turns",
    "env_failure",
    "clipped_turns",
)  # one entry per sample


def pack(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Model inputs for prompt + response, right-padded, for scoring the response tokens.

    Returns input_ids (B, L), attention_mask (B, L), position_ids (B, L) and response_mask (B, L-1),
    which marks the targets `input_ids[:, 1:]` that are response tokens (so it lines up with the
    logits `[:, :-1]`). Position ids are given explicitly: a forward pass that derives them from
    nothing would score left-padded or packed tokens at the wrong positions.
    """
    prompt_len = torch.tensor([len(p) for p in prompt_ids])
    lengths = prompt_len + torch.tensor([len(r) for r in response_ids], dtype=torch.long)
    B, L = len(lengths), int(lengths.max()) if len(lengths) else 1
    columns = torch.arange(L)
    attention_mask = (columns < lengths[:, None]).long()
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    # one tensor for all tokens, scattered in row-major order (a Python loop of B copies cost more than a
    # small model's forward)
    input_ids[attention_mask.bool()] = torch.tensor(
        [t for p, r in zip(prompt_ids, response_ids) for t in (*p, *r)], dtype=torch.long
    )
    target = columns[: max(L - 1, 1)] + 1  # response_mask[:, j] is about token j + 1
    response_mask = ((target >= prompt_len[:, None]) & (target < lengths[:, None])).float()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids, response_mask


def unpad(values: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """Rows of `values` where `mask` is set, as ragged lists (e.g. per-token logprobs of responses)."""
    flat = values[mask > 0].tolist()  # row-major: each row's values in order
    out, start = [], 0
    for n in (mask > 0).sum(-1).tolist():
        out.append(flat[start : start + n])
        start += n
    return out
