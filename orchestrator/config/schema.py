"""The one config tree: each package owns its section, the orchestrator owns the root and the run.

Every field is documented once, here or in the section's own module.
"""

from dataclasses import dataclass, field
from enum import Enum

from envs.config import EnvConfig
from learner.config import AlgorithmConfig, LearnerConfig, SupervisedTrainConfig
from reward_service.config import RewardConfig, RewardSource
from rollout.config import RolloutConfig
from runtime.watchdog import WatchdogConfig


class RejectedFrom(str, Enum):
    """Where a generated preference pair's rejected answer comes from (relay rm with data.task)."""

    corrupt = "corrupt"  # the right answer moved by 1-10 (orchestrator/data/generate.corrupt)
    samples = "samples"  # a wrong sample of the starting model (learner.model_path: in a pipeline, the SFT model)


class BadLinePolicy(str, Enum):
    """What a malformed line of a prompt file does: stop naming file:line, or skip it and count it."""

    error = "error"  # stop at the first bad line, naming file and line
    skip = "skip"  # skip it, count it under data/skipped_lines, log file and line once


@dataclass
class ClusterConfig:
    """The `cluster` section: how many workers and ranks, their devices, placement, restarts."""

    address: str = ""
    """"" starts a local Ray (or joins RAY_ADDRESS); "auto" or host:port joins a running cluster"""
    rollout_workers: int | str = 1
    """vLLM engines (Ray actors); each step's prompts are split evenly among them. A range "min..max" is an elastic
    pool: it starts with min, grows as nodes with room join, shrinks as nodes leave, and ends below min"""
    learner_ranks: int = 1
    """DeepSpeed data-parallel learner ranks (Ray actors)"""
    colocate: bool = True
    """true: roles share the devices (no placement group, actors reserve no CPUs); false: a bundle each"""
    gpus_per_rollout_worker: float = 0.0
    """GPUs per rollout worker (a fraction shares one); > 0 also sends weights by NCCL, 0 by gloo"""
    gpus_per_learner: float = 0.0
    """GPUs per learner rank (a fraction shares one); 0 = CPU"""
    gpus_per_scoring: float = 0.0
    """GPUs of the scoring service (reference and reward models); 0 = CPU"""
    max_restarts: int = 2
    """Ray restarts of a dead rollout/scoring actor, and rebuilds of the learner group after a dead rank (its lost
    steps replayed from the last checkpoint), before the run fails"""
    cpu_keep_freed_memory: bool = True
    """CPU roles reuse freed memory (glibc malloc without mmap or trim): a step's big tensors no longer page-fault
    anew; each process keeps its peak memory"""
    rollout_resource: str = ""
    """a custom Ray resource each rollout worker requires one unit of (a node started with --resources
    '{"rollout_node": 8}' hosts 8); "" = any node"""
    learner_resource: str = ""
    """likewise for each learner rank (e.g. "learner_node"); "" = any node"""
    scoring_resource: str = ""
    """likewise for the scoring service (e.g. "scoring_node"); "" = any node"""

    @property
    def engines(self) -> int:
        """The engines at launch, and the fewest the run goes on with."""
        return engine_range(self.rollout_workers)[0]

    @property
    def max_engines(self) -> int:
        return engine_range(self.rollout_workers)[1]

    @property
    def elastic(self) -> bool:
        return self.max_engines > self.engines


def engine_range(value: int | str) -> tuple[int, int]:
    """cluster.rollout_workers as (min, max): N is N..N, "2..4" is 2..4. A malformed value raises ValueError."""
    text = str(value).strip()
    low, dots, high = text.partition("..")
    try:
        return (int(low), int(high)) if dots else (int(text), int(text))
    except ValueError:
        raise ValueError(f'expected a number of engines or a range "min..max", got {value!r}') from None


