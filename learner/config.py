"""Config sections owned by learner/: the RL algorithm and the trainable models."""

from dataclasses import dataclass, field
from enum import Enum

from learner.lora_config import LoraConfig


class Method(str, Enum):
    """A named recipe (algorithm.method): the keys its paper fixes, set together (orchestrator/config/methods.py)."""

    none = "none"  # no recipe: every key as given
    grpo = "grpo"  # GRPO (Shao et al. 2024): group mean and std, per-sequence token mean, KL (k3) in the loss
    dr_grpo = "dr_grpo"  # Dr. GRPO (Liu et al. 2025): group mean only, no std anywhere, token sums over a constant
    dapo = "dapo"  # DAPO (Yu et al. 2025): clip-higher 0.2/0.28, token mean, no KL, dynamic sampling
    gspo = "gspo"  # GSPO (Zheng et al. 2025): one clipped ratio per sequence (3e-4/4e-4), per-sequence mean
    cispo = "cispo"  # CISPO (MiniMax-M1 2025): clipped detached ratio weights, no lower bound, token mean
    reinforce_pp = "reinforce_pp"  # REINFORCE++ (Hu 2025): k1 KL per token in the reward, returns batch-whitened
    rloo = "rloo"  # RLOO (Ahmadian et al. 2024): leave-one-out, unnormalised, k1 KL in the sequence reward


class Estimator(str, Enum):
    """How advantages are estimated (algorithm.estimator); each has its function in algorithms.ESTIMATORS."""

    gae = "gae"  # PPO with a critic
    grpo = "grpo"  # group-normalised outcome reward, no critic
    rloo = "rloo"  # leave-one-out baseline, no critic
    reinforce_baseline = "reinforce_baseline"  # score minus a mean baseline (algorithm.reinforce_baseline.baseline)
    reinforce_pp = (
        "reinforce_pp"  # REINFORCE++: discounted token returns (KL per token if in the reward), whitened over the batch
    )


class Baseline(str, Enum):
    """Which mean reinforce_baseline subtracts (algorithm.reinforce_baseline.baseline)."""

    group = "group"  # the mean score of the prompt's other samples too (REINFORCE++-baseline)
    batch = "batch"  # the mean score of the whole batch (classic REINFORCE with a baseline)


class KLEstimator(str, Enum):
    """Schulman's per-token estimators of KL(policy || reference) (algorithms.kl_penalty)."""

    k1 = "k1"
    k2 = "k2"
    k3 = "k3"


class KLPlacement(str, Enum):
    """Where the KL penalty enters: the reward or the loss."""

    reward = "reward"  # -kl_coef * KL added to every token's reward (classic RLHF PPO)
    loss = "loss"  # kl_coef * KL added to the loss (GRPO)


class KLControllerKind(str, Enum):
    """How the KL coefficient moves (learner/kl_control.py)."""

    fixed = "fixed"
    adaptive = "adaptive"  # Ziegler et al. 2019: steer the coefficient towards target_kl


class LossAggregation(str, Enum):
    """How token losses are averaged into one (algorithms.aggregate)."""

    token_mean = "token_mean"  # every response token weighs the same (DAPO)
    seq_mean = "seq_mean"  # mean over tokens of each sequence, then over sequences (GRPO paper)
    seq_sum_norm = (
        "seq_sum_norm"  # sum over each sequence's tokens / loss_norm_tokens, then mean over sequences (Dr. GRPO)
    )


class PolicyLoss(str, Enum):
    """The policy loss (algorithm.policy_loss); each has its function in losses.POLICY_LOSSES."""

    ppo = "ppo"  # PPO's clipped surrogate on each token's ratio
    gspo = "gspo"  # GSPO: one ratio per sequence (geometric mean of its tokens'), clipped per sequence
    cispo = (
        "cispo"  # CISPO: REINFORCE with each token's ratio clipped as a detached weight; no token loses its gradient
    )


class OffPolicyKind(str, Enum):
    """The correction from the behaviour policy mu to the proximal policy (off_policy.OFF_POLICY_CORRECTIONS)."""

    auto = "auto"  # resolved at launch (orchestrator/config/correction.py): tis in an async mode, none in sync
    none = "none"  # plain PPO on the ratio to the proximal policy (the learner at the update's start)
    tis = "tis"  # truncated importance sampling: each token's loss times min(pi_prox/mu, cap)
    icepop = "icepop"  # IcePop: times pi_prox/mu inside [low, high], 0 outside
    decoupled = "decoupled"  # decoupled PPO (AReaL): times pi_prox/mu, tokens above cap masked


