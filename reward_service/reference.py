"""The frozen reference policy: per-token logprobs of the sampled responses, for the KL term."""
from __future__ import annotations

import torch

from rollout.types import RolloutBatch, pack, unpad


def response_logprobs(model, input_ids, attention_mask, position_ids, response_mask, temperature: float) -> torch.Tensor:
    """(B, L-1) logprob of each next token under `model` at `temperature`; 0 off the response."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, :-1]
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) * response_mask


class ReferenceModel:
    def __init__(self, path: str, dtype: str = "float32", micro_batch_size: int = 16):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.micro_batch_size = micro_batch_size

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, temperature: float = 1.0) -> list[list[float]]:
        out: list[list[float]] = []
        for i in range(0, len(batch), self.micro_batch_size):
            sl = slice(i, i + self.micro_batch_size)
            inputs = pack(batch.prompt_ids[sl], batch.response_ids[sl], self.pad_id)
            out += unpad(response_logprobs(self.model, *inputs, temperature), inputs[-1])
        return out
