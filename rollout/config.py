"""Config section owned by rollout/: the vLLM engine and how it samples."""

from dataclasses import dataclass, field

from runtime.prompts import PromptOverflow


@dataclass
class SamplingConfig:
    """How the engines sample: temperature, filters, lengths, samples per prompt, stop strings, seed."""

    temperature: float = 1.0
    """softmax temperature, applied to the learner's logprobs too; must be > 0 for training (greedy is eval.greedy)"""
    top_k: int = -1
    """sample among the k most likely tokens; -1 = off"""
    top_p: float = 1.0
    """nucleus sampling: the smallest token set with this much probability; 1.0 = off"""
    repetition_penalty: float = 1.0
    """vLLM's penalty on tokens already in the prompt or response; 1.0 = off"""
    max_new_tokens: int = 64
    """response length cap, in tokens"""
    n_samples_per_prompt: int = 4
    """samples of one prompt come back contiguous (GRPO groups)"""
    stop: list[str] = field(default_factory=list)
    """stop strings, excluded from the response"""
    stop_token_ids: list[int] = field(default_factory=list)
    """extra stop ids beside the tokenizer's EOS"""
    seed: int | None = None
    """null: sampling follows the run seed (`seed`); an int overrides it for sampling alone"""


@dataclass
class EndpointConfig:
    """An OpenAI-compatible chat-completions server on the engines (rollout/gateway.py): an agent
    program pointed at it is trained on its own calls, each episode's calls recorded as token ids."""

    enabled: bool = False
    """serve the endpoint; the training batches are then its finished episodes, not data prompts"""
    host: str = "127.0.0.1"
    """interface to listen on ("0.0.0.0": every interface); beyond loopback the environment variable
    RELAY_ENDPOINT_KEY must hold a key, which every call sends as `Authorization: Bearer <key>` (a key set
    there is required on loopback too); never in the YAML, which the run folder, wandb and checkpoints keep"""
    port: int = 8000
    """0 = any free port (printed at start)"""
    batch_wait_ms: float = 10.0
    """requests arriving within this window go to an engine in one call"""
    wait_timeout_s: float = 600.0
    """a step waits at most this long for its finished episodes, then the run stops, saying how many came"""
    idle_timeout_s: float = 3600.0
    """an episode with no call and no reward for this long is dropped, counted (endpoint/abandoned_episodes)"""
    max_staleness: int = 1
    """versions a sample may train past its first call's; older: dropped (endpoint/dropped_stale)"""
    tool_parser: str = ""
    """vLLM's tool-call parser for the model's format ("hermes", "qwen3_xml", ...; its vllm/tool_parsers
    registry): a call's `tools` go into the chat template, its tool calls come back as `tool_calls`;
    "" = off (a call with `tools` is refused)"""
    reasoning_parser: str = ""
    """vLLM's reasoning parser ("qwen3", "deepseek_r1", ...; vllm/reasoning): the reasoning comes back
    as `reasoning_content`, apart from the content; "" = off"""
    chat_template: str = ""
    """a Jinja chat template file for the endpoint's calls, e.g. one that renders `tools` where the
    model's own does not; "" = the tokenizer's"""


@dataclass
class RolloutConfig:
    """The `rollout` section: the vLLM engines, their sampling, the agent endpoint and weight-sync buckets."""

    dtype: str = "float32"
    """the engine's weights and compute; must equal learner.dtype (weights are sent in it), or behaviour
    logprobs drift; auto = learner.dtype's choice at launch (vLLM's own "auto", the checkpoint's dtype,
    never reaches the engine)"""
    enforce_eager: bool = True
    """CPU: eager starts in ~13 s, compiled ~38 s; worth it only for larger models"""
    max_model_len: int = 512
    """vLLM context length in tokens; must hold max_prompt_tokens + max_new_tokens"""
    max_prompt_tokens: int = 256
    """longest prompt, in tokens; longer ones follow prompt_overflow"""
    prompt_overflow: PromptOverflow = PromptOverflow.truncate_left
    """a prompt over max_prompt_tokens: truncate_left, skip (counted) or error"""
    gpu_memory_utilization: float = 0.5
    """GPU only: fraction of the GPU's memory vLLM may take (weights + KV cache)"""
    tensor_parallel_size: int = 1
    """devices one engine is split over (on CPU: groups of cores)"""
    max_num_seqs: int = 0
    """sequences vLLM decodes at once; 0 = on CPU every sample of a step's share (vLLM's 256 splits a bigger one into
    waves), on GPU vLLM's default"""
    enable_prefix_caching: bool = True
    """reuse the KV of a prompt's shared prefix (the n samples of a group, a shared system prompt)"""
    kv_cache_space_gb: int = 1
    """CPU only: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)"""
    cpu_threads: int = 0
    """CPU only: threads per engine; 0 = the machine's cores split among the workers"""
    cpu_plain_linear: bool = True
    """CPU only: keep plain F.linear so reloaded weights take effect (see vllm_ext)"""
    sync_bucket_mb: int = 16
    """weight-sync bucket, MiB; small enough that loading bucket k overlaps receiving k+1"""
    sync_check: bool = True
    """after every weight sync, each engine's logprobs of a fixed probe must be the learner's (rollout/sync_check.py)"""
    sync_check_tolerance: float = 0.0
    """the largest probe logprob gap (nats) a sync may show; 0 = the dtype's (sync_check.TOLERANCE)"""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """how prompts are sampled (greedy evaluation keeps all but temperature and n)"""
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    """OpenAI-compatible endpoint for agent programs (off by default)"""
