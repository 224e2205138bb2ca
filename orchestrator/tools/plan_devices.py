"""`relay plan` from a config: each role's lines (plan_roles.py) for a training run, an SFT/RM stage or a
pipeline, and each device's peak against its limit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orchestrator.tools.plan_model import (
    DTYPE_BYTES,
    KNOWN,
    SAFETY,
    ModelShape,
    find_shape,
    fmt_params,
    kv_bytes_per_token,
    param_count,
)
from orchestrator.tools.plan_roles import (
    RESIDENT,
    Lines,
    RankLoad,
    learner_lines,
    lora_engine_lines,
    rollout_lines,
    scoring_lines,
    total,
)


# ---------------------------------------------------------------- configs -> sections and devices
@dataclass
class Plan:
    """A memory plan: where each model's shape came from, each role's lines, and each device's peak."""

    models: list[str]  # where each model's shape came from
    sections: list[tuple[str, Lines]]  # (role, its lines)
    devices: list[tuple[str, float, float | None]]  # (device, peak bytes, limit bytes or None = not judged)
    problems: list[str]

    @property
    def fits(self) -> bool:
        return not self.problems and all(lim is None or peak <= lim for _, peak, lim in self.devices)


def _shape(plan: Plan, path: str, key: str, run_root: str, given: ModelShape | None = None) -> ModelShape:
    if not path and given is not None:  # pipeline stages: "" = the previous stage's model
        return given
    s, source = find_shape(path, key, run_root)
    plan.models.append(
        f"{key} = {path}: {s.arch}, {fmt_params(param_count(s))} params, {s.layers} layers, "
        f"hidden {s.hidden}, vocab {s.vocab} (from {source})"
    )
    return s


def _per_device(share: float) -> int:
    """Actors per device: a fractional GPU request packs 1/share of them on one device."""
    return max(1, round(1 / share)) if share < 1 else 1


def plan_train(cfg, gpu_bytes: float, host_bytes: float | None, policy=None, rm=None, plan=None) -> Plan:
    from learner.config import CriticInit, ValueHead
    from learner.precision import policy_function, zero_stage

    plan = plan or Plan([], [], [], [])
    c, rc, lc = cfg.cluster, cfg.rollout, cfg.learner
    policy = _shape(plan, lc.model_path, "learner.model_path", cfg.run_root, policy)
    tokens, mb = (
        rc.max_prompt_tokens + cfg.env.response_tokens(rc.sampling.max_new_tokens),
        cfg.algorithm.micro_batch_size,
    )
    has_critic = cfg.algorithm.needs_critic
    separate = has_critic and lc.value_head == ValueHead.separate
    load = RankLoad(c.learner_ranks, mb, tokens)
    learner = learner_lines(
        policy,
        lc,
        load,
        scalar_head=has_critic and not separate,
        entropy_grad=cfg.algorithm.entropy_coef != 0,
    )
    if cfg.async_training.mode.value != "sync" and zero_stage(lc) != 3:  # Learner.send_weights(background=True)
        learner.append(
            (
                "policy staged weights",
                param_count(policy) * DTYPE_BYTES[rc.dtype],
                f"async_training, rank 0: the copy in {rc.dtype} broadcast while the next update runs",
            )
        )
    if separate:  # the critic lives on the same rank, its own engine and AdamW
        critic = (
            _shape(plan, lc.critic_model_path, "learner.critic_model_path", cfg.run_root, rm)
            if lc.critic_init == CriticInit.reward_model
            else policy
        )
        learner += learner_lines(critic, lc, load, "critic", lm_head=False, scalar_head=True)
    rollout = _engine_lines(plan, policy, cfg, gpu_bytes)
    scoring = scoring_lines(
        *_scoring_models(plan, cfg, policy, rm), cfg.reward.micro_batch_size, tokens, policy_function(lc)
    )
    scoring += _judge_lines(plan, cfg, gpu_bytes)
    plan.sections += [
        (f"learner rank (x{c.learner_ranks})", learner),
        (f"rollout worker (x{c.rollout_workers}{', elastic' * c.elastic}, per device)", rollout),
        (
            f"scoring service ({'GPU' if c.gpus_per_scoring > 0 else 'host memory'}: "
            f"cluster.gpus_per_scoring {c.gpus_per_scoring:g})",
            scoring,
        ),
    ]
    if rollout[1][1] < rc.max_model_len * kv_bytes_per_token(policy, rc.dtype, rc.tensor_parallel_size):
        plan.problems.append(f"vLLM's KV cache cannot hold one rollout.max_model_len={rc.max_model_len} sequence")
    _train_devices(plan, c, learner, rollout, scoring, gpu_bytes, host_bytes)
    return plan


