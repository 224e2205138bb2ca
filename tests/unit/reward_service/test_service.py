"""The scoring service on real tiny models: reference logprobs, reward models, reasoning-gym (as a Ray
actor: tests/e2e/reward_service/test_service_actor.py)."""

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2ForSequenceClassification

from learner.tiny_gpt import char_tokenizer
from orchestrator.loop.step_metrics import batch_metrics
from reward_service.combine import run_source
from reward_service.config import Normalization, RewardConfig, RewardSource, SourceKind
from reward_service.reference import ReferenceModel
from reward_service.service import ScoringService
from reward_service.sources import REWARD_STATS_FILE, build_source
from rollout.types import RolloutBatch
from runtime.forward import PolicyFunction
from runtime.packing import plan_rows

tok = char_tokenizer()


def batch_of(pairs):
    """RolloutBatch from (prompt text, response text) pairs, one sample per prompt."""
    p = [tok(a, add_special_tokens=False).input_ids for a, _ in pairs]
    r = [tok(b, add_special_tokens=False).input_ids for _, b in pairs]
    return RolloutBatch(
        list(range(len(pairs))), p, r, [[0.0] * len(x) for x in r], [b for _, b in pairs], ["stop"] * len(pairs)
    )


PAIRS = [("12+34=", "46"), ("7*8=", "56 is the answer"), ("hello", "x"), ("a much longer prompt here:", "#### 5")]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_logprobs_equal_a_direct_transformers_computation(tiny_model, temperature):
    ref = ReferenceModel(tiny_model, micro_batch_size=3)  # 4 samples -> micro-batches of 3 and 1
    batch = batch_of(PAIRS)
    got = ref.logprobs(batch, temperature)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    for p, r, lp in zip(batch.prompt_ids, batch.response_ids, got):
        with torch.no_grad():  # one unpadded sequence at a time: nothing to get wrong
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1 : -1] / temperature
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        assert len(lp) == len(r)
        assert torch.allclose(torch.tensor(lp), want, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm") / "tiny-rm"
    cfg = GPT2Config(
        vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=1, n_head=2, num_labels=1, pad_token_id=tok.pad_token_id
    )
    torch.manual_seed(0)
    GPT2ForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("packing", [None, 0])  # padded rows, packed rows (runtime/packing.py): the same scores
def test_reward_model_scores_prompt_plus_response(reward_model, packing):
    rm = RewardSource(kind=SourceKind.reward_model, model_path=str(reward_model))
    source = build_source(rm, micro_batch_size=4, function=PolicyFunction(packing=packing))
    prompts, responses = [a for a, _ in PAIRS], [b for _, b in PAIRS]
    if packing is not None:  # some packed row holds two sequences
        lengths = [len(tok(p + r).input_ids) for p, r in zip(prompts, responses)]
        assert plan_rows(torch.tensor([[1] * n + [0] * (max(lengths) - n) for n in lengths])).rows < 4
    got = source.score(prompts, responses, [{}] * 4)
    model = GPT2ForSequenceClassification.from_pretrained(reward_model).eval()
    with torch.no_grad():
        want = [model(torch.tensor([tok(p + r).input_ids])).logits[0, 0].item() for p, r in zip(prompts, responses)]
    assert got == pytest.approx(want, abs=1e-5)
    # with the stats `relay rm` stores beside the model, scores come out normalised
    (reward_model / REWARD_STATS_FILE).write_text(json.dumps({"mean": 0.5, "std": 2.0}))
    normed = build_source(RewardSource(kind=SourceKind.reward_model, model_path=str(reward_model))).score(
        prompts, responses, [{}] * 4
    )
    assert normed == pytest.approx([(w - 0.5) / 2.0 for w in want], abs=1e-5)
    (reward_model / REWARD_STATS_FILE).unlink()


def test_reasoning_gym_source_uses_the_task_scorer():
    import reasoning_gym

    data = reasoning_gym.create_dataset("basic_arithmetic", size=2, seed=1)
    entries = list(data)
    source = build_source(RewardSource(kind=SourceKind.reasoning_gym))
    responses = [
        f"so <answer>{entries[0]['answer']}</answer>",
        "<answer>123456</answer>",
        "#### 1",
        f"The result is {entries[0]['answer']}",
    ]
    meta = [{"entry": entries[0]}, {"entry": entries[1]}, {}, {"entry": entries[0]}]
    run = run_source(source, ["q"] * 4, responses, meta, 5.0)
    # the task's own scorer on the answer in reasoning-gym's tags; none in tags scores what the task
    # gives no answer (0), never a number fished out of the text
    assert run.scores == [1.0, data.score_answer("123456", entries[1]), None, data.score_answer(None, entries[0])]
    assert run.scores[1] < 1.0 and run.scores[3] == 0.0


def test_evaluation_is_read_only_and_reports_raw_rewards(tiny_model):
    cfg = RewardConfig(
        sources=[RewardSource(kind=SourceKind.math_answer)], normalization=Normalization.running, clip=0.5
    )
    service = ScoringService(cfg, tiny_model)
    batch, meta = batch_of(PAIRS), [{"answer": "46"}, {"answer": "56"}, {}, {"answer": "5"}]
    service.score(batch, meta)  # training moves the running normaliser...
    state = json.dumps(service.state_dict())
    scored = service.evaluate(batch, meta, with_reference=False)
    assert json.dumps(service.state_dict()) == state  # ...evaluation never does
    # raw: neither clipped to 0.5 nor normalised; 0 (and flagged) where the sample cannot be judged
    assert scored.rewards == [1.0, 1.0, 0.0, 1.0] and scored.invalid == [False, False, True, False]
    assert scored.ref_logprobs == [[], [], [], []]  # no reference forward when nobody reads it
    assert service.evaluate(batch, meta).ref_logprobs == service.reference.logprobs(batch)


def test_the_services_state_holds_its_judges_caches_and_a_state_from_before_them_loads(tiny_model):
    from reward_service.judge import JudgeSource, digest

    cfg = RewardConfig(sources=[RewardSource(kind=SourceKind.math_answer)], normalization=Normalization.running)
    service = ScoringService(cfg, tiny_model)
    judge = JudgeSource(RewardSource(kind=SourceKind.judge, url="http://x"), backend=None)
    service.reward.sources["j"] = judge  # a judge beside the rule, as `kind: judge` builds it
    judge.cache[digest("q")] = 1.0
    state = json.loads(json.dumps(service.state_dict()))
    assert state["sources"] == {"": {"j": {"verdicts": [[digest("q"), 1.0]]}}}
    judge.cache.clear()
    service.load_state_dict(state)
    assert dict(judge.cache) == {digest("q"): 1.0}
    service.load_state_dict({"running": state["running"]})  # a checkpoint from before: the running state alone
    assert dict(judge.cache) == {digest("q"): 1.0}


def test_a_suite_with_its_own_sources_is_evaluated_by_them_and_the_rest_by_the_runs(tiny_model):
    cfg = RewardConfig(sources=[RewardSource(kind=SourceKind.math_answer)])
    own = [RewardSource(kind=SourceKind.exact_match, name="exact"), RewardSource(kind=SourceKind.format, pattern="6$")]
    service = ScoringService(cfg, tiny_model, suites={"strict": own})
    batch, meta = batch_of(PAIRS), [{"answer": "46"}, {"answer": "56"}, {}, {"answer": "5"}]
    run, strict = (
        service.evaluate(batch, meta, with_reference=False),
        service.evaluate(batch, meta, False, False, "strict"),
    )
    assert set(run.components) == {"math_answer"} and set(strict.components) == {"exact", "format"}
    assert strict.components["format"] == [1.0, 0.0, 0.0, 0.0] and strict.components["exact"][0] == 1.0
    assert service.evaluate(batch, meta, False, False, "no such suite").components.keys() == run.components.keys()


def same(a, b) -> bool:
    """Scored batches equal, NaN (an invalid sample's component) equal to NaN; their seconds
    (timing/reference) aside, which differ call to call."""

    def kept(scored):
        d = dataclasses.asdict(scored)
        d["metrics"] = {k: v for k, v in d["metrics"].items() if not k.startswith("timing/")}
        return json.dumps(d)

    return kept(a) == kept(b)


def test_judging_ahead_then_finishing_equals_scoring_the_batch_whole(tiny_model):
    """Asynchronous training judges a batch from its engines' parts as soon as they are generated and
    shapes it later (ScoringService.judge, .finish): the same rewards, reference logprobs and
    normaliser as scoring the whole batch in one call."""
    cfg = RewardConfig(sources=[RewardSource(kind=SourceKind.math_answer)], normalization=Normalization.running)
    whole, split = ScoringService(cfg, tiny_model), ScoringService(cfg, tiny_model)
    batch, meta = batch_of(PAIRS), [{"answer": "46"}, {"answer": "56"}, {}, {"answer": "5"}]
    first, second = batch.select([0, 1]), batch.select([2, 3])  # two engines' shards, global prompt indices
    for _ in range(2):  # the second call shapes with the normaliser the first moved
        want = whole.score(batch, meta)
        got = split.finish(split.judge(first, second, metadata=meta))
        assert same(got, want)
    assert split.state_dict() == whole.state_dict() and split.busy_seconds() > 0


def test_overlong_penalty_hand_example():
    from reward_service.shaping import overlong_penalty

    # max 10 tokens, buffer 4: free up to 6, then -1/4 per token, -1 from 10 on (DAPO, factor 1; here 0.5)
    assert overlong_penalty([3, 6, 7, 9, 10, 14], max_tokens=10, buffer=4) == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    assert overlong_penalty([8], 10, 4, factor=0.5) == [-0.25]


def test_episode_rewards_and_overlong_shaping_in_the_service(tiny_model):
    """The environment source scores each episode by its own return (None: the environment failed,
    invalid and counted); overlong shaping counts the model's tokens only, not observations."""
    cfg = RewardConfig(sources=[RewardSource(kind=SourceKind.environment)], overlong_buffer=2, overlong_max_tokens=4)
    service = ScoringService(cfg, tiny_model)
    batch = batch_of([("1+2=", "call 1+2\n3\n3"), ("1+2=", "3333"), ("1+2=", "33")])
    n = [len(r) for r in batch.response_ids]
    batch.action_mask = [[1] * 8 + [0] * 3 + [1], [1] * 4, [1] * n[2]]  # 9 model tokens; 4; 2
    batch.env_return, batch.env_failure, batch.turns = [1.0, 0.5, None], ["", "", "error"], [2, 1, 1]
    scored = service.score(batch, [{}] * 3)
    assert scored.components["environment"][:2] == [1.0, 0.5] and scored.invalid == [False, False, True]
    assert scored.components["overlong"] == [-1.0, -1.0, 0.0]  # 9 and 4 model tokens: at or past the limit
    assert scored.rewards == [0.0, -0.5, 0.0]
    assert batch_metrics(batch, scored)["reward/environment/invalid_frac"] == pytest.approx(1 / 3)


def test_a_reward_model_that_cannot_keep_packed_sequences_apart_scores_padded_rows(tmp_path):
    from transformers import OPTConfig, OPTForSequenceClassification

    path = tmp_path / "opt-rm"
    small = dict(vocab_size=len(tok), hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2)
    OPTForSequenceClassification(
        OPTConfig(**small, word_embed_proj_dim=32, num_labels=1, pad_token_id=0)
    ).save_pretrained(path)
    tok.save_pretrained(path)
    rm = RewardSource(kind=SourceKind.reward_model, model_path=str(path))
    padded = build_source(rm, micro_batch_size=4).score([a for a, _ in PAIRS], [b for _, b in PAIRS], [{}] * 4)
    source = build_source(rm, micro_batch_size=4, function=PolicyFunction(packing=0))
    assert source.packing is None  # OPT's mask ignores position ids: packed, each sequence would read the last
    assert source.score([a for a, _ in PAIRS], [b for _, b in PAIRS], [{}] * 4) == padded
