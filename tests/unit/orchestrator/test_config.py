"""The typed config tree: loading, overrides and one-line errors that name key and source."""

import re

import pytest

from learner.config import Estimator, KLControllerKind
from orchestrator.config.load import ConfigError, load_config, to_dict
from orchestrator.config.schema import PipelineConfig
from reward_service.config import SourceKind
from tests.helpers import REPO, relay

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
DEFAULT = REPO / "configs" / "grpo_tiny_cpu.yaml"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    from orchestrator.config.schema import PipelineConfig, StageConfig, TrainConfig

    # the command decides the tree: relay sft/rm -> StageConfig, relay pipeline -> PipelineConfig
    root = {"sft": StageConfig, "rm": StageConfig, "pipeline": PipelineConfig}.get(path.stem.split("_")[0], TrainConfig)
    cfg = load_config(path, root=root)
    assert cfg.name == path.stem


def test_sections_are_typed_dataclasses_with_enums():
    cfg = load_config(REPO / "configs" / "ppo_tiny_cpu.yaml", ["algorithm.clip_eps=0.1", "rollout.sampling.top_k=5"])
    assert cfg.algorithm.clip_eps == 0.1 and isinstance(cfg.algorithm.clip_eps, float)
    assert cfg.rollout.sampling.top_k == 5
    assert cfg.algorithm.estimator is Estimator.gae
    assert cfg.algorithm.kl_controller is KLControllerKind.adaptive
    assert cfg.reward.sources[0].kind is SourceKind.math_answer
    assert to_dict(cfg)["algorithm"]["estimator"] == "gae"


def test_list_elements_can_be_overridden_by_index():
    cfg = load_config(DEFAULT, ["reward.sources.0.weight=2.5"])
    assert cfg.reward.sources[0].weight == 2.5


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


