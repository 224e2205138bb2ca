"""Padding-free packing (verl's use_remove_padding, OpenRLHF's packing_samples, TRL's padding_free): the real
tokens of a micro-batch's padded rows laid end to end in fewer, fuller rows, position ids restarting at each
sequence, so a forward computes (almost) only real tokens.

transformers keeps attention inside each sequence from the position ids alone, when the attention mask is None:
masking_utils' find_packed_sequence_indices builds the block-diagonal causal mask for sdpa and eager, and
flash_attention_2 runs its varlen kernel. `PackPlan.unpack` puts every output back where the padded rows had it,
so each loss and metric reads the same (B, L) tensors either way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)
ONE_ROW = 2**62  # a row budget every micro-batch fits in: flash-attention's varlen path takes one packed row only
# config keys of models that transform their logits after the head (Gemma 2, Cohere, Granite, MiniCPM)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "scale_emb", "dim_model_base")


@dataclass(frozen=True)
class PackPlan:
    """Where each token of the padded (B, L) batch goes in the packed (rows, width) one: `source[k]` is the
    flat index (b * L + j) of the padded token at packed slot k (row-major), -1 for the packed rows' own padding."""

    source: torch.Tensor  # (rows * width,) long
    rows: int
    width: int
    batch: int
    length: int

    @property
    def real(self) -> int:
        return int((self.source >= 0).sum())

    @property
    def computed(self) -> int:
        return self.rows * self.width

    def pack(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        """(input_ids, position_ids) of the packed rows, (rows, width) each. A packed row's padding repeats the
        first packed token at position 0: each padding slot is a sequence of its own, attending to itself only,
        and its output is dropped (not the pad id: transformers warns of padding without an attention mask)."""
        real = (self.source >= 0).to(input_ids.device)
        src = self.source.clamp(min=0).to(input_ids.device)
        ids = torch.where(real, input_ids.reshape(-1)[src], input_ids.reshape(-1)[src[0]])
        pos = torch.where(real, position_ids.reshape(-1)[src], 0)
        return ids.view(self.rows, self.width), pos.view(self.rows, self.width)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(rows, width, *rest) -> (B, L, *rest), zero where the padded batch had padding (masked there by
        every reader). Differentiable: the backward gathers each token's gradient back to its packed slot."""
        rest = packed.shape[2:]
        flat = packed.reshape(self.rows * self.width, *rest)
        real = (self.source >= 0).to(packed.device)
        out = flat.new_zeros(self.batch * self.length, *rest)
        out.index_copy_(0, self.source.to(packed.device)[real], flat[real])
        return out.view(self.batch, self.length, *rest)


def plan_rows(attention_mask: torch.Tensor, row_tokens: int = 0) -> PackPlan:
    """Pack the sequences of `attention_mask` (B, L) (1 = a real token, any layout) into rows of at most
    max(row_tokens, the longest sequence) tokens, first-fit by decreasing length. row_tokens 0: rows as long
    as the longest sequence, so no row's attention costs more than a padded row's (sdpa and eager compute
    each row's whole width squared; flash varlen does not, and takes a larger budget)."""
    if row_tokens < 0:
        raise ValueError(f"packing row_tokens {row_tokens}: expected 0 (the longest sequence) or a token budget")
    batch, length = attention_mask.shape
    lengths = attention_mask.sum(-1).tolist()
    capacity = max([row_tokens, *lengths, 1])
    rows: list[list[int]] = []  # sequence indices per row
    room: list[int] = []
    for b in sorted(range(batch), key=lambda i: -lengths[i]):
        if lengths[b] == 0:
            continue
        fit = next((r for r, free in enumerate(room) if free >= lengths[b]), None)
        if fit is None:
            rows.append([]), room.append(capacity)
            fit = len(rows) - 1
        rows[fit].append(b)
        room[fit] -= lengths[b]
    width = max((capacity - free for free in room), default=1)
    source = torch.full((max(len(rows), 1), width), -1, dtype=torch.long)
    positions = [torch.nonzero(attention_mask[b], as_tuple=True)[0] + b * length for b in range(batch)]
    for r, members in enumerate(rows):
        flat = torch.cat([positions[b] for b in members])
        source[r, : len(flat)] = flat
    return PackPlan(source.reshape(-1), source.shape[0], width, batch, length)


def real_share(attention_mask: torch.Tensor, packing: bool, row_tokens: int = 0) -> tuple[int, int]:
    """(real tokens, computed tokens) of one forward over `attention_mask`'s rows: B x L padded, or the
    packed rows (learner/packing_efficiency is their ratio, summed over an update's micro-batches)."""
    real = int(attention_mask.sum())
    if not packing:
        return real, attention_mask.numel()
    return real, plan_rows(attention_mask, row_tokens).computed


def packed_forward(model, input_ids, attention_mask, position_ids, row_tokens: int = 0, **kwargs):
    """`model`'s outputs over the padded rows, computed packed: (outputs over the packed rows, the plan that
    unpacks them). kwargs go to the model (output_hidden_states). No KV cache: transformers reads packed
    sequences from the position ids only without one (with one, attention would cross sequences)."""
    first = position_ids.gather(1, attention_mask.argmax(-1, keepdim=True))[attention_mask.any(-1)]
    if (first != 0).any():  # a sequence starting at p + 1 after one ending at p would read as one sequence
        raise ValueError(f"packing needs each sequence's positions to start at 0, got {first.tolist()[:8]}")
    if flash(model):  # transformers runs the varlen kernel for a batch of one row; several would attend across
        row_tokens = ONE_ROW
    plan = plan_rows(attention_mask, row_tokens)
    ids, pos = plan.pack(input_ids, position_ids)
    return model(input_ids=ids, attention_mask=None, position_ids=pos, **(kwargs | {"use_cache": False})), plan


def flash(model) -> bool:
    return str(getattr(model.config, "_attn_implementation", "")).startswith("flash")


def packs_apart(model) -> bool:
    """Whether `model` keeps packed sequences apart: a sequence's outputs in a packed row do not change with the
    sequence before it. Not so where the model's attention mask ignores position ids (OPT, Falcon, Bloom and MPT
    in transformers 5.19): packed, each sequence would attend to the ones before it in its row. Checked on two
    rows that differ only in their first sequence (the same shapes and kernels: equal to the bit when apart)."""
    if flash(model):  # the varlen kernel splits the row by its position ids (and runs on a GPU only)
        return True
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    ids = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 6, 7]], device=device) % vocab  # then [6, 7] in both
    pos = torch.tensor([[0, 1, 2, 0, 1]] * 2, device=device)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=None, position_ids=pos, use_cache=False)
    last = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    return torch.allclose(last[0, 3:].float(), last[1, 3:].float(), rtol=1e-5, atol=1e-6)