@dataclass
class DataConfig:
    """The `data` section: prompt files or a task, the held-out set, batch size, dynamic sampling."""

    train_files: list[str] = field(default_factory=list)
    """prompt files, JSONL or Parquet; give these or task, not both"""
    eval_files: list[str] = field(default_factory=list)
    """held-out prompt files (their prompts leave training, counted); []: drawn (eval_size)"""
    task: str = ""
    """prompts from a task instead of files (addition_2digit, addition_3digit, guess_number, a reasoning-gym name); ""
    = files"""
    task_size: int = 1000
    """training prompts generated from task (task only)"""
    prompt_key: str = "prompt"
    """the field holding the prompt: text, a list of chat messages, or token ids"""
    answer_key: str = "answer"
    """optional reference answer, passed to rewards; other fields travel as metadata"""
    apply_chat_template: bool = False
    """send a text prompt as one user message through the tokenizer's chat template"""
    rollout_batch_size: int = 8
    """prompts per step (each sampled rollout.sampling.n_samples_per_prompt times)"""
    eval_size: int = 64
    """held-out prompts, evaluated at start, end and every eval.every_n_steps; never trained on"""
    shuffle: bool = True
    """reshuffle the prompts every epoch (seeded); false = file order"""
    on_bad_line: BadLinePolicy = BadLinePolicy.error
    """a malformed line: error (stop, naming file:line) or skip (and count it)"""
    dynamic_sampling: bool = False
    """GRPO/RLOO (DAPO): drop groups whose rewards are all equal, top up"""
    dynamic_sampling_rounds: int = 4
    """extra generate+score rounds per step; still short, equal groups fill the batch"""


class WandbMode(str, Enum):
    """Where wandb writes: offline (no login), online, or disabled."""

    offline = "offline"  # works with no login; `wandb sync` uploads later
    online = "online"
    disabled = "disabled"


@dataclass
class WandbConfig:
    """Weights & Biases: mode, project and entity."""

    mode: WandbMode = WandbMode.offline
    """offline (no login; `wandb sync` later), online, or disabled (metrics.jsonl only)"""
    project: str = "relay"
    """wandb project"""
    entity: str = ""
    """wandb team or user; "" = your default entity"""


@dataclass
class LoggingConfig:
    """The `logging` section: wandb, console lines and the progress bar, profiling one step."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases; metrics.jsonl in the run folder is written either way"""
    log_every: int = 1
    """steps between console lines (metrics.jsonl and wandb get every step)"""
    progress_bar: bool = True
    """print a console line per log_every steps (progress, reward, KL, time); false = quiet"""
    profile_step: int = 0
    """profile this step in every role (torch and Python profiles, runs/<name>/profile/); 0 = off"""


@dataclass
class CheckpointConfig:
    """The `checkpoint` section: how often to save, how many to keep, and resuming."""

    every_n_steps: int = 0
    """steps between checkpoints (runs/<name>/checkpoints/step_N); 0 = only at the end"""
    keep_last: int = 2
    """newest checkpoints kept, older ones deleted; 0 = keep all"""
    resume: str = "never"
    """never | auto (the run folder's newest checkpoint, if any) | a checkpoint path"""


@dataclass
class EvalSuite:
    """One named held-out set of `eval.suites`: a task or a file, scored by its own reward sources or the run's."""

    name: str = ""
    """the suite's name in metrics (eval/<name>/...) and reports"""
    task: str = ""
    """a task (addition_3digit, ...) or a reasoning-gym name; its held-out prompts (never training ones)"""
    file: str = ""
    """or a JSONL file of prompts (data.prompt_key, data.answer_key); a training prompt in it is left out, counted"""
    size: int = 128
    """prompts evaluated (the first of the file, or drawn from the task)"""
    sources: list[RewardSource] = field(default_factory=list)
    """its reward sources; empty = reward.sources"""


@dataclass
class EvalConfig:
    """The `eval` section: held-out evaluation during training (how often, greedy, sample tables)."""

    every_n_steps: int = 0
    """steps between held-out evaluations; 0 = only before and after training"""
    greedy: bool = True
    """also generate greedy answers (greedy accuracy, sample tables); false = sampled answers only"""
    num_samples_to_log: int = 8
    """held-out prompts shown with their greedy answers (console table, samples.jsonl, wandb)"""
    n_samples: int = 0
    """samples per held-out prompt (pass@k, maj@k, avg@n and the sampled metrics); 0 = rollout.sampling's
    n_samples_per_prompt"""
    pass_k: list[int] = field(default_factory=list)
    """the k of pass@k and maj@k, each at most n_samples; empty = 1 and n_samples"""
    suites: list[EvalSuite] = field(default_factory=list)
    """named held-out sets beside the data's own (e.g. a harder task for generalisation), each reported apart"""


