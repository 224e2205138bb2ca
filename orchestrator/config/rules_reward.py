"""Rules for the reward section: each source's needs (a judge's in full), shaping and clipping."""

from __future__ import annotations

from reward_service.config import SourceKind


def check_rewards(reward):
    if not reward.sources:
        yield "reward.sources", "at least one reward source is needed"
    needs = {
        SourceKind.function: "function",
        SourceKind.reward_model: "model_path",
        SourceKind.remote: "url",
        SourceKind.format: "pattern",
        SourceKind.length_penalty: "target_length",
    }
    for i, src in enumerate(reward.sources):
        field = needs.get(src.kind)
        if field and not getattr(src, field):
            yield f"reward.sources.{i}.{field}", f"a {src.kind.value} source needs {field}"
        if src.kind == SourceKind.function and field and ":" not in src.function:
            yield f"reward.sources.{i}.function", f"expected 'module.path:function', got {src.function!r}"
        if src.kind == SourceKind.remote and src.timeout_s <= 0:
            yield f"reward.sources.{i}.timeout_s", "a remote reward needs a deadline > 0"
        if src.kind == SourceKind.judge:
            yield from _judge(src, f"reward.sources.{i}")
    if reward.max_unjudged_steps < 0:
        yield "reward.max_unjudged_steps", f"must be >= 0 (0 = never stop), got {reward.max_unjudged_steps}"
    if reward.overlong_buffer < 0:
        yield "reward.overlong_buffer", f"must be >= 0 (0 = off), got {reward.overlong_buffer}"
    if reward.overlong_buffer > 0 and not 0 < reward.overlong_buffer <= reward.overlong_max_tokens:
        yield (
            "reward.overlong_max_tokens",
            (
                f"overlong shaping needs overlong_max_tokens >= overlong_buffer "
                f"({reward.overlong_buffer}), got {reward.overlong_max_tokens}"
            ),
        )
    if reward.clip < 0:
        yield "reward.clip", f"must be >= 0 (0 = off), got {reward.clip}"


def _judge(src, key: str):
    if bool(src.model_path) == bool(src.url):
        yield key, "a judge needs model_path (a model folder run in the scoring service) or url (OpenAI-compatible)"
    if "{response}" not in src.template:
        yield f"{key}.template", "must hold {response} (and may hold {prompt} and {answer})"
    if src.verdict not in ("choice", "number", "probability"):
        yield f"{key}.verdict", f"must be choice, number or probability, got {src.verdict!r}"
    if src.verdict in ("choice", "probability") and not src.choices:
        yield f"{key}.choices", "a choice verdict needs its words and their scores, e.g. {yes: 1.0, no: 0.0}"
    if src.verdict == "number" and not (len(src.score_range) == 2 and src.score_range[0] < src.score_range[1]):
        yield f"{key}.score_range", f"must be [low, high] with low < high, got {list(src.score_range)}"
    if src.timeout_s <= 0:
        yield f"{key}.timeout_s", "a judge needs a deadline > 0"
    if src.judge_max_tokens < 1:
        yield f"{key}.judge_max_tokens", f"must be >= 1, got {src.judge_max_tokens}"
    if not 0 <= src.judge_min_choice_mass <= 1:
        yield f"{key}.judge_min_choice_mass", f"must be in [0, 1], got {src.judge_min_choice_mass}"
    if src.judge_engine not in ("vllm", "transformers"):
        yield f"{key}.judge_engine", f"must be vllm or transformers, got {src.judge_engine!r}"
    if src.model_path and src.judge_engine == "vllm":
        if src.judge_max_model_len and src.judge_max_model_len <= src.judge_max_tokens:
            yield (
                f"{key}.judge_max_model_len",
                "must be 0 (the model's) or exceed judge_max_tokens (room for the prompt)",
            )
        if src.judge_kv_cache_gb < 1:
            yield f"{key}.judge_kv_cache_gb", f"must be >= 1 (GiB), got {src.judge_kv_cache_gb}"
        if not 0 < src.judge_gpu_memory_utilization <= 1:
            yield f"{key}.judge_gpu_memory_utilization", f"must be in (0, 1], got {src.judge_gpu_memory_utilization}"