def packing_for(model, row_tokens: int | None, key: str = "learner.packing") -> int | None:
    """row_tokens, or None (padded rows, said once) for a model that would not keep packed sequences apart."""
    if row_tokens is None or packs_apart(model):
        return row_tokens
    log.warning("%s: %s lets packed sequences attend to each other: padded rows", key, type(model).__name__)
    return None


def decoder_and_head(lm) -> tuple | None:
    """(decoder, lm_head) of a causal LM whose logits are exactly lm_head(decoder(...).last_hidden_state), checked
    on a few tokens; None for one that transforms them after its head (Gemma's soft-capping, a logit scale).
    Packed, the decoder runs on the packed rows and the head on its states laid back out as the padded rows: no
    second copy of the logits, the largest tensor of a forward (vocabulary-sized per token)."""
    config = lm.config.get_text_config()
    if any(getattr(config, k, None) not in (None, 1, 1.0) for k in LOGIT_TRANSFORMS):  # a cap on tiny logits is x
        return None
    try:
        decoder, head = lm.get_decoder(), lm.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if decoder is None or head is None:
        return None
    device = next(lm.parameters()).device
    ids = torch.arange(1, 5, device=device).view(1, -1) % lm.config.get_text_config().vocab_size
    with torch.no_grad():
        whole = lm(input_ids=ids, use_cache=False).logits
        split = head(decoder(input_ids=ids, use_cache=False).last_hidden_state)
    return (decoder, head) if torch.allclose(whole, split, rtol=1e-5, atol=1e-5) else None


def packed_causal_lm(lm, parts: tuple | None, inputs: tuple, row_tokens: int, hidden: bool = False):
    """(logits (B, L, V), the last hidden states (B, L, H) or None, the plan) of a causal LM over the padded rows
    `inputs` (input_ids, attention_mask, position_ids), computed packed. parts: decoder_and_head(lm), or None: the
    whole model on the packed rows, its logits unpacked (one more logits-sized tensor while both exist)."""
    if parts is None:
        out, plan = packed_forward(lm, *inputs, row_tokens, output_hidden_states=hidden)
        return plan.unpack(out.logits), plan.unpack(out.hidden_states[-1]) if hidden else None, plan
    decoder, head = parts
    out, plan = packed_forward(decoder, *inputs, row_tokens)
    states = plan.unpack(out.last_hidden_state)
    return head(states), states if hidden else None, plan
