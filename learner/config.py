"""Config sections owned by learner/: the RL algorithm and the trainable models."""
from dataclasses import dataclass, field
from enum import Enum


class Estimator(str, Enum):
    gae = "gae"  # PPO with a critic
    grpo = "grpo"  # group-normalised outcome reward, no critic
    rloo = "rloo"  # leave-one-out baseline, no critic
    reinforce_baseline = "reinforce_baseline"  # batch-mean baseline, no critic


class KLEstimator(str, Enum):
    k1 = "k1"
    k2 = "k2"
    k3 = "k3"


class KLPlacement(str, Enum):
    reward = "reward"  # -kl_coef * KL added to every token's reward (classic RLHF PPO)
    loss = "loss"  # kl_coef * KL added to the loss (GRPO)


class KLControllerKind(str, Enum):
    fixed = "fixed"
    adaptive = "adaptive"  # Ziegler et al. 2019: steer the coefficient towards target_kl


class LossAggregation(str, Enum):
    token_mean = "token_mean"  # every response token weighs the same (DAPO)
    seq_mean = "seq_mean"  # mean over tokens of each sequence, then over sequences (GRPO paper)


@dataclass
class AlgorithmConfig:
    estimator: Estimator = Estimator.grpo
    gamma: float = 1.0
    lam: float = 0.95
    clip_eps: float = 0.2
    value_clip_eps: float = 0.2
    vf_coef: float = 0.5
    entropy_coef: float = 0.0
    loss_aggregation: LossAggregation = LossAggregation.token_mean
    kl_estimator: KLEstimator = KLEstimator.k3
    kl_placement: KLPlacement = KLPlacement.loss
    kl_controller: KLControllerKind = KLControllerKind.fixed
    init_kl_coef: float = 0.01
    target_kl: float = 0.1  # adaptive controller only
    kl_horizon: int = 10000  # adaptive controller only: samples over which the error is corrected
    whiten_rewards: bool = False
    normalize_advantages: bool = True
    grpo_scale_by_std: bool = True
    ppo_epochs: int = 1
    mini_batch_size: int = 16  # samples per optimizer step
    micro_batch_size: int = 8  # samples per forward/backward on one learner rank


class ValueHead(str, Enum):
    shared = "shared"  # scalar head on the policy trunk
    separate = "separate"  # its own critic model


class CriticInit(str, Enum):
    policy = "policy"
    reward_model = "reward_model"
    scratch = "scratch"


class Dtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class OptimizerKind(str, Enum):
    torch_adamw = "torch_adamw"  # no JIT compile; the default on CPU
    deepspeed_adam = "deepspeed_adam"  # DeepSpeed's fused (GPU) / CPU Adam


@dataclass
class LoraConfig:
    rank: int = 0  # 0 disables LoRA
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class LearnerConfig:
    model_path: str = "???"  # a Hugging Face folder (local path)
    zero_stage: int = 0
    optimizer: OptimizerKind = OptimizerKind.torch_adamw
    lr: float = 1e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    gradient_checkpointing: bool = False
    dtype: Dtype = Dtype.float32
    value_head: ValueHead = ValueHead.shared  # ignored by critic-free estimators
    critic_init: CriticInit = CriticInit.policy  # separate critic only
    critic_model_path: str = ""  # needed when critic_init is reward_model
    critic_lr: float = 1e-5
    lora: LoraConfig = field(default_factory=LoraConfig)
    threads: int = 0  # torch threads per rank; 0 = share the machine's cores among overlapping processes


@dataclass
class SupervisedTrainConfig:
    """How `relay sft` and `relay rm` train (the learner ranks receive this section)."""
    steps: int = 200  # optimizer steps
    batch_size: int = 32  # sequences (SFT) or preference pairs (RM) per optimizer step
    micro_batch_size: int = 32  # per forward/backward on one rank
    max_length: int = 256  # tokens; longer samples are skipped and counted
    eval_every: int = 50  # steps between held-out evaluations (and at the end)
    margin: float = 0.0  # RM only: -log sigmoid(r_chosen - r_rejected - margin)