def _scoring_models(plan: Plan, cfg, policy, rm) -> tuple:
    """The scoring service's models: the reference's shape (None where the learner computes it: a LoRA policy's
    base, the adapter off) and each reward model's."""
    from reward_service.config import SourceKind

    ref = (
        None
        if cfg.learner.lora.reference_in_learner
        else _shape(plan, cfg.reward.reference_model_path, "reward.reference_model_path", cfg.run_root, policy)
    )
    rms = [
        _shape(plan, s.model_path, f"reward.sources[{i}].model_path", cfg.run_root, rm)
        for i, s in enumerate(cfg.reward.sources)
        if s.kind == SourceKind.reward_model
    ]
    return ref, rms


def _engine_lines(plan: Plan, policy, cfg, gpu_bytes: float | None) -> Lines:
    """One rollout engine: its weights and KV cache, and with an adapter sync its LoRA memory (on a GPU its slots
    come out of the KV cache's share, as vLLM allocates them first)."""
    lc, rc, gpu = cfg.learner, cfg.rollout, cfg.cluster.gpus_per_rollout_worker > 0
    lines = rollout_lines(policy, rc, gpu_bytes if gpu else None)
    if lc.lora.rank == 0 or lc.lora.sync.value != "adapter":
        return lines
    if policy.arch == "gpt2":
        plan.problems.append("learner.lora.sync adapter: vLLM serves no LoRA for GPT-2; set learner.lora.sync=merged")
    lora = lora_engine_lines(policy, lc, rc.dtype, rc.tensor_parallel_size)
    if gpu:
        what, kv, how = lines[1]
        lines[1] = (what, kv - lora[0][1], how + ", less the LoRA slots")
    return lines + lora


def _judge_lines(plan: Plan, cfg, gpu_bytes: float | None) -> Lines:
    """Each judge run in the scoring service (a model_path): its weights, in the learner's dtype, and on its own
    vLLM engine that engine's KV cache (CPU: judge_kv_cache_gb; GPU: its memory share less the weights)."""
    from reward_service.config import SourceKind

    dtype, lines = cfg.learner.dtype.value, []
    for i, s in enumerate(cfg.reward.sources):
        if s.kind != SourceKind.judge or not s.model_path:
            continue
        weights = param_count(_shape(plan, s.model_path, f"reward.sources[{i}].model_path", cfg.run_root))
        weights *= DTYPE_BYTES[dtype]
        lines.append((f"judge {i} weights", weights, f"{dtype}, {s.judge_engine}"))
        if s.judge_engine == "vllm" and cfg.cluster.gpus_per_scoring > 0 and gpu_bytes:
            kv = s.judge_gpu_memory_utilization * gpu_bytes - weights
            lines.append((f"judge {i} KV cache", kv, f"{s.judge_gpu_memory_utilization} x GPU - weights"))
        elif s.judge_engine == "vllm":
            lines.append((f"judge {i} KV cache", s.judge_kv_cache_gb * 2**30, "judge_kv_cache_gb"))
    return lines


