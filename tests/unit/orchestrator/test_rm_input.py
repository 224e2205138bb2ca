"""The reward model reads the same tokens in `relay rm` (encode_rm) and in the scoring service
(RewardModelSource), for text and chat prompts, with a BOS tokenizer and relay's char tokenizer."""

import json
from types import SimpleNamespace

import pytest
import torch
from bos_tokenizer import bos_tokenizer

from learner.config import LearnerConfig
from learner.supervised import SupervisedLearner
from learner.tiny_gpt import char_tokenizer, init_tiny_gpt
from orchestrator.config.schema import StageConfig
from orchestrator.stages.supervised import encode_rm
from reward_service.config import RewardSource, SourceKind
from reward_service.rm_input import rm_input_ids
from reward_service.sources import REWARD_STATS_FILE, RewardModelSource

CHAT = [{"role": "user", "content": "12+3="}]


def stage(tmp_path, chat: bool) -> StageConfig:
    cfg = StageConfig(name="s", run_root=str(tmp_path))
    cfg.data.apply_chat_template = chat
    cfg.train.max_length = 64
    return cfg


@pytest.fixture(scope="module", params=["bos", "char"])
def rm_dir(request, tmp_path_factory):
    """A randomly initialised one-output GPT-2 classifier, saved like a model `relay rm` wrote."""
    from transformers import AutoModelForSequenceClassification

    tokenizer = bos_tokenizer() if request.param == "bos" else char_tokenizer()
    path = init_tiny_gpt(tmp_path_factory.mktemp("rm") / request.param, n_layer=1, n_embd=32, tokenizer=tokenizer)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores that differ between inputs
    model.save_pretrained(path)
    return path


def service_inputs(source, prompts, responses, metadata) -> tuple[list[list[int]], list[float]]:
    """What the source fed its model (one sequence per sample, padding cut) and its scores."""
    seen, forward = [], source.model

    def record(input_ids, attention_mask):
        seen.extend(ids[: int(m.sum())].tolist() for ids, m in zip(input_ids, attention_mask))
        return forward(input_ids=input_ids, attention_mask=attention_mask)

    source.model = record
    try:
        scores = source.score(prompts, responses, metadata)
    finally:
        source.model = forward
    return seen, scores


def stage_rows(batch) -> list[list[int]]:
    return [ids[: int(m.sum())].tolist() for ids, m in zip(batch["chosen_ids"], batch["chosen_attention"])]


def test_hand_examples_one_bos_and_no_eos():
    bt = bos_tokenizer()
    text = rm_input_ids(bt, "1+2=", "3")
    assert text == [bt.bos_token_id] + bt("1+2=3", add_special_tokens=False).input_ids
    chat = rm_input_ids(bt, [{"role": "user", "content": "1+2="}], "3")
    assert bt.decode(chat) == "<s>user: 1+2=\nassistant: 3" and chat.count(bt.bos_token_id) == 1
    assert rm_input_ids(bt, bt("1+2=").input_ids, "3") == text  # token ids: decoded with their BOS, not doubled
    tok = char_tokenizer()
    assert rm_input_ids(tok, "1+1=", "2") == tok("1+1=2").input_ids == [4, 13, 4, 16, 5]  # as relay always scored


@pytest.mark.parametrize("chat_prompt", [False, True])
def test_stage_and_service_feed_the_rm_the_same_tokens(tmp_path, rm_dir, chat_prompt):
    source = RewardModelSource(RewardSource(kind=SourceKind.reward_model, model_path=str(rm_dir)), micro_batch_size=4)
    prompts = [CHAT, [{"role": "user", "content": "1+1="}]] if chat_prompt else ["12+3=", "1+1="]
    rows = [{"prompt": p, "chosen": c, "rejected": "0"} for p, c in zip(prompts, ["15", "2"])]
    batch, skipped = encode_rm(source.tokenizer, rows, stage(tmp_path, chat=False))
    decoded = ["never read", "never read"]  # the data's own prompt travels in metadata
    seen, _ = service_inputs(source, decoded, ["15", "2"], [{"prompt": p} for p in prompts])
    assert skipped == 0 and seen == stage_rows(batch)
    bos = source.tokenizer.bos_token_id
    assert all(s.count(bos) == (1 if source.tokenizer.bos_token == "<s>" else 0) for s in seen)


def test_chat_template_config_matches_what_the_trainer_passes(tmp_path, rm_dir):
    """`relay rm` with data.apply_chat_template wraps text as one user message; so does the
    trainer's `_prompt`, whose result `_meta` hands the service."""
    source = RewardModelSource(RewardSource(kind=SourceKind.reward_model, model_path=str(rm_dir)), micro_batch_size=4)
    batch, _ = encode_rm(
        source.tokenizer, [{"prompt": "12+3=", "chosen": "15", "rejected": "0"}], stage(tmp_path, True)
    )
    seen, _ = service_inputs(source, ["x"], ["15"], [{"prompt": CHAT}])
    assert seen == stage_rows(batch)


def test_without_the_data_prompt_the_service_scores_the_decoded_text(rm_dir):
    source = RewardModelSource(RewardSource(kind=SourceKind.reward_model, model_path=str(rm_dir)), micro_batch_size=4)
    tok = source.tokenizer
    prompt_ids = tok("12+3=").input_ids
    decoded = tok.decode(prompt_ids, skip_special_tokens=True)  # as ScoringService builds `prompts`
    seen, _ = service_inputs(source, [decoded, decoded], ["15", "15"], [{}, {"prompt": prompt_ids}])
    assert seen == [rm_input_ids(tok, "12+3=", "15")] * 2  # no data prompt, or the policy's token ids


def test_the_service_scores_what_the_stage_forward_computes(tmp_path, rm_dir):
    """The number: the service's RM source against SupervisedLearner._reward on encode_rm's batch,
    with the model loaded as the RM learner loads it; normalised by the stats file."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    (rm_dir / REWARD_STATS_FILE).write_text(json.dumps({"mean": 0.5, "std": 2.0}))
    try:
        source = RewardModelSource(
            RewardSource(kind=SourceKind.reward_model, model_path=str(rm_dir)), micro_batch_size=4
        )
    finally:
        (rm_dir / REWARD_STATS_FILE).unlink()
    tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(
        rm_dir, num_labels=1, pad_token_id=tok.pad_token_id
    ).eval()
    rows = [{"prompt": "12+3=", "chosen": "15", "rejected": "0"}, {"prompt": CHAT, "chosen": "1", "rejected": "0"}]
    batch, _ = encode_rm(tok, rows, stage(tmp_path, False))
    with torch.no_grad():
        cfg = LearnerConfig(model_path="unused")  # float32: what the stage trained in
        stage_rank = SimpleNamespace(engine=model, cfg=cfg, device=torch.device("cpu"))
        trained = SupervisedLearner._reward(stage_rank, batch["chosen_ids"], batch["chosen_attention"])
    scores = source.score(["x", "x"], ["15", "1"], [{"prompt": r["prompt"]} for r in rows])
    assert scores == pytest.approx(((trained - 0.5) / 2.0).tolist(), abs=1e-5)
    assert abs(scores[0] - scores[1]) > 1e-4  # the two inputs really differ