@dataclass
class HealthConfig:
    """The `health` section: the signs of a run going wrong (orchestrator/loop/health.py), their thresholds."""

    enabled: bool = True
    """watch the metrics for the signs and say each in one line, with its cause and knob"""
    window: int = 10
    """steps a trend is read over; also the run's first steps, each sign's baseline"""
    patience: int = 5
    """steps in a row a level sign (KL band, entropy, distinct-2, zero-spread groups, logprob gap) must hold"""
    kl_low: float = 0.01
    """per-token KL to the reference under this, after the first window: the policy barely moves"""
    kl_high: float = 1.0
    """per-token KL over this: the policy drifts towards a quality collapse"""
    entropy_floor: float = 0.2
    """entropy under this share of its first steps' mean: collapsing"""
    length_rise: float = 0.3
    """mean response length of the window's newer half over its older half's, risen more than this share while
    the reward's stayed flat: length hacking"""
    reward_flat: float = 0.02
    """a reward change (the reward's units; halves of the window, or the window against the first) under this
    counts as flat, over it as rising"""
    distinct_floor: float = 0.5
    """distinct-2 of the responses under this share of its first steps': diversity collapsing"""
    held_out_drop: float = 0.02
    """held-out accuracy (or reward) falling more than this below the evaluation before training, the training
    reward rising: reward hacking"""
    zero_spread_max: float = 0.5
    """share of prompt groups whose samples all score alike, over this: no signal"""
    value_loss_factor: float = 10.0
    """value loss over this multiple of its first steps' median (or not finite): exploding"""
    logprob_gap_factor: float = 3.0
    """sampler-learner logprob gap over this multiple of its first steps' median (and logprob_gap_min): growing"""
    logprob_gap_min: float = 0.05
    """the gap (mean |logprob difference| per token) under which no growth counts"""


class AsyncMode(str, Enum):
    """How far generation runs ahead of the learner, and when the engines take new weights: sync,
    one_step or full (between the engines' calls), in_flight (mid-sequence)."""

    sync = "sync"  # generate -> score -> update -> sync in turn: every sample is from the current policy
    one_step = "one_step"  # the next batch generates while this one is scored and trained (staleness 1)
    full = "full"  # up to max_staleness batches generate ahead of the learner, which never waits for a sync
    # as full, but an engine takes each sync at once, pausing its running sequences (vLLM's keep) and
    # continuing them under the new weights: every token is tagged with the version that sampled it
    in_flight = "in_flight"


@dataclass
class AsyncConfig:
    """The `async_training` section: the mode and, for full, the staleness bound."""

    mode: AsyncMode = AsyncMode.sync
    """sync, one_step, full or in_flight ("off" is spelled sync: YAML reads off as false)"""
    max_staleness: int = 2
    """full and in_flight: a token trains at most this many policy versions after the one that sampled it"""


@dataclass
class TrainConfig:
    """The root of `relay train`'s config: the run (name, seed, steps) and one section per package."""

    name: str = "run"
    """run folder: <run_root>/<name>; also the wandb run name"""
    seed: int = 0
    """every random stream (runtime/seeds.py): sampling, data, held-out draw, engines, envs, learner"""
    total_steps: int = 10
    """RL steps (generate, score, update, sync)"""
    run_root: str = "runs"
    """folder of the run folders, and of built-in models (<run_root>/models)"""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Ray: actors per role and their devices"""
    data: DataConfig = field(default_factory=DataConfig)
    """the prompts"""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """the vLLM engines and how they sample"""
    env: EnvConfig = field(default_factory=EnvConfig)
    """multi-turn episodes: the environment the samples play (none: single-turn)"""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """reward sources, reward shaping and the reference policy"""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """estimator, losses, KL and batch sizes of the update"""
    async_training: AsyncConfig = field(default_factory=AsyncConfig)
    """how far generation runs ahead of the learner"""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """the trained policy (and critic): model, optimizer, DeepSpeed"""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """console lines, metrics.jsonl and wandb"""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """when to save, how many to keep, resuming"""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """held-out evaluation during training"""
    health: HealthConfig = field(default_factory=HealthConfig)
    """the signs of a run going wrong, said as they appear"""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """deadlines of the driver's waits on remote calls, and what a stuck one leaves behind"""