class RatioLevel(str, Enum):
    """At which level the ratio pi_prox/mu is taken (off_policy.behaviour_ratio)."""

    token = "token"  # each token's own ratio
    sequence = "sequence"  # the product of the sequence's token ratios, for all its tokens
    geometric = "geometric"  # their geometric mean, for all its tokens


@dataclass
class OffPolicyConfig:
    """Correction for samples drawn by a policy other than the learner's: engines some versions behind
    (async_training) and numerically apart (another kernel or dtype). mu = the engine's logprobs."""

    correction: OffPolicyKind = OffPolicyKind.auto
    """auto (tis in an asynchronous mode, none in sync), none, tis, icepop or decoupled (learner/off_policy.py)"""
    level: RatioLevel = RatioLevel.token
    """the ratio pi_prox/mu per token, per sequence (product) or geometric mean"""
    cap: float = 2.0
    """tis: weights truncated at this; decoupled: tokens whose ratio exceeds it are masked"""
    low: float = 0.5
    """icepop: ratios below this are masked"""
    high: float = 2.0
    """icepop: ratios above this are masked"""

    @property
    def kind(self) -> str:
        """The correction the learner applies (a key of off_policy.OFF_POLICY_CORRECTIONS, or "none"). auto is
        resolved at launch (orchestrator/config/correction.py); one left here is a learner outside a run (a
        bench, a test), which has no asynchronous mode: sync, uncorrected."""
        return "none" if self.correction == OffPolicyKind.auto else self.correction.value


@dataclass
class GAEConfig:
    """Options of the gae estimator (PPO with a critic) and of its value loss."""

    gamma: float = 1.0
    """discount per token; 1.0 = none"""
    lam: float = 0.95
    """GAE lambda; 0 = one-step TD, 1 = Monte Carlo returns"""
    whiten_rewards: bool = False
    """rescale token rewards to unit batch std around their (kept) mean before GAE"""
    value_clip_eps: float = 0.2
    """new values are clipped to old +- this; the larger of the two errors counts"""
    vf_coef: float = 0.5
    """weight of the value loss (shared head: added to the policy loss)"""


@dataclass
class GRPOConfig:
    """Options of the grpo estimator."""

    scale_by_std: bool = True
    """divide by the group's reward std; false = mean-centred only (Dr. GRPO)"""


@dataclass
class ReinforceBaselineConfig:
    """Options of the reinforce_baseline estimator."""

    baseline: Baseline = Baseline.group
    """which mean is subtracted: group or batch"""


@dataclass
class ReinforcePPConfig:
    """Options of the reinforce_pp estimator (REINFORCE++)."""

    gamma: float = 1.0
    """discount per token; 1.0 = none"""
    group_baseline: bool = False
    """subtract the group's mean score first (REINFORCE++-baseline)"""


@dataclass
class CISPOConfig:
    """Options of the cispo policy loss."""

    clip_low: float = 0.0
    """its weight is also bounded below by 1 - this; 0 = no lower bound (the paper's choice)"""


