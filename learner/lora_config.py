"""The learner section's LoRA sub-section (learner.lora): the adapters, what a weight sync sends, and
where the reference policy is computed."""

from dataclasses import dataclass, field
from enum import Enum


class LoraSync(str, Enum):
    """What a weight sync of a LoRA run sends the engines."""

    auto = "auto"  # resolved at launch (orchestrator/config/lora.py): adapter on GPU engines, merged on CPU ones
    adapter = "adapter"  # the adapter alone; vLLM serves it on the base weights (AsyncLLM.add_lora)
    merged = "merged"  # the base weights with the adapter merged in: for a model vLLM serves no LoRA for


class LoraReference(str, Enum):
    """Where a LoRA run computes the reference policy (the base model: what the policy is with its adapter off)."""

    learner = "learner"  # the learner's own base weights, the adapter disabled: no second copy of the base
    scoring = "scoring"  # the scoring service loads the base again, and computes it behind the generation


@dataclass
class LoraConfig:
    """LoRA adapters instead of full fine-tuning (peft); rank 0 = off."""

    rank: int = 0
    """LoRA adapter rank; 0 = no LoRA (full fine-tuning)"""
    alpha: float = 16.0
    """LoRA scaling: the adapters' update is scaled by alpha / rank"""
    dropout: float = 0.0
    """dropout on the adapters' input while training"""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """names of the modules that get adapters (peft target_modules)"""
    sync: LoraSync = LoraSync.auto
    """what each weight sync sends: the adapter alone (vLLM's LoRA), or the merged weights (a model vLLM
    serves no LoRA for, e.g. GPT-2); auto: the adapter on GPU engines, the merged weights on CPU engines (whose
    LoRA kernels generated 2.3x slower) and with in_flight"""
    reference: LoraReference = LoraReference.learner
    """where the reference policy's logprobs are computed: in the learner, with the adapter disabled (no
    second copy of the base weights), or by the scoring service from its own copy (its forward then overlaps
    the generation); a reward.reference_model_path other than the base needs scoring"""

    @property
    def reference_in_learner(self) -> bool:
        """The learner computes the reference: its own base, the adapter disabled (and the scoring service loads
        no copy of it)."""
        return self.rank > 0 and self.reference == LoraReference.learner