@dataclass
class SupervisedDataConfig:
    """Demonstrations (prompt, response) for `relay sft`, preference pairs (prompt, chosen, rejected)
    for `relay rm`: JSONL/Parquet files, or generated from a task (see orchestrator/data/generate.py)."""

    train_files: list[str] = field(default_factory=list)
    """JSONL or Parquet: demonstrations (sft) or preference pairs (rm)"""
    eval_files: list[str] = field(default_factory=list)
    """empty: hold out eval_size examples of the train set"""
    task: str = ""
    """generate the set from this task instead of files (written to the run directory)"""
    task_size: int = 2000
    """training examples generated from task (task only)"""
    eval_size: int = 200
    """held-out examples (from eval_files, generated, or split off the train set)"""
    prompt_key: str = "prompt"
    """plain text or a list of chat messages"""
    response_key: str = "response"
    """sft: the demonstration's response field"""
    chosen_key: str = "chosen"
    """rm: the preferred response field"""
    rejected_key: str = "rejected"
    """rm: the dispreferred response field"""
    rejected_from: RejectedFrom = RejectedFrom.corrupt
    """rm with task: corrupt (the right answer moved by 1-10) or samples (the starting model's own wrong answers)"""
    rejected_samples: int = 8
    """rejected_from samples: answers sampled per prompt (temperature 1) to find a wrong one"""
    apply_chat_template: bool = False
    """render the prompt as one user message through the tokenizer's chat template"""
    on_bad_line: BadLinePolicy = BadLinePolicy.error
    """a malformed line: error (stop, naming file:line) or skip (and count it)"""


@dataclass
class ScratchModelConfig:
    """The model `relay sft` builds when learner.model_path is empty: a GPT-2 from config alone."""

    n_layer: int = 2
    """transformer blocks"""
    n_embd: int = 128
    """hidden size"""
    n_head: int = 4
    """attention heads (must divide n_embd)"""
    n_positions: int = 256
    """context length in tokens"""
    tokenizer: str = "char"
    """char (one token per character) or bpe (trained on the training text)"""
    vocab_size: int = 512
    """bpe only: size of the trained vocabulary"""


@dataclass
class StageConfig:
    """`relay sft CONFIG` and `relay rm CONFIG`."""

    name: str = "stage"
    """run folder: <run_root>/<name>; the model goes to <run_root>/<name>/model"""
    seed: int = 0
    """generated task data, model init, learner ranks and batch order"""
    run_root: str = "runs"
    """folder of the run folders"""
    learner_ranks: int = 1
    """DeepSpeed data-parallel ranks (Ray actors)"""
    data: SupervisedDataConfig = field(default_factory=SupervisedDataConfig)
    """demonstrations (sft) or preference pairs (rm)"""
    learner: LearnerConfig = field(default_factory=lambda: LearnerConfig(model_path="", lr=1e-4))
    """the trained model; model_path "" = a scratch GPT-2"""
    scratch: ScratchModelConfig = field(default_factory=ScratchModelConfig)
    """the model built when learner.model_path is "" """
    train: SupervisedTrainConfig = field(default_factory=SupervisedTrainConfig)
    """steps, batch sizes and lengths of the training"""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """console lines, metrics.jsonl and wandb"""


@dataclass
class PipelineConfig:
    """`relay pipeline CONFIG`: SFT -> RM -> PPO. Each stage's output feeds the next by path: the RM
    starts from the SFT model, PPO's policy is the SFT model, its reward the RM (and a critic initialised from
    the RM, where the RL stage has one)."""

    name: str = "pipeline"
    """run folder: <run_root>/<name>, holding sft/, rm/ and ppo/"""
    run_root: str = "runs"
    """folder of the run folders (replaces each stage's name and run_root)"""
    sft: StageConfig = field(default_factory=StageConfig)
    """stage 1: supervised fine-tuning on demonstrations"""
    rm: StageConfig = field(default_factory=StageConfig)
    """stage 2: reward model; learner.model_path "" = start from the SFT model"""
    ppo: TrainConfig = field(default_factory=lambda: TrainConfig(learner=LearnerConfig(model_path="")))
    """stage 3: RL; "" model paths get the SFT model / the RM"""


def eval_samples(cfg: TrainConfig) -> int:
    """Samples per held-out prompt: eval.n_samples, else (0) rollout.sampling.n_samples_per_prompt."""
    return cfg.eval.n_samples or cfg.rollout.sampling.n_samples_per_prompt
