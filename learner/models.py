"""The trainable models: the policy (a causal LM, optionally with a value head on its trunk), a
separate critic, LoRA, and the Hugging Face names the rollout engines load."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from learner.config import CriticInit, Dtype, LearnerConfig
from learner.lora_config import LoraConfig
from learner.precision import policy_function
from runtime.device import compute
from runtime.packing import decoder_and_head, packed_causal_lm, packed_forward, packing_for, real_share

VALUE_HEAD_FILE = "value_head.pt"


def no_dropout_config(path: str):
    """The model's config with every dropout set to 0: RL needs the forward that computes the
    importance ratio to be the same function as the one that computed the old logprobs."""
    cfg = AutoConfig.from_pretrained(path)
    for key, value in list(vars(cfg).items()):
        if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
            setattr(cfg, key, 0.0)
    return cfg


def hidden_size(cfg) -> int:
    return cfg.hidden_size if hasattr(cfg, "hidden_size") else cfg.n_embd


class PolicyValue(nn.Module):
    """forward -> (logits for the next tokens (B, L-1, V), values (B, L-1) or None), computed in
    `dtype` (runtime.device.compute), over padded rows or packed ones (`packing`: a row's token budget,
    runtime/packing.py; None = the padded rows as given). Either way the outputs are laid out as the padded
    rows: every loss reads the same tensors."""

    def __init__(
        self,
        lm: nn.Module,
        value_head: bool,
        dtype: Dtype = Dtype.float32,
        packing: int | None = None,
        weights="float32",
    ):
        super().__init__()
        self.lm, self.dtype, self.packing, self.weights = lm, dtype, packing_for(lm, packing), weights
        self._parts = decoder_and_head(lm) if self.packing is not None else None  # a tuple: no second registration
        self.tokens = (0, 0)  # (real, computed) tokens of the last forward: what it did, packed or not
        self.value_head = nn.Linear(hidden_size(lm.config), 1) if value_head else None
        if self.value_head is not None:
            nn.init.zeros_(self.value_head.weight), nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, position_ids):
        hidden, inputs = self.value_head is not None, (input_ids, attention_mask, position_ids)
        with compute(self.dtype, input_ids.device, self.weights):
            if self.packing is None:
                out = self.lm(**dict(zip(INPUTS, inputs)), output_hidden_states=hidden, use_cache=False)
                logits, states = out.logits, out.hidden_states[-1] if hidden else None
                self.tokens = real_share(attention_mask, packing=False)
            else:
                logits, states, plan = packed_causal_lm(self.lm, self._parts, inputs, self.packing, hidden)
                self.tokens = (plan.real, plan.computed)
        values = scalar_head(self.value_head, states[:, :-1]) if hidden else None
        return logits[:, :-1], values


class Critic(nn.Module):
    """A separate value model: a transformer trunk and a scalar head. forward -> values (B, L-1), padded
    or packed as PolicyValue."""

    def __init__(
        self,
        trunk: nn.Module,
        head: nn.Linear,
        dtype: Dtype = Dtype.float32,
        packing: int | None = None,
        weights="float32",
    ):
        super().__init__()
        self.trunk, self.head, self.dtype, self.packing = trunk, head, dtype, packing_for(trunk, packing)
        self.weights = weights

    def forward(self, input_ids, attention_mask, position_ids):
        inputs = (input_ids, attention_mask, position_ids)
        with compute(self.dtype, input_ids.device, self.weights):
            if self.packing is None:
                states = self.trunk(**dict(zip(INPUTS, inputs)), use_cache=False).last_hidden_state
            else:
                out, plan = packed_forward(self.trunk, *inputs, self.packing)
                states = plan.unpack(out.last_hidden_state)
        return scalar_head(self.head, states[:, :-1])


def scalar_head(linear: nn.Linear, states: torch.Tensor) -> torch.Tensor:
    """A scalar head's outputs (B, L), computed in float32 whatever the head's and the states' dtype: bf16 weights
    (learner.precision master_weights) would round values of ~10 by ~0.03, which GAE and the value loss read.
    The gradient still reaches the head's own parameters."""
    bias = None if linear.bias is None else linear.bias.float()
    return nn.functional.linear(states.float(), linear.weight.float(), bias).squeeze(-1)


INPUTS = ("input_ids", "attention_mask", "position_ids")


def packing(cfg: LearnerConfig) -> int | None:
    """The learner's forwards' packing (PolicyValue's `packing`): a row's token budget, None = padded rows."""
    return policy_function(cfg).packing