BASE = "data:\n  task: t\nlearner:\n  model_path: m\n"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["algorithm.clip_epss=0.1"],
            "command line 'algorithm.clip_epss=0.1': algorithm.clip_epss: unknown key; did you mean 'clip_eps'?",
        ),
        (["algorithm.clip_eps=abc"], "algorithm.clip_eps: Value 'abc' of type 'str' could not be converted to Float"),
        (
            ["algorithm.estimator=ppo2"],
            "algorithm.estimator: Invalid value 'ppo2', expected one of "
            "[gae, grpo, rloo, reinforce_baseline, reinforce_pp]",
        ),
        (["rollout.sampling.n_samples_per_prompt=1"], "grpo compares samples of one prompt: needs >= 2, got 1"),
        (["algorithm.mini_batch_size=100"], "algorithm.mini_batch_size: 100 must divide the samples per step"),
        (
            ["algorithm.micro_batch_size=48"],
            "algorithm.micro_batch_size: micro_batch_size (48) x cluster.learner_ranks (1) must divide",
        ),
        (["reward.sources.0.kindd=remote"], "reward.sources.0.kindd: unknown key; did you mean 'kind'?"),
        (["reward.sources.x.kind=remote"], "reward.sources is a list; index it by number"),
        (["reward.sources.0.kind=function"], "reward.sources.0.function: a function source needs function"),
        (
            ["algorithm.kl_controller=adaptive", "algorithm.target_kl=0"],
            "command line 'algorithm.target_kl=0': algorithm.target_kl",
        ),
        (["novalue"], "overrides are key=value"),
        (["learner.packing_row_tokens=-1"], "learner.packing_row_tokens: must be >= 0"),
        (["learner.attn_implementation=flash"], "learner.attn_implementation: Invalid value 'flash'"),
        # this machine has no flash-attn (test_flash_attention_needs_a_gpu_learner: with it)
        (["learner.attn_implementation=flash_attention_2"], "flash_attention_2 needs the flash-attn package"),
    ],
)
def test_bad_overrides_fail_with_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("algorithm:\n  lrr: 3\n", "c.yaml:2: algorithm.lrr: unknown key"),
        ("learner:\n  model_path: m\n  lrr: 3\n", "c.yaml:3: learner.lrr: unknown key; did you mean 'lr'?"),
        (
            BASE + "reward:\n  sources:\n    - kind: math_answer\n    - kind: remote\n      weight: abc\n",
            "c.yaml:9: reward.sources.1.weight: Value 'abc'",
        ),
        (
            BASE + "reward:\n  sources:\n    - kind: remote\n      bogus: 1\n",
            "c.yaml:8: reward.sources.0.bogus: unknown key",
        ),
        (BASE + "algorithm:\n  estimator: grpoo\n", "c.yaml:6: algorithm.estimator: Invalid value 'grpoo'"),
        ("data:\n  task: t\n", "c.yaml: learner.model_path: required, but no value was given"),
        (BASE + "rollout:\n  sampling:\n    top_p: 1.5\n", "c.yaml:7: rollout.sampling.top_p: must be in (0, 1]"),
        ("learner:\n  model_path: m\n", "data.train_files: give prompt files"),
        ("a: [\n", "c.yaml:2: not valid YAML"),
        (BASE + "learner:\n  zero_stage: 4\n", "c.yaml:5: learner: duplicate key (first at line 3)"),
        (
            "learner:\n  model_path: m\n  model_path: n\n",
            "c.yaml:3: learner.model_path: duplicate key (first at line 2)",
        ),
    ],
)
def test_bad_files_fail_with_one_line_naming_file_line_and_key(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "text, override, message",
    [
        ("algorithm:\n  gamma: 0.9\n", "algorithm.gamma=0.9", "algorithm.gamma moved to algorithm.gae.gamma"),
        ("algorithm:\n  lam: 0.9\n", "algorithm.lam=0.9", "algorithm.lam moved to algorithm.gae.lam"),
        ("algorithm:\n  vf_coef: 1\n", "algorithm.vf_coef=1", "algorithm.vf_coef moved to algorithm.gae.vf_coef"),
        (
            "algorithm:\n  grpo_scale_by_std: false\n",
            "algorithm.grpo_scale_by_std=false",
            "algorithm.grpo_scale_by_std moved to algorithm.grpo.scale_by_std",
        ),
        (
            "algorithm:\n  reinforce_pp_group_baseline: true\n",
            "algorithm.reinforce_pp_group_baseline=true",
            "algorithm.reinforce_pp_group_baseline moved to algorithm.reinforce_pp.group_baseline",
        ),
        (
            "algorithm:\n  cispo_clip_low: 0.1\n",
            "algorithm.cispo_clip_low=0.1",
            "algorithm.cispo_clip_low moved to algorithm.cispo.clip_low",
        ),
        (
            "algorithm:\n  reinforce_baseline: batch\n",
            "algorithm.reinforce_baseline=batch",
            "algorithm.reinforce_baseline moved to algorithm.reinforce_baseline.baseline",
        ),
    ],
)
def test_an_algorithm_key_that_moved_into_a_sub_section_names_its_new_place(tmp_path, text, override, message):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, BASE + text))
    assert "c.yaml:6: " in str(e.value) and message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=f"command line {override!r}: .*{message}"):
        load_config(DEFAULT, [override])
    pipeline = "ppo:\n  " + text.replace("\n  ", "\n    ")
    with pytest.raises(ConfigError, match=f"ppo.{message}".replace("to algorithm.", "to ppo.algorithm.")):
        load_config(write(tmp_path, pipeline), root=PipelineConfig)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: cannot read config"):
        load_config(tmp_path / "nope.yaml")


def test_cli_config_show_prints_the_resolved_tree():
    out = relay("config", "show", "configs/grpo_tiny_cpu.yaml", "algorithm.clip_eps=0.1")
    assert out.returncode == 0, out.stderr
    assert "  clip_eps: 0.1  # " in out.stdout and "  estimator: grpo  # " in out.stdout  # each value with its comment


def test_cli_config_typo_is_one_line_with_a_suggestion():
    out = relay("config", "show", "configs/grpo_tiny_cpu.yaml", "algorithm.clip_epss=0.1")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().count("\n") == 0
    assert "algorithm.clip_epss" in out.stderr and "did you mean 'clip_eps'?" in out.stderr


