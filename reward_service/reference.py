"""The frozen reference policy: per-token logprobs of the sampled responses, for the KL term."""

from __future__ import annotations

import dataclasses

import torch

from rollout.types import RolloutBatch, pack, unpad
from runtime.device import bf16_parameters, compute, to_device
from runtime.forward import PolicyFunction
from runtime.logprobs import DEFAULT_CHUNK_TOKENS, chunked_logprobs
from runtime.packing import decoder_and_head, packed_causal_lm, packing_for


def response_logprobs(
    model,
    inputs: tuple,
    temperature: float,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    packing: int | None = None,
    parts: tuple | None = None,
) -> torch.Tensor:
    """(B, L-1) logprob of each next token under `model` at `temperature`; 0 off the response. `inputs`:
    rollout.types.pack's (input_ids, attention_mask, position_ids, response_mask).
    The learner's own function (runtime/logprobs.py), chunk by chunk: the same numbers as the
    policy's old logprobs, and no float32 (B, L-1, V) tensor. `packing`: a packed row's token budget
    (runtime/packing.py), None = the padded rows as given; `parts`: decoder_and_head(model)."""
    input_ids, attention_mask, position_ids, response_mask = inputs
    if packing is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    else:
        logits, _, _ = packed_causal_lm(model, parts, (input_ids, attention_mask, position_ids), packing)
    return chunked_logprobs(logits[:, :-1], input_ids[:, 1:], temperature, chunk_tokens) * response_mask


class ReferenceModel:
    """The frozen reference policy on the scoring process's device: it owns the model and its
    tokenizer, and computes the sampled tokens' logprobs micro-batch by micro-batch."""

    def __init__(
        self,
        path: str,
        function: PolicyFunction = PolicyFunction(),
        micro_batch_size: int = 16,
        device: torch.device = torch.device("cpu"),
    ):
        """`function`: the learner's, applied as the learner does (dtype and weights: float32, bf16 autocast over
        float32 weights, or bf16 weights; packing; the attention kernel), so at step 0 the reference's logprobs
        are the policy's;
        `device`: the scoring process's (runtime.device)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device, self.function = device, function
        self.model = (
            AutoModelForCausalLM.from_pretrained(
                path, dtype=getattr(torch, function.weights), attn_implementation=function.attention
            )
            .eval()
            .to(device)
        )
        self.model.requires_grad_(False)
        if function.weights == "bfloat16":
            bf16_parameters(self.model)  # as the learner holds them (make_engine)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.micro_batch_size = micro_batch_size
        packing = packing_for(self.model, function.packing, "learner.packing (the reference)")
        self.function = dataclasses.replace(function, packing=packing)
        self.parts = decoder_and_head(self.model) if packing is not None else None

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, temperature: float = 1.0) -> list[list[float]]:
        out: list[list[float]] = []
        for i in range(0, len(batch), self.micro_batch_size):
            sl = slice(i, i + self.micro_batch_size)
            inputs = pack(batch.prompt_ids[sl], batch.response_ids[sl], self.pad_id)
            f = self.function
            with compute(f.dtype, self.device, f.weights):
                logprobs = response_logprobs(
                    self.model, to_device(inputs, self.device), temperature, f.chunk_tokens, f.packing, self.parts
                )
            out += unpad(logprobs.cpu(), inputs[-1])
        return out
