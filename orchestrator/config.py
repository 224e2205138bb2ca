"""The one config tree: each package owns its section, the orchestrator owns the root and the run.

Every field is documented once, here or in the section's own module.
"""
from dataclasses import dataclass, field
from enum import Enum

from learner.config import AlgorithmConfig, LearnerConfig, SupervisedTrainConfig
from reward_service.config import RewardConfig
from rollout.config import RolloutConfig


class BadLinePolicy(str, Enum):
    error = "error"  # stop at the first bad line, naming file and line
    skip = "skip"  # skip it, count it under data/skipped_lines, log file and line once


@dataclass
class ClusterConfig:
    address: str = ""  # "" starts a local Ray; "auto" joins the cluster this job runs in
    rollout_workers: int = 1
    learner_ranks: int = 1
    colocate: bool = True  # share devices between roles (vLLM sleeps during the update on GPU)
    gpus_per_rollout_worker: float = 0.0
    gpus_per_learner: float = 0.0
    max_restarts: int = 2  # Ray restarts of a dead rollout/scoring actor before the run fails


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # JSONL or Parquet
    eval_files: list[str] = field(default_factory=list)
    task: str = ""  # a reasoning-gym task name instead of files
    task_size: int = 1000
    prompt_key: str = "prompt"  # plain text or a list of chat messages
    answer_key: str = "answer"  # optional reference answer, passed to rewards
    apply_chat_template: bool = False
    rollout_batch_size: int = 8  # prompts per step
    eval_size: int = 64
    shuffle: bool = True
    on_bad_line: BadLinePolicy = BadLinePolicy.error
    dynamic_sampling: bool = False  # GRPO/RLOO (DAPO): drop groups whose rewards are all equal, top up
    dynamic_sampling_rounds: int = 4  # extra generate+score rounds per step before keeping some equal groups


class WandbMode(str, Enum):
    offline = "offline"  # works with no login; `wandb sync` uploads later
    online = "online"
    disabled = "disabled"


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.offline
    project: str = "relay"
    entity: str = ""


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    log_every: int = 1
    progress_bar: bool = True


@dataclass
class CheckpointConfig:
    every_n_steps: int = 0  # 0 = only at the end
    keep_last: int = 2
    resume: str = "never"  # never | auto | a checkpoint path


@dataclass
class EvalConfig:
    every_n_steps: int = 0  # 0 = only before and after training
    greedy: bool = True
    num_samples_to_log: int = 8


@dataclass
class TrainConfig:
    name: str = "run"  # run directory: runs/<name>
    seed: int = 0
    total_steps: int = 10
    run_root: str = "runs"
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


@dataclass
class SupervisedDataConfig:
    """Demonstrations (prompt, response) for `relay sft`, preference pairs (prompt, chosen, rejected)
    for `relay rm`: JSONL/Parquet files, or generated from a task (see orchestrator/datagen.py)."""
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)  # empty: hold out eval_size examples of the train set
    task: str = ""  # generate the set from this task instead of files (written to the run directory)
    task_size: int = 2000
    eval_size: int = 200
    prompt_key: str = "prompt"  # plain text or a list of chat messages
    response_key: str = "response"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    apply_chat_template: bool = False
    on_bad_line: BadLinePolicy = BadLinePolicy.error


@dataclass
class ScratchModelConfig:
    """The model `relay sft` builds when learner.model_path is empty: a GPT-2 from config alone."""
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    n_positions: int = 256
    tokenizer: str = "char"  # char (one token per character) or bpe (trained on the training text)
    vocab_size: int = 512  # bpe only


@dataclass
class StageConfig:
    """`relay sft CONFIG` and `relay rm CONFIG`."""
    name: str = "stage"  # run directory: runs/<name>; the model goes to runs/<name>/model
    seed: int = 0
    run_root: str = "runs"
    learner_ranks: int = 1
    data: SupervisedDataConfig = field(default_factory=SupervisedDataConfig)
    learner: LearnerConfig = field(default_factory=lambda: LearnerConfig(model_path="", lr=1e-4))
    scratch: ScratchModelConfig = field(default_factory=ScratchModelConfig)
    train: SupervisedTrainConfig = field(default_factory=SupervisedTrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


@dataclass
class PipelineConfig:
    """`relay pipeline CONFIG`: SFT -> RM -> PPO. Each stage's output feeds the next by path: the RM
    starts from the SFT model, PPO's policy is the SFT model, its reward and critic the RM."""
    name: str = "pipeline"
    run_root: str = "runs"
    sft: StageConfig = field(default_factory=StageConfig)
    rm: StageConfig = field(default_factory=StageConfig)
    ppo: TrainConfig = field(default_factory=lambda: TrainConfig(learner=LearnerConfig(model_path="")))  # paths: filled in