def test_cli_help_lists_the_commands():
    out = relay("--help")
    assert out.returncode == 0
    for cmd in ("train", "config", "sft", "rm", "eval", "serve-reward"):
        assert cmd in out.stdout


def test_async_and_off_policy_settings_are_checked_by_key():
    cfg = load_config(
        DEFAULT,
        [
            "async_training.mode=full",
            "async_training.max_staleness=3",
            "algorithm.off_policy.correction=icepop",
            "algorithm.off_policy.level=geometric",
        ],
    )
    assert cfg.async_training.mode.value == "full" and cfg.algorithm.off_policy.level.value == "geometric"
    with pytest.raises(ConfigError, match="async_training.max_staleness: must be >= 1"):
        load_config(DEFAULT, ["async_training.max_staleness=0"])
    with pytest.raises(ConfigError, match="async_training.mode: engines colocated with the learner on GPUs"):
        load_config(
            DEFAULT, ["async_training.mode=one_step", "cluster.gpus_per_rollout_worker=1", "cluster.gpus_per_learner=1"]
        )
    with pytest.raises(ConfigError, match=r"algorithm.off_policy.low: need 0 <= low < 1 < high"):
        load_config(DEFAULT, ["algorithm.off_policy.high=0.9"])
    with pytest.raises(ConfigError, match="algorithm.off_policy.cap: must be > 0"):
        load_config(DEFAULT, ["algorithm.off_policy.cap=0"])


def test_policy_losses_and_their_keys_are_checked_by_key():
    cfg = load_config(
        DEFAULT, ["algorithm.policy_loss=gspo", "algorithm.clip_eps=0.9", "algorithm.loss_aggregation=seq_mean"]
    )
    assert cfg.algorithm.policy_loss.value == "gspo"  # a large clip is fine: a sequence ratio moves less than a token's
    cfg = load_config(DEFAULT, ["algorithm.grpo.scale_by_std=false", "algorithm.loss_aggregation=seq_sum_norm"])
    assert cfg.algorithm.loss_aggregation.value == "seq_sum_norm" and cfg.algorithm.loss_norm_tokens == 0  # Dr. GRPO
    assert (
        load_config(DEFAULT, ["algorithm.policy_loss=cispo", "algorithm.clip_eps_high=4"]).algorithm.clip_eps_high == 4
    )
    with pytest.raises(ConfigError, match="algorithm.policy_loss: Invalid value 'sapo', expected one of"):
        load_config(DEFAULT, ["algorithm.policy_loss=sapo"])
    with pytest.raises(ConfigError, match="algorithm.loss_norm_tokens: must be >= 0"):
        load_config(DEFAULT, ["algorithm.loss_norm_tokens=-1"])
    with pytest.raises(ConfigError, match=r"algorithm.cispo.clip_low: must be in \[0, 1\)"):
        load_config(DEFAULT, ["algorithm.policy_loss=cispo", "algorithm.cispo.clip_low=1"])
    over = [
        "algorithm.estimator=reinforce_pp",
        "rollout.sampling.n_samples_per_prompt=1",
        "algorithm.mini_batch_size=64",
        "algorithm.micro_batch_size=64",
    ]
    assert load_config(DEFAULT, over).algorithm.estimator.value == "reinforce_pp"  # REINFORCE++ needs no groups
    with pytest.raises(ConfigError, match="algorithm.reinforce_pp.group_baseline: a group baseline needs >= 2"):
        load_config(DEFAULT, over + ["algorithm.reinforce_pp.group_baseline=true"])


def test_async_modes_split_colocated_cpu_cores_between_engines_and_learner(monkeypatch):
    import os

    from orchestrator.loop.placement import cpu_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))  # the cores this process may use
    assert cpu_threads(load_config(DEFAULT)) == (0, 0, 8)  # sync: roles take turns, each on every core
    assert cpu_threads(load_config(DEFAULT, ["async_training.mode=one_step"])) == (4, 4, 4)
    assert cpu_threads(
        load_config(DEFAULT, ["async_training.mode=full", "cluster.rollout_workers=2", "learner.threads=3"])
    ) == (2, 3, 4)


