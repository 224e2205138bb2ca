"""`relay plan`: the memory each role needs, per device, before anything is launched.

Pure arithmetic on a model's shape (its config.json, or a small table of known architectures), counted as
the code allocates: ZeRO 0-3 with AdamW, HF eager layers, runtime/logprobs.py's chunks, vLLM's memory
fraction, async training's staged weights. tests/unit/orchestrator/test_plan.py checks it against real CPU steps."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config.load import ConfigError

GB = 1e9  # decimal, as GPUs are sold ("80 GB"); vLLM's kv_cache_space_gb is GiB and converted
SAFETY = 0.9  # fits = peak <= 90% of the device: allocator fragmentation, CUDA context, NCCL buffers
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# float32 [chunk, vocab] temporaries alive at once in runtime/logprobs.py (torch.profiler): forward with the entropy
# metric: chunk, p; backward: 1, in place (7 with an entropy gradient); no-grad: chunk, exp
CHUNK_TEMPS = {"backward": 2, "backward with entropy": 7, "no grad": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs of a model: its architecture and sizes."""

    arch: str  # gpt2 (LayerNorm, GELU MLP, biases, learned positions) or llama (RMSNorm, SwiGLU)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool  # LM head shares the embedding matrix
    positions: int = 0  # gpt2's learned position embeddings
    qkv_bias: bool = False  # Qwen2 has q/k/v biases

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# Known architectures (their config.json values), for model folders not on this machine.
KNOWN = [
    (("qwen2.5-0.5b",), ModelShape("llama", 24, 896, 14, 2, 4864, 151936, True, qkv_bias=True)),
    (
        ("llama-3.1-8b", "llama-3-8b", "llama3-8b", "llama-8b"),
        ModelShape("llama", 32, 4096, 32, 8, 14336, 128256, False),
    ),
    (("smollm2-135m",), ModelShape("llama", 30, 576, 9, 3, 1536, 49152, True)),
    (("tiny-addition-gpt", "tiny-longtail-gpt"), ModelShape("gpt2", 2, 128, 4, 4, 512, 80, True, positions=64)),
    (("tiny-calculator-gpt", "tiny-guess-gpt"), ModelShape("gpt2", 2, 128, 4, 4, 512, 80, True, positions=128)),
]


def shape_from_hf(c: dict) -> ModelShape:
    """A config.json's fields -> ModelShape (GPT-2 names or the Llama/Qwen/Mistral ones)."""
    # .get only for fields a foreign config.json may leave out (their HF defaults)
    if c.get("model_type") == "gpt2":
        h = c["n_embd"]
        return ModelShape(
            "gpt2",
            c["n_layer"],
            h,
            c["n_head"],
            c["n_head"],
            c.get("n_inner") or 4 * h,
            c["vocab_size"],
            c.get("tie_word_embeddings", True),
            positions=c["n_positions"],
        )
    heads = c["num_attention_heads"]
    return ModelShape(
        "llama",
        c["num_hidden_layers"],
        c["hidden_size"],
        heads,
        c.get("num_key_value_heads") or heads,
        c["intermediate_size"],
        c["vocab_size"],
        c.get("tie_word_embeddings", False),
        qkv_bias=c.get("model_type") == "qwen2",
    )


def find_shape(path: str, key: str, run_root: str) -> tuple[ModelShape, str]:
    """(shape, where it came from). builtin://NAME is looked up under run_root/models, never built."""
    from orchestrator.data.builtin_models import builtin_folder

    folder = builtin_folder(path, run_root)
    if (folder / "config.json").is_file():
        return shape_from_hf(json.loads((folder / "config.json").read_text())), f"{folder}/config.json"
    name = folder.name.lower()
    for names, shape in KNOWN:
        if any(n in name for n in names):
            return shape, f"built-in table ({names[0]}): {folder} is not on this machine"
    raise ConfigError(
        f"{key}: {path}: no config.json there and not a known architecture "
        f"({', '.join(n[0] for n, _ in KNOWN)}); plan on a machine that has the model folder"
    )


# ---------------------------------------------------------------- parameters
def layer_params(s: ModelShape) -> int:
    kv = s.kv_heads * s.head_dim
    attn = 2 * s.hidden * s.hidden + 2 * s.hidden * kv  # q, o and the (grouped) k, v projections
    if s.arch == "gpt2":  # c_attn/c_proj/c_fc/mlp.c_proj biases, two LayerNorms (weight + bias)
        return attn + 2 * s.hidden * s.intermediate + 3 * s.hidden + s.hidden + s.intermediate + s.hidden + 4 * s.hidden
    bias = s.hidden + 2 * kv if s.qkv_bias else 0
    return attn + bias + 3 * s.hidden * s.intermediate + 2 * s.hidden  # gate, up, down; two RMSNorms


