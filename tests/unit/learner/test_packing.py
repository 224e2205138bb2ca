"""Padding-free packing (runtime/packing.py, learner.packing): the row plan on a hand example, and the packed
forward's logprobs, values, entropies, losses and gradients equal to the padded path's to 1e-5 in float32:
GPT-2 and Llama, the policy with a value head and a separate critic, every aggregation, an episode's masked
observation tokens, LoRA, and the reference model."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.config import AlgorithmConfig, LearnerConfig, LossAggregation
from learner.experience import ForwardSettings, make_experience
from learner.lora_config import LoraConfig
from learner.micro_batch_loss import LossSettings, policy_loss
from learner.models import PolicyValue, build_critic, build_policy
from reward_service.reference import ReferenceModel
from rollout.types import pack
from runtime.forward import PolicyFunction
from runtime.logprobs import SamplerSettings, chunked_logprobs_entropy
from runtime.packing import packed_forward, plan_rows, real_share
from tests.helpers import make_scored_batch

TOL = 1e-5


def same_gradients(g0: list, g1: list) -> bool:
    """Equal to TOL relative to each tensor's largest entry (float32 sums the tokens in another order)."""
    return len(g0) == len(g1) > 0 and all(
        float((a - b).abs().max()) <= TOL * max(1.0, float(a.abs().max())) for a, b in zip(g0, g1)
    )


def test_rows_are_filled_first_fit_by_decreasing_length_and_unpack_inverts_pack():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])  # lengths 3, 1, 2
    plan = plan_rows(mask)  # rows as long as the longest sequence (3): [seq 0], [seq 2, seq 1]
    assert (plan.rows, plan.width) == (2, 3)
    assert plan.source.tolist() == [0, 1, 2, 6, 7, 3]  # flat indices b * L + j of the padded batch
    ids, pos = plan.pack(
        torch.tensor([[5, 6, 7], [8, 0, 0], [9, 4, 0]]), torch.tensor([[0, 1, 2], [0, 0, 0], [0, 1, 1]])
    )
    assert ids.tolist() == [[5, 6, 7], [9, 4, 8]] and pos.tolist() == [[0, 1, 2], [0, 1, 0]]
    back = plan.unpack(ids.unsqueeze(-1).float()).squeeze(-1)
    assert back.tolist() == [[5, 6, 7], [8, 0, 0], [9, 4, 0]]  # padding comes back as 0
    one = plan_rows(mask, row_tokens=6)  # a budget for all: one row, no padding
    assert (one.rows, one.width, one.real, one.computed) == (1, 6, 6, 6)
    assert plan_rows(mask, row_tokens=2).width == 3  # never below the longest sequence
    assert real_share(mask, packing=False) == (6, 9) and real_share(mask, packing=True) == (6, 6)


def test_edges_an_empty_row_padding_slots_and_a_bad_budget():
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]])
    plan = plan_rows(mask)
    assert plan.real == 3 and plan.rows == 2 and plan.width == 2  # the empty row takes no slot
    ids, pos = plan.pack(torch.full((3, 4), 7), torch.arange(4).expand(3, 4) + 1)
    assert pos.tolist() == [[1, 2], [1, 0]]  # a packed row's padding: position 0 (a sequence of its own)
    assert plan_rows(torch.zeros(2, 3, dtype=torch.long)).real == 0
    with pytest.raises(ValueError, match="row_tokens"):
        plan_rows(mask, row_tokens=-1)
    with pytest.raises(ValueError, match="start at 0"):  # would merge with the sequence before it in a row
        packed_forward(None, torch.full((3, 4), 7), mask, torch.arange(4).expand(3, 4) + 1)


def forward_all(model, batch, split=True):
    """Per-token logprobs, entropies and values of `model` on the packed batch, and the gradients of their sum."""
    ids, attention, positions, mask = pack(batch.prompt_ids, batch.response_ids, 0)
    model.zero_grad()
    seen = []
    decoder = model.lm.get_decoder()  # the whole LM calls it; packed, the policy calls it alone, then the head
    hook = decoder.register_forward_pre_hook(
        lambda m, a, kw: seen.append((kw.get("input_ids") if "input_ids" in kw else a[0]).numel()), with_kwargs=True
    )
    logits, values = model(ids, attention, positions)
    hook.remove()
    assert seen == [real_share(attention, model.packing is not None)[1]]  # the tokens the model really computed
    assert model.packing is None or (model._parts is not None) == split  # split: no second copy of the logits
    assert plan_rows(attention).rows < len(ids)  # some rows do hold several sequences
    logprobs, entropy = chunked_logprobs_entropy(logits, ids[:, 1:], 1.0, 16, entropy_grad=True)
    total = (logprobs * mask).sum() + (entropy * mask).sum() + (0 if values is None else (values * mask).sum())
    total.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return logprobs * mask, entropy * mask, None if values is None else values * mask, grads


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("lora", [0, 4])
def test_packed_policy_with_a_value_head_gives_the_padded_numbers_and_gradients(tiny_model, tiny_llama, arch, lora):
    path = tiny_model if arch == "gpt2" else tiny_llama
    batch, _ = make_scored_batch(path, n_prompts=4, group=4, seed=5)  # ragged prompts and responses
    outs = []
    for packing in (False, True):
        torch.manual_seed(0)  # the same LoRA init both times
        cfg = LearnerConfig(model_path=path, packing=packing, lora=LoraConfig(rank=lora, target_modules=TARGETS[arch]))
        policy = build_policy(cfg, value_head=True)
        torch.nn.init.normal_(policy.value_head.weight)  # a head that reads the trunk (zero at init)
        outs.append(forward_all(policy, batch))
    (lp0, ent0, v0, g0), (lp1, ent1, v1, g1) = outs
    assert torch.allclose(lp0, lp1, atol=TOL) and torch.allclose(ent0, ent1, atol=TOL)
    assert torch.allclose(v0, v1, atol=TOL) and v0.abs().sum() > 0
    assert same_gradients(g0, g1)