def _train_devices(
    plan: Plan, c, learner: Lines, rollout: Lines, scoring: Lines, gpu_bytes: float, host_bytes: float | None
) -> None:
    learner_gpu, rollout_gpu, scoring_gpu = (
        c.gpus_per_learner > 0,
        c.gpus_per_rollout_worker > 0,
        c.gpus_per_scoring > 0,
    )
    gpu_limit, host, on_host = SAFETY * gpu_bytes, *((0.0, []) if scoring_gpu else (total(scoring), ["scoring"]))
    shared = c.colocate and scoring_gpu and (learner_gpu or rollout_gpu)  # scoring joins the roles' device
    own = scoring_gpu and not shared  # colocate: false gives it a bundle (and a GPU) of its own
    if c.colocate and learner_gpu and rollout_gpu:  # vLLM sleeps for the update: weights to host, KV freed
        awake, asleep = (
            (total(scoring), total(scoring, ("weights", "cache"))) if shared else (0.0, 0.0)
        )  # its logits: scoring only; a judge's own engine (weights, KV cache) never sleeps
        plan.devices += [
            (
                "GPU awake: vLLM + learner states" + " + scoring" * shared,
                total(rollout) + total(learner, RESIDENT) + awake,
                gpu_limit,
            ),
            ("GPU asleep: learner update" + " + scoring weights" * shared, total(learner) + asleep, gpu_limit),
        ]
    else:
        for role, lines, count, gpus, unit in (
            ("learner", learner, c.learner_ranks, c.gpus_per_learner, "rank(s)"),
            ("rollout", rollout, c.max_engines, c.gpus_per_rollout_worker, "worker(s)"),  # an elastic pool at its most
        ):
            if gpus > 0:
                n, extra = _per_device(gpus), total(scoring) if shared else 0.0
                plan.devices.append(
                    (f"{role} GPU ({n} {unit} each{' + scoring' * shared})", n * total(lines) + extra, gpu_limit)
                )
                shared = False  # on the first GPU role's device only
            else:
                host, on_host = host + count * total(lines), on_host + [f"{count} {role} {unit}"]
    if own:
        plan.devices.append(("scoring GPU (reference + reward models)", total(scoring), gpu_limit))
    if on_host:
        plan.devices.append((f"host: {' + '.join(on_host)}", host, None if host_bytes is None else SAFETY * host_bytes))


def scratch_shape(s) -> ModelShape:
    """The GPT-2 `relay sft` builds from the `scratch` section (char tokenizer: relay's 80 symbols)."""
    vocab = s.vocab_size if s.tokenizer == "bpe" else KNOWN[-1][1].vocab
    return ModelShape(
        "gpt2", s.n_layer, s.n_embd, s.n_head, s.n_head, 4 * s.n_embd, vocab, True, positions=s.n_positions
    )


def plan_stage(cfg, kind: str, host_bytes: float | None, model=None, plan=None) -> Plan:
    """`relay sft` / `relay rm`: learner ranks only, on the host (SupervisedGroup asks for no GPU)."""
    plan = plan or Plan([], [], [], [])
    path, scratch = cfg.learner.model_path, scratch_shape(cfg.scratch)
    if path and not (_inside(path, cfg.run_root) and not Path(path).exists()):
        model = _shape(plan, path, f"{kind} learner.model_path", cfg.run_root)
    elif model is None:  # built by `relay sft` (path ""), or a stage output not trained yet
        plan.models.append(
            f"{kind} learner.model_path = {path!r}: the `scratch` GPT-2 "
            f"({'what relay sft builds' if not path else 'not built yet: planned as the scratch shape'})"
        )
        model = scratch
    rm = kind == "rm"  # a scalar head, chosen and rejected in one forward
    lines = learner_lines(
        model,
        cfg.learner,
        RankLoad(cfg.learner_ranks, cfg.train.micro_batch_size * (2 if rm else 1), cfg.train.max_length),
        kind,
        lm_head=not rm,
        scalar_head=rm,
    )
    plan.sections.append((f"{kind} learner rank (x{cfg.learner_ranks})", lines))
    n = cfg.learner_ranks * total(lines)
    plan.devices.append(
        (f"host: {kind} {cfg.learner_ranks} learner rank(s)", n, None if host_bytes is None else SAFETY * host_bytes)
    )
    return plan


def _inside(path: str, root: str) -> bool:
    return Path(path).resolve().is_relative_to(Path(root).resolve())


def plan_pipeline(cfg, gpu_bytes: float, host_bytes: float | None) -> Plan:
    """SFT, then RM from the SFT model, then PPO with the SFT policy and the RM ("" paths)."""
    plan = plan_stage(cfg.sft, "sft", host_bytes)
    sft = scratch_shape(cfg.sft.scratch) if not cfg.sft.learner.model_path else None
    sft = sft or find_shape(cfg.sft.learner.model_path, "sft.learner.model_path", cfg.run_root)[0]
    plan_stage(cfg.rm, "rm", host_bytes, None if cfg.rm.learner.model_path else sft, plan)
    rm = _shape(plan, cfg.rm.learner.model_path, "rm.learner.model_path", cfg.run_root, sft)
    return plan_train(cfg.ppo, gpu_bytes, host_bytes, sft, rm, plan)