def param_count(s: ModelShape, lm_head: bool = True) -> int:
    """All parameters; lm_head=False: the trunk only (a critic or a reward model, scalar head apart)."""
    embed = s.vocab * s.hidden + s.positions * s.hidden
    final_norm = 2 * s.hidden if s.arch == "gpt2" else s.hidden
    head = s.vocab * s.hidden if lm_head and not s.tied else 0
    return embed + s.layers * layer_params(s) + final_norm + head


def lora_params(s: ModelShape, rank: int, targets: list[str]) -> int:
    """Adapter parameters: rank x (in + out) per targeted linear, per layer (peft's A and B)."""
    kv = s.kv_heads * s.head_dim
    dims = {
        "q_proj": (s.hidden, s.hidden),
        "k_proj": (s.hidden, kv),
        "v_proj": (s.hidden, kv),
        "o_proj": (s.hidden, s.hidden),
        "gate_proj": (s.hidden, s.intermediate),
        "up_proj": (s.hidden, s.intermediate),
        "down_proj": (s.intermediate, s.hidden),
        "c_attn": (s.hidden, 3 * s.hidden),
        "c_proj": (s.hidden, s.hidden),
        "c_fc": (s.hidden, s.intermediate),
    }
    unknown = [t for t in targets if t not in dims]
    if unknown:
        raise ConfigError(f"learner.lora.target_modules: {unknown} not planned; known: {', '.join(dims)}")
    return s.layers * sum(rank * (dims[t][0] + dims[t][1]) for t in targets)


# ---------------------------------------------------------------- learner
def training_states(n_params: int, trainable: int, dtype: str, zero_stage: int, ranks: int) -> dict[str, float]:
    """Bytes per rank of float32 weights and gradients and AdamW's 2 moments (8 B/param), in either
    `dtype` (bfloat16 is autocast over float32 weights: it changes activations, not states). ZeRO
    shards over the ranks: 1 the optimizer state, 2 also gradients, 3 also weights."""
    b, optim = DTYPE_BYTES["float32"], 8 * trainable
    shard = lambda x, stage: x / ranks if zero_stage >= stage else x  # noqa: E731
    return {"weights": shard(n_params * b, 3), "gradients": shard(trainable * b, 2), "optimizer": shard(optim, 1)}


def activation_bytes(s: ModelShape, micro_batch: int, tokens: int, dtype: str, checkpointing: bool) -> float:
    """What autograd keeps for backward, per micro-batch, excluding the logits. Measured on HF's
    eager GPT-2 and Llama layers with SDPA (no tokens^2 scores): ~8 hidden-sized and ~5
    MLP-sized values per token per layer. Checkpointing keeps each layer's input and recomputes
    one layer at a time in backward."""
    per_layer = 8 * s.hidden + 5 * s.intermediate
    values = s.layers * s.hidden + per_layer if checkpointing else s.layers * per_layer
    return micro_batch * tokens * (values + 2 * s.hidden) * DTYPE_BYTES[dtype]  # + embeddings, final norm