@dataclass
class AlgorithmConfig:
    """The RL algorithm: the estimator and its options (one sub-section per estimator), the policy loss,
    the KL penalty, the off-policy correction and the update's batching."""

    method: Method = Method.none
    """a recipe setting its paper's keys (orchestrator/config/methods.py); none = keys as given"""
    estimator: Estimator = Estimator.grpo
    """advantage estimator: gae (PPO with a critic), grpo, rloo, reinforce_baseline or reinforce_pp"""
    gae: GAEConfig = field(default_factory=GAEConfig)
    """estimator gae's options (discount, lambda, reward whitening) and its value loss's"""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """estimator grpo's options"""
    reinforce_baseline: ReinforceBaselineConfig = field(default_factory=ReinforceBaselineConfig)
    """estimator reinforce_baseline's options"""
    reinforce_pp: ReinforcePPConfig = field(default_factory=ReinforcePPConfig)
    """estimator reinforce_pp's options"""
    clip_eps: float = 0.2
    """PPO clip: ratio clipped to [1 - clip_eps, 1 + clip_eps] (upper bound: see clip_eps_high)"""
    clip_eps_high: float = 0.0
    """DAPO clip-higher: the ratio's upper clip is 1 + clip_eps_high; 0 = clip_eps"""
    policy_loss: PolicyLoss = PolicyLoss.ppo
    """ppo, gspo or cispo (see learner/losses.py); all use clip_eps / clip_eps_high"""
    cispo: CISPOConfig = field(default_factory=CISPOConfig)
    """policy loss cispo's options"""
    entropy_coef: float = 0.0
    """entropy bonus: coef * entropy is subtracted from the loss; 0 = off"""
    loss_aggregation: LossAggregation = LossAggregation.token_mean
    """how token losses are averaged: token_mean, seq_mean or seq_sum_norm"""
    loss_norm_tokens: int = 0
    """seq_sum_norm: a sequence's token sum / this; 0 = its token budget (episode, endpoint)"""
    kl_estimator: KLEstimator = KLEstimator.k3
    """per-token estimate of KL(policy || reference): k1, k2 or k3 (Schulman)"""
    kl_placement: KLPlacement = KLPlacement.loss
    """where the KL penalty goes: reward (per token) or loss"""
    kl_controller: KLControllerKind = KLControllerKind.fixed
    """fixed coefficient, or adaptive (steered towards target_kl)"""
    init_kl_coef: float = 0.01
    """KL penalty coefficient (the adaptive controller's start); 0 = no KL penalty"""
    target_kl: float = 6.0
    """adaptive controller only: KL per sequence (summed over a response's tokens, mean over samples), as in Ziegler et
    al. 2019 / TRL"""
    kl_horizon: int = 10000
    """adaptive controller only: samples over which the error is corrected"""
    normalize_advantages: bool = True
    """by the batch std: gae, reinforce_pp whitened; baselined estimators only divided"""
    max_skipped_updates: int = 3
    """stop the run after more than this many consecutive updates skipped as non-finite; 0 = never stop"""
    ppo_epochs: int = 1
    """passes over each step's batch"""
    mini_batch_size: int = 16
    """samples per optimizer step, all ranks together; must divide the step's samples"""
    micro_batch_size: int = 8
    """samples per forward/backward on one learner rank"""
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    """importance correction towards the behaviour policy"""

    @property
    def needs_critic(self) -> bool:
        """True when the estimator reads value estimates (gae): the one place that decides whether a
        run builds a critic (a value head or a separate model), computes old values and a value loss."""
        return self.estimator == Estimator.gae


# Keys that moved into a sub-section: old dotted key (under algorithm.) -> its new place.
MOVED_ALGORITHM_KEYS = {
    "gamma": "gae.gamma (or reinforce_pp.gamma)",
    "lam": "gae.lam",
    "whiten_rewards": "gae.whiten_rewards",
    "value_clip_eps": "gae.value_clip_eps",
    "vf_coef": "gae.vf_coef",
    "grpo_scale_by_std": "grpo.scale_by_std",
    "reinforce_pp_group_baseline": "reinforce_pp.group_baseline",
    "cispo_clip_low": "cispo.clip_low",
}
# Keys that were a value and are now a sub-section holding it.
MOVED_ALGORITHM_VALUES = {"reinforce_baseline": "reinforce_baseline.baseline"}


class ValueHead(str, Enum):
    """Where the critic lives when the estimator needs one (AlgorithmConfig.needs_critic)."""

    shared = "shared"  # scalar head on the policy trunk
    separate = "separate"  # its own critic model


class CriticInit(str, Enum):
    """What a separate critic starts from."""

    policy = "policy"
    reward_model = "reward_model"
    scratch = "scratch"