TARGETS = {"gpt2": ["c_attn", "c_proj"], "llama": ["q_proj", "k_proj", "v_proj", "o_proj"]}


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_packed_critic_gives_the_padded_values(tiny_llama, kernel):
    batch, _ = make_scored_batch(tiny_llama, n_prompts=3, group=4, seed=6)
    ids, attention, positions, mask = pack(batch.prompt_ids, batch.response_ids, 0)
    values = []
    for packing in (False, True):
        critic = build_critic(LearnerConfig(model_path=tiny_llama, packing=packing, attn_implementation=kernel))
        assert critic.trunk.config._attn_implementation == kernel
        torch.manual_seed(0)
        torch.nn.init.normal_(critic.head.weight)  # the same head both times (zero at init)
        with torch.no_grad():
            values.append(critic(ids, attention, positions) * mask)
    assert torch.allclose(*values, atol=TOL) and values[0].abs().sum() > 0


@pytest.mark.parametrize("aggregation", list(LossAggregation))
def test_every_loss_and_its_gradients_match_for_each_aggregation_with_masked_observations(tiny_model, aggregation):
    batch, scored = make_scored_batch(tiny_model, n_prompts=4, group=4, seed=7)
    cfg = AlgorithmConfig(init_kl_coef=0.05, entropy_coef=0.01, kl_placement="loss", loss_aggregation=aggregation)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    runs = []
    for packing in (None, 0):
        policy = PolicyValue(lm, False, packing=packing)
        settings = ForwardSettings(SamplerSettings(n_samples_per_prompt=4), 0, 8, 0, 1)
        exp = make_experience(policy, None, batch, scored, cfg, 0.05, settings)
        exp.mask[:, 1::3] = 0  # an episode's observation tokens: holes in the response the losses skip
        mb = exp.rows(torch.arange(len(batch)))
        policy.zero_grad()
        logits, _ = policy(mb.input_ids, mb.attention_mask, mb.position_ids)
        how = LossSettings(1.0, 16, float(mb.mask.sum()), aggregation.value, norm_tokens=8)
        loss, terms = policy_loss(logits, mb, cfg, 0.05, how)
        loss.backward()
        runs.append((exp, loss, terms, [p.grad.clone() for p in policy.parameters()]))
    (e0, l0, t0, g0), (e1, l1, t1, g1) = runs
    assert torch.allclose(e0.old_logprobs, e1.old_logprobs, atol=TOL)
    assert torch.allclose(e0.advantages, e1.advantages, atol=TOL)
    assert abs(float(l0) - float(l1)) < TOL and float(l0) != 0
    for key in ("policy", "entropy", "kl", "clip_frac", "approx_kl"):
        assert abs(float(t0[key]) - float(t1[key])) < TOL, key
    assert same_gradients(g0, g1)


def test_the_packed_reference_gives_the_padded_logprobs(tiny_llama):
    batch, _ = make_scored_batch(tiny_llama, n_prompts=4, group=4, seed=8)
    padded = ReferenceModel(tiny_llama, PolicyFunction(), micro_batch_size=16).logprobs(batch)
    reference = ReferenceModel(tiny_llama, PolicyFunction(packing=0), micro_batch_size=16)
    assert reference.parts is not None  # the decoder on packed rows, the head on the padded layout
    packed = reference.logprobs(batch)
    assert [len(r) for r in padded] == [len(r) for r in packed]
    assert max(abs(a - b) for x, y in zip(padded, packed) for a, b in zip(x, y)) < TOL


def test_packing_efficiency_is_real_over_computed_tokens_over_the_whole_update():
    from learner.engine import COMPUTED, REAL, TOKENS, update_metrics

    # two mini-batches: 30 real tokens of 40 computed, then 10 of 10 -> 40 / 50, not the mean of the ratios
    out = update_metrics({REAL: 40.0, COMPUTED: 50.0, TOKENS: 20.0, "learner/entropy": 10.0}, 2)
    assert out["learner/packing_efficiency"] == 0.8 and out["learner/entropy"] == 0.5
    assert REAL not in out and COMPUTED not in out