def test_kept_freed_memory_serves_threaded_actors_from_one_arena():
    """Actors with a concurrency group (engines, scoring) compute in Ray's threads; glibc would give
    each its own arena, which maps large tensors afresh (SmolLM2 scoring 3.5 s against 1.6 s)."""
    from runtime.device import malloc_env

    assert malloc_env(True, gpu=False, threaded=True)["MALLOC_ARENA_MAX"] == "1"
    assert "MALLOC_ARENA_MAX" not in malloc_env(True, gpu=False)  # the learner computes in its main thread
    assert malloc_env(False, gpu=False, threaded=True) == {} == malloc_env(True, gpu=True, threaded=True)


ENDPOINT = [
    "rollout.endpoint.enabled=true",
    "rollout.sampling.n_samples_per_prompt=1",
    "algorithm.estimator=reinforce_baseline",
    "algorithm.reinforce_baseline.baseline=batch",
    "algorithm.mini_batch_size=32",
    "algorithm.micro_batch_size=32",
    "reward.sources=[{kind: environment}]",
]  # a valid endpoint run of the grpo preset


@pytest.mark.parametrize(
    "preset, overrides, message",
    [
        ("calculator_tiny_cpu", ["env.name=nope"], "env.name: 'nope' is neither a built-in"),
        ("calculator_tiny_cpu", ["env.name=envs.builtin:Nope"], "env.name: cannot load 'envs.builtin:Nope'"),
        ("guess_number_tiny_cpu", ["env.options={lowest: 1}"], "env.options: guess_number does not take these options"),
        ("calculator_tiny_cpu", ["env.step_timeout_s=0"], "env.step_timeout_s: an environment needs a deadline > 0"),
        (
            "calculator_tiny_cpu",
            ["env.max_turns=10"],
            r"rollout.max_model_len: 80 < max_prompt_tokens \(16\) \+ the episode's tokens \(160",
        ),
        (
            "grpo_tiny_cpu",
            ["reward.sources=[{kind: environment}]"],
            "reward.sources: an environment source needs an environment",
        ),
        (
            "grpo_tiny_cpu",
            ["rollout.endpoint.enabled=true"],
            "rollout.sampling.n_samples_per_prompt: must be 1 with the agent endpoint",
        ),
        (
            "calculator_tiny_cpu",
            [
                "rollout.endpoint.enabled=true",
                "rollout.sampling.n_samples_per_prompt=1",
                "algorithm.estimator=reinforce_baseline",
                "algorithm.reinforce_baseline.baseline=batch",
                "algorithm.mini_batch_size=32",
                "algorithm.micro_batch_size=32",
            ],
            "env.name: the agent endpoint's episodes are the agent program's own",
        ),
        (
            "grpo_tiny_cpu",
            ["reward.overlong_buffer=4"],
            r"reward.overlong_max_tokens: overlong shaping needs overlong_max_tokens >= overlong_buffer \(4\)",
        ),
        # engines colocated with the learner on GPUs sleep during the update, when agents still call them
        (
            "grpo_tiny_cpu",
            [*ENDPOINT, "cluster.colocate=true", "cluster.gpus_per_rollout_worker=1", "cluster.gpus_per_learner=1"],
            "cluster.colocate: the agent endpoint serves agents while the learner trains",
        ),
        (
            "grpo_tiny_cpu",
            [*ENDPOINT, "rollout.endpoint.max_staleness=-1"],
            "rollout.endpoint.max_staleness: must be >= 0",
        ),
        (
            "grpo_tiny_cpu",
            [*ENDPOINT, "rollout.endpoint.chat_template=/no/such/tools.jinja"],
            "rollout.endpoint.chat_template: no such file: /no/such/tools.jinja",
        ),
    ],
)
def test_environment_endpoint_and_overlong_settings_are_checked_by_key(preset, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(REPO / "configs" / f"{preset}.yaml", overrides)


def test_a_model_folder_that_is_not_here_is_a_config_error_naming_the_key(tmp_path):
    missing = str(tmp_path / "no_model")
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, [f"learner.model_path={missing}"], local=True)
    assert str(e.value).startswith(f"command line 'learner.model_path={missing}': learner.model_path: '{missing}'")
    # a plain load: shown anywhere
    assert load_config(DEFAULT, [f"learner.model_path={missing}"]).learner.model_path == missing
    text = (
        f"data:\n  task: addition_2digit\nlearner:\n  model_path: {tmp_path}\nreward:\n"
        f"  reference_model_path: {missing}\n  sources:\n    - kind: reward_model\n      model_path: {tmp_path}\n"
        f"    - kind: reward_model\n      model_path: {missing}\n"
    )
    for key, line in (("reward.reference_model_path", 6), ("reward.sources.1.model_path", 11)):
        with pytest.raises(ConfigError, match=rf"c.yaml:{line}: {key}: .*no such folder"):
            load_config(write(tmp_path, text), local=True)
        text = text.replace(f"reference_model_path: {missing}", f"reference_model_path: {tmp_path}")
    from orchestrator.config.schema import PipelineConfig, StageConfig

    with pytest.raises(ConfigError, match="learner.model_path: .*no such folder"):
        load_config(
            REPO / "configs" / "rm_tiny_cpu.yaml", [f"learner.model_path={missing}"], root=StageConfig, local=True
        )
    with pytest.raises(ConfigError, match="ppo.learner.critic_model_path: .*no such folder"):
        load_config(
            REPO / "configs" / "pipeline_tiny_cpu.yaml",
            [
                "ppo.algorithm.estimator=gae",  # the preset is critic-free (RLOO): a critic path is read with a critic
                "ppo.learner.value_head=separate",
                "ppo.learner.critic_init=reward_model",
                f"ppo.learner.critic_model_path={missing}",
            ],
            root=PipelineConfig,
            local=True,
        )