class Dtype(str, Enum):
    """The learner's compute dtype."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    auto = "auto"  # resolved at launch (orchestrator/config/dtype.py): no role ever runs in "auto"


class Precision(str, Enum):
    """How learner.dtype bfloat16 holds the trained weights (float32 runs hold float32 weights: autocast, no-op)."""

    auto = "auto"  # resolved at launch (orchestrator/config/dtype.py): master_weights on GPUs, autocast on CPUs
    autocast = "autocast"  # float32 weights, gradients and Adam state; matmuls in bf16 under torch.autocast
    master_weights = "master_weights"  # bf16 weights, activations and gradients; float32 masters and Adam state


class Attention(str, Enum):
    """The attention kernel of the learner's and the reference's forwards (transformers' attn_implementation)."""

    sdpa = "sdpa"  # torch's scaled_dot_product_attention: flash/memory-efficient kernels where the device has them
    eager = "eager"  # the model's own matmul-softmax-matmul
    flash_attention_2 = "flash_attention_2"  # the flash-attn package (CUDA): varlen over packed rows


class OptimizerKind(str, Enum):
    """Which AdamW implementation trains."""

    torch_adamw = "torch_adamw"  # no JIT compile; the default on CPU
    deepspeed_adam = "deepspeed_adam"  # DeepSpeed's fused (GPU) / CPU Adam


@dataclass
class LearnerConfig:
    """The learner section: the trained model (and a separate critic), its optimizer, precision and memory."""

    model_path: str = "???"
    """required: a local Hugging Face folder; relay train also takes builtin://NAME (see builtin_models.py)"""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage: 0 = plain data parallel, 1-2 shard optimizer state/grads, 3 also weights"""
    optimizer: OptimizerKind = OptimizerKind.torch_adamw
    """AdamW implementation"""
    lr: float = 1e-5
    """learning rate of the trained model (the policy)"""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas, two numbers in [0, 1)"""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay; 0 = off"""
    grad_clip: float = 1.0
    """max global gradient norm; 0 = no clipping"""
    warmup_steps: int = 0
    """optimizer steps of linear learning-rate warmup; 0 = full lr from the start"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, more compute"""
    dtype: Dtype = Dtype.float32
    """compute dtype; bfloat16 holds the weights as learner.precision says (2-4x faster matmuls on AVX512-BF16/AMX
    CPUs and GPUs; 50-100x slower on AVX2-only CPUs); auto = bfloat16 where the learner's device has native bf16,
    else float32, chosen once at launch on the driver and printed"""
    precision: Precision = Precision.auto
    """with dtype bfloat16: autocast (float32 weights, each weight cast for each matmul) or master_weights (bf16
    weights and activations, float32 master weights and Adam state in DeepSpeed's bf16 optimizer at ZeRO stage 2 or
    3, where DeepSpeed sums gradients in float32: a zero_stage 0 or 1 runs stage 2); auto = master_weights on GPUs,
    autocast on CPUs (bf16 weights measured no faster there, docs/benchmarks.md) and with LoRA, chosen at launch
    and printed"""
    packing: bool = True
    """padding-free packing of the RL forwards (update, old logprobs, critic, reference, reward models): each
    forward's sequences laid end to end in rows of at most packing_row_tokens tokens, attention kept inside each
    sequence (runtime/packing.py); false = right-padded rows. A model whose attention mask ignores position ids
    (OPT, Falcon, Bloom, MPT) is computed padded, said at start; relay sft and rm pad"""
    packing_row_tokens: int = 0
    """a packed row's token budget; 0 = the micro-batch's longest sequence (sdpa and eager pay each row's width
    squared in attention); under flash_attention_2 a micro-batch is always one row (its varlen kernel)"""
    attn_implementation: Attention = Attention.sdpa
    """attention kernel: sdpa, eager or flash_attention_2 (needs the flash-attn package, GPUs for the learner and
    the scoring service, and learner.dtype bfloat16); the reference model uses the same"""
    logprob_chunk_tokens: int = 1024
    """tokens whose logits are upcast to float32 at once for logprobs/entropy (each chunk holds tokens * vocab * 4
    bytes), forward and backward"""
    value_head: ValueHead = ValueHead.shared
    """ignored by critic-free estimators"""
    critic_init: CriticInit = CriticInit.policy
    """separate critic only: start from the policy, critic_model_path, or random"""
    critic_model_path: str = ""
    """needed when critic_init is reward_model"""
    critic_lr: float = 1e-5
    """learning rate of a separate critic (a shared head trains at lr)"""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (rank 0 = off)"""
    threads: int = 0
    """torch threads per rank; 0 = the machine's cores split among the ranks"""


@dataclass
class SupervisedTrainConfig:
    """How `relay sft` and `relay rm` train (the learner ranks receive this section)."""

    steps: int = 200
    """optimizer steps"""
    batch_size: int = 32
    """sequences (SFT) or preference pairs (RM) per optimizer step"""
    micro_batch_size: int = 32
    """per forward/backward on one rank"""
    max_length: int = 256
    """tokens; longer samples are skipped and counted"""
    eval_every: int = 50
    """steps between held-out evaluations (and at the end)"""
    margin: float = 0.0
    """RM only: -log sigmoid(r_chosen - r_rejected - margin)"""
