"""Issue 43, item 3: under LoRA the reference policy is the learner's own base, its adapter disabled
(learner.lora.reference learner): the same logprobs as the scoring service's copy of the base, and no copy of
it loaded there."""

import pytest
import torch

from learner.config import LearnerConfig
from learner.experience import ForwardSettings, old_outputs, reference_logprobs
from learner.lora_config import LoraConfig, LoraReference
from learner.models import build_policy
from learner.precision import policy_function
from orchestrator.config.load import ConfigError, load_config
from reward_service.config import RewardConfig, RewardSource, SourceKind
from reward_service.reference import ReferenceModel
from reward_service.service import ScoringService
from rollout.types import pack, unpad
from runtime.logprobs import SamplerSettings
from tests.helpers import REPO, make_scored_batch

DEFAULT = REPO / "configs" / "grpo_tiny_cpu.yaml"

TARGETS = {"tiny_model": ["c_attn"], "tiny_llama": ["q_proj", "v_proj", "o_proj"]}  # GPT-2's, Llama's


def trained_policy(model_path: str, targets: list[str], packing: bool):
    """A LoRA policy whose adapter has moved (peft starts B at 0, where the policy is its base)."""
    cfg = LearnerConfig(
        model_path=model_path, lora=LoraConfig(rank=4, alpha=8, target_modules=targets), packing=packing
    )
    policy = build_policy(cfg, value_head=False)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.lm.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    return cfg, policy


@pytest.mark.parametrize("model,packing", [("tiny_model", False), ("tiny_llama", True), ("tiny_llama", False)])
def test_the_learner_reference_is_the_scoring_services_copy_of_the_base(request, model, packing):
    path = request.getfixturevalue(model)
    cfg, policy = trained_policy(path, TARGETS[model], packing)
    batch, _ = make_scored_batch(path, n_prompts=3, group=3, seed=4)
    # the sampler's top-k filter, which the reference (as the scoring service's) does not apply
    run = ForwardSettings(
        SamplerSettings(temperature=0.7, top_k=5, n_samples_per_prompt=3), 0, micro=4, rank=0, world=1
    )
    mine = reference_logprobs(policy, policy.lm, batch, run)
    theirs = ReferenceModel(path, policy_function(cfg), micro_batch_size=5).logprobs(batch, 0.7)
    assert [len(r) for r in mine] == [len(r) for r in batch.response_ids]
    assert max(abs(a - b) for x, y in zip(mine, theirs) for a, b in zip(x, y)) < 1e-5

    packed = pack(batch.prompt_ids, batch.response_ids, 0)
    with_adapter = unpad(old_outputs(policy, None, packed[:3], run)[0] * packed[3], packed[3])
    gap = max(abs(a - b) for x, y in zip(with_adapter, theirs) for a, b in zip(x, y))
    assert gap > 0.05, "the example cannot tell the policy from its base"
    # and the adapter is on again after it
    again = unpad(old_outputs(policy, None, packed[:3], run)[0] * packed[3], packed[3])
    assert again == with_adapter


def test_the_scoring_service_loads_no_reference_when_the_learner_computes_it(tiny_model):
    cfg = RewardConfig(sources=[RewardSource(kind=SourceKind.math_answer)])
    batch, _ = make_scored_batch(tiny_model, n_prompts=2, group=2, seed=1)
    service = ScoringService(cfg, tiny_model, reference=False)
    assert service.reference is None
    assert service.reference_logprobs(batch) == [[] for _ in range(len(batch))]
    scored = service.evaluate(batch, [{"answer": "3"}] * 2, with_reference=True)
    assert scored.ref_logprobs == [[] for _ in range(len(batch))]  # the Evaluator asks the learner (test_evaluator)
    # it still reads the prompts' text, with the policy's tokenizer
    full = ScoringService(cfg, tiny_model)
    assert service.score(batch, [{"answer": "3"}] * 2).rewards == full.score(batch, [{"answer": "3"}] * 2).rewards
    assert full.reference_logprobs(batch) == ReferenceModel(tiny_model).logprobs(batch)


def test_where_the_reference_runs_follows_the_lora_section(tmp_path):
    assert LoraConfig(rank=4).reference_in_learner
    assert not LoraConfig(rank=4, reference=LoraReference.scoring).reference_in_learner
    assert not LoraConfig(rank=0).reference_in_learner  # no adapter: the scoring service's reference, as ever
    lora = ["learner.lora.rank=4", f"reward.reference_model_path={tmp_path}"]
    with pytest.raises(ConfigError, match="learner.lora.reference") as e:  # another model: not the base
        load_config(DEFAULT, lora)
    assert "set learner.lora.reference=scoring" in str(e.value)
    assert not load_config(DEFAULT, [*lora, "learner.lora.reference=scoring"]).learner.lora.reference_in_learner
    with pytest.raises(ConfigError, match="learner.lora.reference"):
        load_config(DEFAULT, ["learner.lora.rank=4", "learner.lora.reference=driver"])


def test_an_adapter_on_tied_embeddings_is_refused_naming_the_key(tiny_llama):
    """The tiny Llama ties lm_head to embed_tokens (as SmolLM2 does): one tensor, which an adapter on either
    would change for both, and which the merged sync sends once, under the embeddings' name."""
    for target in ("lm_head", "embed_tokens"):
        with pytest.raises(ValueError, match=r"learner.lora.target_modules: \['%s'\] of a model that ties" % target):
            build_policy(
                LearnerConfig(model_path=tiny_llama, lora=LoraConfig(rank=4, target_modules=["q_proj", target])), False
            )
    build_policy(LearnerConfig(model_path=tiny_llama, lora=LoraConfig(rank=4, target_modules=["q_proj"])), False)