def test_a_critic_path_is_checked_only_where_a_critic_reads_it(tmp_path):
    """Review A, item 14: a leftover learner.critic_model_path failed a GRPO run, which has no critic."""
    missing = str(tmp_path / "no_critic")
    assert (
        load_config(DEFAULT, [f"learner.critic_model_path={missing}"], local=True).learner.critic_model_path == missing
    )
    ppo = ["algorithm.estimator=gae", f"learner.critic_model_path={missing}"]
    assert load_config(DEFAULT, ppo, local=True)  # critic_init: policy, the path unread
    with pytest.raises(ConfigError, match="learner.critic_model_path: .*no such folder"):
        load_config(DEFAULT, ppo + ["learner.value_head=separate", "learner.critic_init=reward_model"], local=True)


def test_the_pipeline_fills_the_rl_stages_paths_and_a_critic_only_where_one_reads_it(tmp_path):
    """The preset is critic-free (RLOO): its RM is the reward; with a critic from the RM, that is the RM too."""
    from orchestrator.config.schema import PipelineConfig
    from orchestrator.stages.pipeline import ppo_stage
    from reward_service.config import SourceKind

    sft, rm = tmp_path / "sft", tmp_path / "rm"
    cfg = load_config(REPO / "configs" / "pipeline_tiny_cpu.yaml", [f"run_root={tmp_path}"], root=PipelineConfig)
    ppo = ppo_stage(cfg, sft, rm)
    assert ppo.algorithm.estimator == "rloo" and ppo.learner.critic_model_path == ""
    leftover = ["ppo.learner.value_head=separate", "ppo.learner.critic_init=reward_model"]  # read by no critic here
    cfg_left = load_config(REPO / "configs" / "pipeline_tiny_cpu.yaml", leftover, root=PipelineConfig)
    assert ppo_stage(cfg_left, sft, rm).learner.critic_model_path == ""
    assert ppo.learner.model_path == str(sft) and ppo.name == "pipeline_tiny_cpu/ppo"
    assert [s.model_path for s in ppo.reward.sources if s.kind == SourceKind.reward_model] == [str(rm)]
    critic = ["ppo.algorithm.estimator=gae", "ppo.learner.value_head=separate", "ppo.learner.critic_init=reward_model"]
    cfg = load_config(REPO / "configs" / "pipeline_tiny_cpu.yaml", critic, root=PipelineConfig)
    assert ppo_stage(cfg, sft, rm).learner.critic_model_path == str(rm)