def chunk_len(micro_batch: int, tokens: int, chunk_tokens: int) -> int:
    """Tokens in runtime.logprobs' largest chunk (chunk_spans): whole rows while a row fits."""
    return min(micro_batch, max(1, chunk_tokens // tokens)) * tokens if tokens <= chunk_tokens else chunk_tokens


def logits_bytes(s: ModelShape, micro_batch: int, tokens: int, dtype: str, chunk_tokens: int, temps: str):
    """(bytes, how): the model's own logits [micro_batch, tokens, vocab] in its dtype (the lm_head
    output), the one gradient of that shape and dtype backward writes (not for "no grad"), and
    CHUNK_TEMPS[temps] float32 [chunk, vocab] of the chunk being computed."""
    copies, chunk = (1 if temps == "no grad" else 2), chunk_len(micro_batch, tokens, chunk_tokens)
    full = f"{dtype} [{micro_batch}, {tokens}, {s.vocab}]" + " + its gradient" * (copies - 1)
    return (
        copies * micro_batch * tokens * s.vocab * DTYPE_BYTES[dtype] + CHUNK_TEMPS[temps] * chunk * s.vocab * 4,
        f"{full}, {CHUNK_TEMPS[temps]} float32 [{chunk}, {s.vocab}] per chunk (logprob_chunk_tokens {chunk_tokens})",
    )


# ---------------------------------------------------------------- rollout
def kv_bytes_per_token(s: ModelShape, dtype: str, tensor_parallel: int = 1) -> float:
    """K and V of every layer: 2 x layers x kv_heads x head_dim x bytes, kv heads split by TP."""
    return 2 * s.layers * s.kv_heads * s.head_dim * DTYPE_BYTES[dtype] / tensor_parallel


def vllm_gpu(s: ModelShape, dtype: str, tp: int, utilization: float, gpu_bytes: float) -> dict[str, float]:
    """vLLM takes utilization x the GPU; what the weights leave is KV cache (activations ignored)."""
    weights = param_count(s) * DTYPE_BYTES[dtype] / tp
    kv = utilization * gpu_bytes - weights
    return {"weights": weights, "kv_cache": kv, "kv_tokens": kv / kv_bytes_per_token(s, dtype, tp)}


# ---------------------------------------------------------------- roles
Lines = list[tuple[str, float, str]]  # (what, bytes, how it was counted)
RESIDENT = ("weights", "gradients", "optimizer")  # what a learner keeps between updates


def fmt(b: float) -> str:
    return f"{b / GB:.2f} GB" if b >= 0.1 * GB else f"{b / 1e6:.2f} MB"


def fmt_params(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


@dataclass
class RankLoad:
    """What each learner rank trains on: `ranks` of them share the states (ZeRO), each runs micro-batches of
    `micro_batch` sequences of `tokens` tokens."""

    ranks: int
    micro_batch: int
    tokens: int


def learner_lines(
    s: ModelShape,
    lc,
    load: RankLoad,
    who: str = "policy",
    lm_head: bool = True,
    scalar_head: bool = False,
    entropy_grad: bool = False,
) -> Lines:
    """One trained model on one learner rank: states, activations and (with an LM head) logits."""
    ranks, micro_batch, tokens = load.ranks, load.micro_batch, load.tokens
    n = param_count(s, lm_head) + (s.hidden + 1 if scalar_head else 0)
    trainable, how = n, f"ZeRO-{lc.zero_stage} over {ranks} rank(s), {lc.dtype.value}"
    if lc.lora.rank:  # the base stays frozen: gradients and AdamW state for the adapters (and heads) only
        adapters = lora_params(s, lc.lora.rank, list(lc.lora.target_modules))
        trainable, n = adapters + n - param_count(s, lm_head), n + adapters
        how += f", LoRA rank {lc.lora.rank}: {fmt_params(adapters)} of {fmt_params(n)} params trained"
    lines = [
        (f"{who} {k}", v, how) for k, v in training_states(n, trainable, lc.dtype.value, lc.zero_stage, ranks).items()
    ]
    if lc.zero_stage == 3:  # each layer's weights are gathered whole to compute it
        lines.append(
            (f"{who} gathered layer", layer_params(s) * DTYPE_BYTES["float32"], "ZeRO-3: one layer's full weights")
        )
    ckpt = lc.gradient_checkpointing
    other = activation_bytes(s, micro_batch, tokens, lc.dtype.value, not ckpt)
    lines.append(
        (
            f"{who} activations",
            activation_bytes(s, micro_batch, tokens, lc.dtype.value, ckpt),
            f"micro-batch {micro_batch} x {tokens} tokens, gradient checkpointing {'on' if ckpt else 'off'} "
            f"({'off' if ckpt else 'on'}: {fmt(other)})",
        )
    )
    if lm_head:  # the loss's logprobs (and entropy) come chunk by chunk: runtime/logprobs.py
        temps = "backward with entropy" if entropy_grad else "backward"
        lines.append(
            (f"{who} logits", *logits_bytes(s, micro_batch, tokens, lc.dtype.value, lc.logprob_chunk_tokens, temps))
        )
    return lines


def scoring_lines(
    ref: ModelShape, rms: list[ModelShape], micro_batch: int, tokens: int, dtype: str, chunk_tokens: int
) -> Lines:
    """The frozen scoring service in the learner's dtype: reference policy (float32 weights computed
    in `dtype`, as the policy's, runtime.device.compute), reward models, and the reference's logits
    (its peak: the layers' smaller temporaries are freed by then)."""
    b = DTYPE_BYTES[dtype]
    lines = [
        ("reference weights", param_count(ref) * DTYPE_BYTES["float32"], f"float32, computed in {dtype}"),
        ("reference logits", *logits_bytes(ref, micro_batch, tokens, dtype, chunk_tokens, "no grad")),
    ]
    lines += [
        (f"reward model {i} weights", (param_count(s, lm_head=False) + s.hidden + 1) * b, dtype)
        for i, s in enumerate(rms)
    ]
    return lines


def rollout_lines(s: ModelShape, rc, gpu_bytes: float | None) -> Lines:
    """One vLLM worker, per device: weights split by tensor parallelism, the rest KV cache."""
    tp, per_token = rc.tensor_parallel_size, kv_bytes_per_token(s, rc.dtype, rc.tensor_parallel_size)
    if gpu_bytes is None:  # CPU: the KV cache is a fixed size (VLLM_CPU_KVCACHE_SPACE)
        weights, kv, how = (
            param_count(s) * DTYPE_BYTES[rc.dtype] / tp,
            rc.kv_cache_space_gb * 2**30,
            "rollout.kv_cache_space_gb",
        )
    else:
        v = vllm_gpu(s, rc.dtype, tp, rc.gpu_memory_utilization, gpu_bytes)
        weights, kv, how = v["weights"], v["kv_cache"], f"{rc.gpu_memory_utilization} x GPU - weights"
    return [
        ("vLLM weights", weights, f"{rc.dtype}, tensor parallel {tp}"),
        (
            "vLLM KV cache",
            kv,
            f"{how}: {kv / per_token:,.0f} tokens at {per_token:,.0f} B/token (max_model_len {rc.max_model_len})",
        ),
    ]


def total(lines: Lines, only: tuple[str, ...] = ()) -> float:
    return sum(b for what, b, _ in lines if not only or what.split()[-1] in only)


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
    from reward_service.config import SourceKind

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
    if cfg.async_training.mode.value != "sync" and lc.zero_stage != 3:  # Learner.send_weights(background=True)
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
    ref = _shape(plan, cfg.reward.reference_model_path, "reward.reference_model_path", cfg.run_root, policy)
    rms = [
        _shape(plan, s.model_path, f"reward.sources[{i}].model_path", cfg.run_root, rm)
        for i, s in enumerate(cfg.reward.sources)
        if s.kind == SourceKind.reward_model
    ]
    rollout = rollout_lines(policy, rc, gpu_bytes if c.gpus_per_rollout_worker > 0 else None)
    scoring = scoring_lines(ref, rms, cfg.reward.micro_batch_size, tokens, lc.dtype.value, lc.logprob_chunk_tokens)
    scoring += _judge_lines(plan, cfg, gpu_bytes)
    plan.sections += [
        (f"learner rank (x{c.learner_ranks})", learner),
        (f"rollout worker (x{c.rollout_workers}, per device)", rollout),
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
            ("rollout", rollout, c.rollout_workers, c.gpus_per_rollout_worker, "worker(s)"),
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


# ---------------------------------------------------------------- the report
def load(path: str | Path, overrides: list[str]):
    """(kind, config): the root is told by the file's top-level sections, as `relay config show --for`."""
    import yaml

    from orchestrator.config.load import load_config
    from orchestrator.config.schema import PipelineConfig, StageConfig

    try:
        top = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        top = None  # load_config names the problem
    keys = set(top) if isinstance(top, dict) else set()
    if keys & {"sft", "rm", "ppo"}:
        return "pipeline", load_config(path, overrides, root=PipelineConfig)
    if keys & {"scratch", "train", "learner_ranks"}:
        kind = (
            "sft"
            if "scratch" in keys or not load_config(path, overrides, root=StageConfig).learner.model_path
            else "rm"
        )
        return kind, load_config(path, overrides, root=StageConfig)
    return "train", load_config(path, overrides)


def _machine_bytes() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def make_plan(kind: str, cfg, gpu_gb: float, host_gb: float | None) -> Plan:
    """host_gb None: this machine's memory when every role is on the host, else not judged."""
    c = cfg.ppo.cluster if kind == "pipeline" else (cfg.cluster if kind == "train" else None)
    on_gpu = c is not None and (c.gpus_per_learner > 0 or c.gpus_per_rollout_worker > 0 or c.gpus_per_scoring > 0)
    host = host_gb * GB if host_gb is not None else (None if on_gpu else _machine_bytes())
    if kind == "pipeline":
        return plan_pipeline(cfg, gpu_gb * GB, host)
    if kind == "train":
        return plan_train(cfg, gpu_gb * GB, host)
    return plan_stage(cfg, kind, host)


def render(plan: Plan, path, gpu_gb: float) -> str:
    out = [
        f"relay plan: {path} ({'fits' if plan.fits else 'DOES NOT FIT'}; {gpu_gb:g} GB GPUs, "
        f"a device fits when its peak <= {SAFETY:.0%} of it)",
        "models:",
    ]
    out += [f"  {m}" for m in plan.models]
    for role, lines in plan.sections:
        out.append(f"{role}:")
        out += [f"  {what:<26}{fmt(b):>12}  {how}" for what, b, how in lines]
        out.append(f"  {'total':<26}{fmt(total(lines)):>12}")
    out.append("devices (peak, limit):")
    for name, peak, limit in plan.devices:
        verdict = "not judged (give --host-memory-gb)" if limit is None else ("ok" if peak <= limit else "OVER")
        out.append(f"  {name:<58}{fmt(peak):>12}  / {'-' if limit is None else fmt(limit)}  {verdict}")
    out += [f"problem: {p}" for p in plan.problems]
    out.append(f"verdict: {'fits' if plan.fits else 'does not fit'}")
    return "\n".join(out) + "\n"