def test_an_attention_kernel_the_model_lacks_fails_naming_the_key(tiny_model):
    cfg = LearnerConfig(model_path=tiny_model, attn_implementation="flash_attention_2")  # no flash-attn here
    with pytest.raises(ValueError, match="learner.attn_implementation=flash_attention_2"):
        build_policy(cfg, value_head=False)


def test_the_policy_functions_default_chunk_is_the_logprob_modules():
    from runtime.logprobs import DEFAULT_CHUNK_TOKENS

    assert PolicyFunction().chunk_tokens == DEFAULT_CHUNK_TOKENS == LearnerConfig().logprob_chunk_tokens


def test_a_model_that_scales_its_logits_after_the_head_is_packed_whole_with_the_same_numbers(tiny_model):
    from transformers import CohereConfig, CohereForCausalLM

    from runtime.packing import decoder_and_head

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    scaled = CohereForCausalLM(CohereConfig(**small, num_key_value_heads=2, logit_scale=0.0625, pad_token_id=0))
    assert decoder_and_head(scaled.eval()) is None  # logits = head(states) * logit_scale: not split
    batch, _ = make_scored_batch(tiny_model, n_prompts=3, group=4, seed=9)
    policy = build_policy(LearnerConfig(model_path=tiny_model), value_head=True)
    padded = forward_all(PolicyValue(policy.lm, True, packing=None), batch)
    whole = PolicyValue(policy.lm, True, packing=0)
    whole._parts, whole.value_head = None, policy.value_head  # as for such a model: the whole LM on packed rows
    packed = forward_all(whole, batch, split=False)
    assert all(torch.allclose(a, b, atol=TOL) for a, b in zip(padded[:3], packed[:3]))
    assert same_gradients(padded[3], packed[3])


def test_a_model_whose_mask_ignores_position_ids_is_not_packed(tiny_model, caplog):
    """OPT's attention mask is causal over the whole row whatever the position ids: packed, a sequence would
    attend to the one before it (0.13 off in logits), so relay computes its padded rows instead and says so."""
    from transformers import OPTConfig, OPTForCausalLM

    from runtime.packing import packs_apart

    opt = OPTForCausalLM(
        OPTConfig(
            vocab_size=64,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            word_embed_proj_dim=32,
            pad_token_id=0,
        )
    ).eval()
    assert not packs_apart(opt)
    with caplog.at_level("WARNING"):
        assert PolicyValue(opt, False, packing=0).packing is None
    assert "attend to each other" in caplog.text
    gpt = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert packs_apart(gpt) and PolicyValue(gpt, False, packing=0).packing == 0


def test_under_flash_attention_every_micro_batch_is_one_packed_row():
    """transformers' varlen flash path reads a batch of one row only: several rows would attend across
    sequences, so packed_forward puts a micro-batch in one row whatever the budget."""
    from types import SimpleNamespace

    from runtime.packing import packed_forward

    seen = []

    def model(input_ids, attention_mask, position_ids, use_cache):
        seen.append((tuple(input_ids.shape), position_ids.tolist(), attention_mask, use_cache))
        return "out"

    model.config = SimpleNamespace(_attn_implementation="flash_attention_2")
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    _, plan = packed_forward(model, torch.ones(3, 3, dtype=torch.long), mask, (mask.cumsum(-1) - 1).clamp(min=0))
    assert plan.rows == 1 and seen == [((1, 6), [[0, 1, 2, 0, 1, 0]], None, False)]


def test_a_soft_cap_on_the_logits_is_found_from_the_config_even_where_the_logits_are_tiny():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from runtime.packing import decoder_and_head

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    gemma = Gemma2ForCausalLM(Gemma2Config(**small, num_key_value_heads=1, head_dim=16, final_logit_softcapping=30.0))
    assert decoder_and_head(gemma.eval()) is None


def test_the_forward_reports_the_tokens_it_computed_padded_when_it_fell_back(tiny_model):
    """learner/packing_efficiency reads PolicyValue.tokens: what the forward did, not what the config asked."""
    from transformers import OPTConfig, OPTForCausalLM

    small = dict(vocab_size=80, hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2)
    opt = OPTForCausalLM(OPTConfig(**small, word_embed_proj_dim=32, pad_token_id=0)).eval()
    # lengths 3, 3 and 10: the two short ones share a packed row
    ids, attention, positions, _ = pack([[5, 6], [7, 8], [5, 6, 7, 8, 9, 10, 11, 12]], [[9], [10], [13, 14]], 0)
    fallen = PolicyValue(opt, False, packing=0)  # asked to pack, computes padded rows
    with torch.no_grad():
        fallen(ids, attention, positions)
    assert fallen.tokens == real_share(attention, packing=False) != real_share(attention, packing=True)
    packed = PolicyValue(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), False, packing=0)
    with torch.no_grad():
        packed(ids, attention, positions)
    assert packed.tokens == real_share(attention, packing=True)