def test_the_unjudged_steps_limit_is_checked_by_key():
    assert load_config(DEFAULT).reward.max_unjudged_steps == 3
    with pytest.raises(ConfigError, match="reward.max_unjudged_steps: must be >= 0"):
        load_config(DEFAULT, ["reward.max_unjudged_steps=-1"])


def test_relay_train_with_a_missing_model_fails_before_ray_starts(tmp_path):
    out = relay(
        "train",
        "configs/grpo_tiny_cpu.yaml",
        f"learner.model_path={tmp_path / 'no_model'}",
        f"run_root={tmp_path}",
        "logging.wandb.mode=disabled",
    )
    assert out.returncode == 2 and "relay: config error: " in out.stderr and "learner.model_path: " in out.stderr
    assert "Traceback" not in out.stderr and "Ray" not in out.stderr + out.stdout


def test_seq_sum_norms_constant_defaults_to_a_samples_whole_budget():
    """algorithm.loss_norm_tokens 0: the longest sample the run can make, an episode's whole budget
    (model and observation tokens), not one turn's max_new_tokens; an explicit value stands."""
    from orchestrator.loop.roles import learner_algorithm

    calc = REPO / "configs" / "calculator_tiny_cpu.yaml"
    single, episode = load_config(DEFAULT), load_config(calc)
    assert learner_algorithm(single).loss_norm_tokens == single.rollout.sampling.max_new_tokens
    e, new = episode.env, episode.rollout.sampling.max_new_tokens
    assert learner_algorithm(episode).loss_norm_tokens == (e.max_episode_tokens or e.max_turns * new) > new
    assert learner_algorithm(load_config(calc, ["algorithm.loss_norm_tokens=7"])).loss_norm_tokens == 7
    agents = load_config(DEFAULT, ENDPOINT)
    assert learner_algorithm(agents).loss_norm_tokens == agents.rollout.max_model_len  # a conversation's limit


@pytest.mark.parametrize(
    "path, overrides, message",
    [
        # before, each of these passed: eval_size -1 held out all prompts but one, task_size 0 made the
        # sampler loop forever, and a task's eval_files were silently ignored
        ("grpo_tiny_cpu.yaml", ["data.eval_size=-1"], "data.eval_size: must be >= 1, got -1"),
        ("grpo_tiny_cpu.yaml", ["data.eval_size=0"], "data.eval_size: must be >= 1, got 0"),
        ("grpo_tiny_cpu.yaml", ["data.task_size=0"], "data.task_size: must be >= 1, got 0"),
        ("grpo_tiny_cpu.yaml", ["data.eval_files=[e.jsonl]"], "data.eval_files: a task draws its own held-out set"),
        ("sft_tiny_cpu.yaml", ["data.eval_size=-1"], "data.eval_size: must be >= 1, got -1"),
        ("rm_tiny_cpu.yaml", ["data.task_size=0"], "data.task_size: must be >= 1, got 0"),
        ("sft_tiny_cpu.yaml", ["data.eval_files=[e.jsonl]"], "data.eval_files: a task draws its own held-out set"),
        ("pipeline_tiny_cpu.yaml", ["rm.data.eval_size=-2"], "rm.data.eval_size: must be >= 1, got -2"),
    ],
)
def test_bad_data_sizes_and_eval_files_with_a_task_are_refused_naming_the_key(path, overrides, message):
    from orchestrator.config.schema import PipelineConfig, StageConfig, TrainConfig

    root = {"sft": StageConfig, "rm": StageConfig, "pipeline": PipelineConfig}.get(path.split("_")[0], TrainConfig)
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs" / path, overrides, root=root)
    assert message in str(e.value)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_configs_task_split_fits(path):
    # 1 in 8 prompts of a generated task is reserved for held-out sets: the presets' sizes still fit
    from orchestrator.config.schema import PipelineConfig, StageConfig, TrainConfig
    from orchestrator.data.prompts import task_split
    from orchestrator.data.tasks import RELAY_TASKS

    root = {"sft": StageConfig, "rm": StageConfig, "pipeline": PipelineConfig}.get(path.stem.split("_")[0], TrainConfig)
    cfg = load_config(path, root=root)
    for d in [cfg.sft.data, cfg.rm.data, cfg.ppo.data] if root is PipelineConfig else [cfg.data]:
        if d.task and d.task not in RELAY_TASKS:
            pytest.importorskip("reasoning_gym")
        if d.task:
            seed = cfg.ppo.seed if root is PipelineConfig else cfg.seed
            train, held_out = task_split(d.task, d.task_size, d.eval_size, seed)
            assert len(train) == d.task_size and len(held_out) == d.eval_size


