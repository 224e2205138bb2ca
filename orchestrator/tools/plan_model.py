"""`relay plan`'s arithmetic on one model: its shape (config.json, or the small table of known architectures),
its parameters, and the bytes of each part (training states, activations, logits, vLLM's weights and KV cache)."""

from __future__ import annotations

import json
from dataclasses import dataclass

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
def training_states(
    n_params: int, trainable: int, dtype: str, zero_stage: int, ranks: int, master: bool = False
) -> dict[str, float]:
    """Bytes per rank of the trained model's states. ZeRO shards over the ranks: 1 the optimizer state (and
    masters), 2 also gradients, 3 also weights. Autocast (`dtype` float32 or bfloat16 over float32 weights: it
    changes activations, not states): float32 weights and gradients and AdamW's 2 moments (8 B/param). `master`
    (learner.precision master_weights): bf16 weights, float32 masters, AdamW's moments and the float32 gradient
    sums (backward's bf16 gradients pass through DeepSpeed's reduce bucket, as float32 ones do: not counted)."""
    b, optim = DTYPE_BYTES["float32"], 8 * trainable
    shard = lambda x, stage: x / ranks if zero_stage >= stage else x  # noqa: E731
    if not master:
        return {"weights": shard(n_params * b, 3), "gradients": shard(trainable * b, 2), "optimizer": shard(optim, 1)}
    half = DTYPE_BYTES["bfloat16"]
    return {
        "weights": shard(n_params * half, 3),
        "master weights": shard(trainable * b, 1),
        "gradients": shard(trainable * b, 2),
        "optimizer": shard(optim, 1),
    }


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


# ---------------------------------------------------------------- printed units
def fmt(b: float) -> str:
    return f"{b / GB:.2f} GB" if b >= 0.1 * GB else f"{b / 1e6:.2f} MB"


def fmt_params(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