def load_model(load, cfg: LearnerConfig, *args, **kwargs) -> nn.Module:
    """load(*args) (a from_pretrained or from_config) with the learner's weight dtype (float32, or bf16 under
    master weights) and the attention kernel; a model without that kernel fails naming the key."""
    function = policy_function(cfg)
    attention, dtype = function.attention, getattr(torch, function.weights)
    try:
        return load(*args, dtype=dtype, attn_implementation=attention, **kwargs)
    except (ValueError, ImportError) as e:
        if attention not in str(e) and "attention" not in str(e).lower():
            raise
        raise ValueError(f"learner.attn_implementation={attention}: {e}") from e


def build_policy(cfg: LearnerConfig, value_head: bool) -> PolicyValue:
    lm = load_model(AutoModelForCausalLM.from_pretrained, cfg, cfg.model_path, config=no_dropout_config(cfg.model_path))
    if cfg.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora.rank > 0:
        lm = add_lora(lm, cfg.lora)
    return PolicyValue(lm, value_head, cfg.dtype, packing(cfg), policy_function(cfg).weights)


def add_lora(lm: nn.Module, lora: LoraConfig) -> nn.Module:
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model

    refuse_tied_targets(lm, list(lora.target_modules))

    return get_peft_model(
        lm,
        PeftLora(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            task_type="CAUSAL_LM",
        ),
    )


def refuse_tied_targets(lm: nn.Module, targets: list[str]) -> None:
    """A model that ties its input and output embeddings holds one tensor for both: an adapter on either would
    change the other (and the weights the engines load under each name), so such targets are refused."""
    embeddings, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    if head is None or head.weight is not embeddings.weight:
        return
    names = {n.rpartition(".")[2] for n, m in lm.named_modules() if m is embeddings or m is head}
    if tied := sorted(names & set(targets)):
        raise ValueError(
            f"learner.lora.target_modules: {tied} of a model that ties its input and output embeddings (one "
            f"tensor for {sorted(names)}): an adapter there would change both; leave them out"
        )


def build_critic(cfg: LearnerConfig) -> Critic:
    """Trunk and head from the policy, a reward model (its scalar `score` head too) or scratch."""
    path = cfg.critic_model_path if cfg.critic_init == CriticInit.reward_model else cfg.model_path
    config = no_dropout_config(path)
    if cfg.critic_init == CriticInit.scratch:
        trunk = load_model(AutoModel.from_config, cfg, config)
    else:
        trunk = load_model(AutoModel.from_pretrained, cfg, path, config=config)
    if cfg.gradient_checkpointing:
        trunk.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    head = nn.Linear(hidden_size(config), 1)
    nn.init.zeros_(head.weight), nn.init.zeros_(head.bias)
    if cfg.critic_init == CriticInit.reward_model:
        score = _reward_model_head(path)
        head.weight.data.copy_(score.reshape(1, -1)), head.bias.data.zero_()
    return Critic(trunk, head, cfg.dtype, packing(cfg), policy_function(cfg).weights)


def _reward_model_head(path: str) -> torch.Tensor:
    """The (1, hidden) `score` weight of a sequence-classification checkpoint."""
    from safetensors.torch import load_file

    for file in sorted(Path(path).glob("*.safetensors")):
        state = load_file(file)
        for name in ("score.weight", "classifier.weight"):
            if name in state:
                return state[name].float()
    raise ValueError(f"{path}: no score.weight in the reward model's safetensors")


def rollout_weights(policy: PolicyValue):
    """(name, parameter) pairs of the policy as a Hugging Face checkpoint names them: what vLLM loads.
    With LoRA, an adapted layer's entry is its frozen base weight (`merged_weights` adds the adapter);
    the adapters' own tensors are skipped."""
    lm = policy.lm
    prefix = "base_model.model." if hasattr(lm, "peft_config") else ""
    for name, param in lm.named_parameters():
        if "lora_" in name:
            continue
        yield name.removeprefix(prefix).replace(".base_layer.", "."), param


class merged_weights(Mapping):
    """The policy's weights as the engines load them, by Hugging Face name: the parameters themselves,
    except that under LoRA an adapted layer's weight is W + BA, computed out of place when read. The frozen
    base is never written: peft's merge_adapter/unmerge_adapter would round it a little at every sync
    (W + BA - BA != W in floating point), so the policy and a reference computed from it would drift."""

    def __init__(self, policy: PolicyValue):
        from peft.tuners.lora import LoraLayer

        self.params = dict(rollout_weights(policy))
        self.adapted = {  # peft's wrapped layers (none without LoRA), by their base weight's name
            f"{name.removeprefix('base_model.model.')}.weight": module
            for name, module in policy.lm.named_modules()
            if isinstance(module, LoraLayer)
        }

    @torch.no_grad()
    def __getitem__(self, name: str) -> torch.Tensor:
        weight = self.params[name]
        module = self.adapted.get(name)
        return weight if module is None else weight + module.get_delta_weight("default").to(weight.dtype)

    def __iter__(self):
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)