@pytest.mark.parametrize(
    "source, message",
    [
        ("{kind: judge}", "reward.sources.0: a judge needs model_path"),
        ("{kind: judge, url: 'http://j', model_path: m}", "reward.sources.0: a judge needs model_path"),
        ("{kind: judge, url: 'http://j', template: 'no slot'}", "reward.sources.0.template: must hold {response}"),
        ("{kind: judge, url: 'http://j', verdict: stars}", "reward.sources.0.verdict: must be choice, number or"),
        ("{kind: judge, model_path: m, judge_engine: sglang}", "reward.sources.0.judge_engine: must be vllm or"),
        ("{kind: judge, model_path: m, judge_max_tokens: 8, judge_max_model_len: 8}", "judge_max_model_len: must"),
        ("{kind: judge, url: 'http://j', timeout_s: 0}", "reward.sources.0.timeout_s: a judge needs a deadline"),
        ("{kind: judge, model_path: m, judge_kv_cache_gb: 0}", "reward.sources.0.judge_kv_cache_gb: must be >= 1"),
        ("{kind: judge, url: 'http://j', judge_max_tokens: 0}", "reward.sources.0.judge_max_tokens: must be >= 1"),
        ("{kind: judge, url: 'http://j', judge_min_choice_mass: 2}", "judge_min_choice_mass: must be in [0, 1]"),
        ("{kind: judge, model_path: m, judge_gpu_memory_utilization: 5}", "judge_gpu_memory_utilization: must be in"),
    ],
)
def test_a_judge_source_is_checked_by_key(source, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(DEFAULT, [f"reward.sources=[{source}]"])
    ok = "{kind: judge, model_path: m, judge_engine: transformers, judge_max_tokens: 8, judge_max_model_len: 8}"
    assert load_config(DEFAULT, [f"reward.sources=[{ok}]"]).reward.sources[0].judge_engine == "transformers"
    url = "{kind: judge, url: 'http://j', judge_max_tokens: 4096}"  # no engine of relay's: its context is the server's
    assert load_config(DEFAULT, [f"reward.sources=[{url}]"]).reward.sources[0].judge_max_tokens == 4096


@pytest.mark.parametrize("key", ["checkpoint.keep_last", "checkpoint.every_n_steps"])
def test_a_negative_checkpoint_count_is_refused_naming_its_key(key):
    # keep_last=-1 sliced checkpoints[:1]: every checkpoint of the run but the newest deleted at each save
    with pytest.raises(ConfigError, match=f"{key}: must be >= 0"):
        load_config(DEFAULT, [f"{key}=-1"])
    load_config(DEFAULT, [f"{key}=0"])


def test_flash_attention_needs_gpus_for_the_learner_and_the_reference_and_bf16():
    from learner.config import Attention
    from orchestrator.config.rules_learner import check_attention

    cfg = load_config(REPO / "configs" / "grpo_tiny_cpu.yaml")
    cfg.learner.attn_implementation = Attention.flash_attention_2
    found = list(check_attention(cfg, installed=lambda name: True))
    assert found == [
        ("learner.attn_implementation", "flash_attention_2 runs on GPUs only: cluster.gpus_per_learner is 0"),
        ("learner.attn_implementation", "flash_attention_2 runs on GPUs only: cluster.gpus_per_scoring is 0"),
        ("learner.attn_implementation", "flash_attention_2 computes in bf16 or fp16: set learner.dtype=bfloat16"),
    ]
    cfg.cluster.gpus_per_learner = cfg.cluster.gpus_per_scoring = 1
    cfg.learner.dtype = "bfloat16"
    assert list(check_attention(cfg, installed=lambda name: True)) == []
