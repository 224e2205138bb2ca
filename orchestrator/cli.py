"""`relay`: the command line. Each subcommand is a thin call into the package that owns the work."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from orchestrator.config.load import ConfigError, load_config, to_yaml
from runtime.quiet import quiet_libraries

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "grpo_tiny_cpu.yaml"
TRAIN_EXIT_STATUS = """Run PPO/GRPO/RLOO/REINFORCE training.

SIGTERM (preemption, eviction) or Ctrl-C: the current step finishes, a checkpoint of it is written,
and relay exits with status 3; `checkpoint.resume=auto` continues from it. Ctrl-C again exits at once,
without a checkpoint (status 130).
A learner rank that dies is restarted and the lost steps replayed, up to cluster.max_restarts times;
once more, relay exits with status 3 and `checkpoint.resume=auto` continues from the last checkpoint.
A process that hangs is named by the watchdog and restarted (docs/fault_tolerance.md).
exit status: 0 done, 1 training error, 2 config or data error, 3 stopped by a signal, or a process lost
beyond its restarts (resumable: the line printed says the command), 130 interrupted without a checkpoint.
A failure's traceback goes to runs/<name>/relay.log."""


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 0
    from orchestrator.data.prompts import DataError
    from orchestrator.loop.step_metrics import TrainingError

    try:
        return args.func(args)
    except ConfigError as e:
        print(f"relay: config error: {e}", file=sys.stderr)
        return 2
    except DataError as e:
        print(f"relay: data error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"relay: training stopped: {e}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relay", description="Distributed rollout/learner RLHF on Ray, vLLM and DeepSpeed."
    )
    sub = p.add_subparsers(metavar="COMMAND")

    train = sub.add_parser(
        "train",
        help="run PPO/GRPO/RLOO/REINFORCE training (default: the tiny CPU GRPO demo)",
        description=TRAIN_EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _config_args(train, default=DEFAULT_CONFIG)
    train.add_argument(
        "--profile",
        action="store_true",
        help="profile step 3 in every role (logging.profile_step=3): runs/<name>/profile/",
    )
    train.set_defaults(func=_train)

    config = sub.add_parser("config", help="inspect configs")
    config_sub = config.add_subparsers(metavar="ACTION", required=True)
    show = config_sub.add_parser("show", help="print the resolved, validated config tree, each value with its meaning")
    _config_args(show, default=None)
    show.add_argument("--bare", action="store_true", help="plain YAML, without the comments")
    show.add_argument(
        "--for",
        dest="command",
        choices=["train", "sft", "rm", "pipeline"],
        default="train",
        help="the command the config is for, which decides its tree (default: train)",
    )
    show.set_defaults(func=_config_show)

    serve = sub.add_parser("serve-reward", help="serve the config's reward sources over HTTP (POST /score)")
    _config_args(serve, default=None)
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address (loopback by default; any other needs a key in RELAY_REWARD_KEY, which clients send)",
    )
    serve.add_argument("--port", type=int, default=8000)
    serve.set_defaults(func=_serve_reward)

    for name, what in (
        ("sft", "supervised fine-tuning: response-only loss, from scratch or pretrained"),
        ("rm", "reward model: Bradley-Terry on preference pairs"),
        ("pipeline", "SFT -> RM -> PPO, each stage feeding the next"),
    ):
        stage = sub.add_parser(name, help=what)
        _config_args(stage, default=None)
        stage.set_defaults(func=_stage, stage=name)

    _report_parsers(sub)
    return p


def _report_parsers(sub) -> None:
    """The commands around a run: eval, plot, data, plan."""
    ev = sub.add_parser("eval", help="policy vs reference on held-out prompts: report.md, report.json, curves")
    ev.add_argument("checkpoint", help="a model folder, or a checkpoint directory (runs/<name>/checkpoints/step_N)")
    ev.add_argument("--reference", required=True, help="the reference policy's model folder")
    ev.add_argument("--config", default=str(DEFAULT_CONFIG), help="held-out data, rewards and sampling")
    ev.add_argument("--reward-model", default="", help="for the win rate (default: the config's reward_model source)")
    ev.add_argument("--run", default="", help="run directory to plot (default: the one holding the checkpoint)")
    ev.add_argument("--out", default="", help="report directory (default: <checkpoint>/eval)")
    ev.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    ev.add_argument("--report", action="store_true", help="print the suite x metric table (markdown) too")
    _verbose_arg(ev)
    ev.set_defaults(func=_eval)

    plot = sub.add_parser("plot", help="PNG of a run's curves (as its pipeline.png)")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default="", help="default: <run_dir>/curves.png")
    plot.set_defaults(func=_plot)

    data = sub.add_parser("data", help="write demonstrations or preference pairs from a task, as JSONL")
    data.add_argument("kind", choices=["demos", "prefs"])
    data.add_argument("--task", required=True, help="addition_2digit, chat_addition_2digit or a reasoning-gym task")
    data.add_argument("--n", type=int, default=1000)
    data.add_argument("--seed", type=int, default=0, help="the run seed its streams derive from (runtime/seeds.py)")
    data.add_argument("--out", required=True)
    data.set_defaults(func=_data)

    plan = sub.add_parser(
        "plan", help="memory per role and device (learner, vLLM, scoring) and whether the config fits"
    )
    _config_args(plan, default=None)
    plan.add_argument(
        "--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU to plan against (default 80)"
    )
    plan.add_argument(
        "--host-memory-gb",
        type=float,
        default=None,
        help="host memory to judge host-side roles against (default: this machine's, when every role is on the host)",
    )
    plan.set_defaults(func=_plan)


def _config_args(p: argparse.ArgumentParser, default: Path | None) -> None:
    p.add_argument("config", nargs="?" if default else None, default=default, help="a YAML file under configs/")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. algorithm.clip_eps=0.1")
    _verbose_arg(p)


def _verbose_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--verbose",
        action="store_true",
        help="the libraries' own notices (Ray, DeepSpeed, transformers, wandb, warnings) on the terminal too, "
        "not only in the run folder's relay.log",
    )


def _split(args) -> tuple[Path, list[str]]:
    # `relay train k=v` with no file: the first positional is an override, not a config path
    if args.config is not None and "=" in str(args.config) and not Path(str(args.config)).exists():
        return DEFAULT_CONFIG, [str(args.config), *args.overrides]
    return Path(args.config), list(args.overrides)


def _config_show(args) -> int:
    from orchestrator.config.docs import commented_yaml
    from orchestrator.config.schema import PipelineConfig, StageConfig, TrainConfig

    path, overrides = _split(args)
    root = {"train": TrainConfig, "sft": StageConfig, "rm": StageConfig, "pipeline": PipelineConfig}[args.command]
    cfg = load_config(path, overrides, root=root)
    print(to_yaml(cfg) if args.bare else commented_yaml(cfg), end="")
    return 0


def _train(args) -> int:
    from orchestrator.config.docs import record_launch

    path, overrides = _split(args)
    if args.profile:  # step 3: after the warm-up steps (first calls, allocations, vLLM's first batches)
        overrides = ["logging.profile_step=3", *overrides]
    cfg = load_config(path, overrides, local=True)  # every config error surfaces here, before Ray starts
    print(record_launch(cfg, "train"), flush=True)  # the full config goes to the run folder
    from orchestrator.loop.trainer import Trainer

    run_dir = Path(cfg.run_root) / cfg.name
    quiet_libraries(run_dir, args.verbose)
    try:
        trainer = Trainer(cfg)  # ray.init sets its own SIGTERM handler: ours go in after it
    except Exception as e:  # noqa: BLE001 (every way a run ends gets one line; the traceback goes to relay.log)
        return _ended(e, run_dir, args)
    return _run(trainer, run_dir, args)


def _run(trainer, run_dir: Path, args) -> int:
    """Run the built trainer under the signal handlers; each way it ends is an exit status and one line."""
    from orchestrator.loop.signals import (
        INTERRUPTED_EXIT_CODE,
        STOPPED_EXIT_CODE,
        Stopped,
        StopRequest,
        stop_on_signals,
    )

    with stop_on_signals(StopRequest()) as stop:  # kept through shutdown: a repeated SIGTERM must not kill it
        try:
            trainer.run(stop)
        except Stopped as e:
            print(f"relay: {e}", file=sys.stderr, flush=True)
            return STOPPED_EXIT_CODE
        except KeyboardInterrupt:
            print(
                "relay: interrupted: exiting without a checkpoint; checkpoint.resume=auto continues from the newest "
                "one in the run folder, if any",
                file=sys.stderr,
                flush=True,
            )
            return INTERRUPTED_EXIT_CODE
        except Exception as e:  # noqa: BLE001 (as in _train)
            return _ended(e, run_dir, args)
        finally:
            trainer.shutdown()
    return 0


def _ended(error: Exception, run_dir: Path, args) -> int:
    """A run that ended on `error`: config, data and training errors go to main's one-line handlers;
    anything else through orchestrator.loop.endings (its status, its line, the traceback in relay.log)."""
    from orchestrator.data.prompts import DataError
    from orchestrator.loop.endings import ending
    from orchestrator.loop.step_metrics import TrainingError

    if isinstance(error, (ConfigError, DataError, TrainingError)):
        raise error
    status, line = ending(error, run_dir, resume_command(args))
    print(line, file=sys.stderr, flush=True)
    return status


def resume_command(args) -> str:
    """The command that continues this `relay train` run from its newest checkpoint."""
    path, overrides = _split(args)
    kept = [o for o in overrides if not o.startswith("checkpoint.resume=")]
    return " ".join(["relay train", str(path), *kept, "checkpoint.resume=auto"])


def _run_root(path, overrides: list[str]) -> str:
    """The run_root a command that loads one section still needs (where builtin:// models are built): the
    command line's, else the file's, else the default."""
    import yaml

    from orchestrator.config.schema import TrainConfig

    given = [o.partition("=")[2].strip() for o in overrides if o.partition("=")[0].strip() == "run_root"]
    if given:  # the last one wins, its value read as load_config reads it
        return str(yaml.safe_load(given[-1]) if given[-1] else "")
    data = yaml.safe_load(Path(path).read_text()) or {}
    return str(data["run_root"]) if isinstance(data, dict) and "run_root" in data else TrainConfig.run_root


def _serve_reward(args) -> int:
    from orchestrator.data.builtin_models import resolve_judges
    from reward_service.remote import serve
    from reward_service.service import RewardFunction
    from runtime.endpoint_auth import REWARD_KEY_ENV, env_key, keyless_exposure

    key = env_key(REWARD_KEY_ENV)
    refused = keyless_exposure(args.host, key, REWARD_KEY_ENV)
    if refused:  # anyone reaching it could use its reward models; said before one is loaded
        raise ConfigError(f"--host: {refused}")
    path, overrides = _split(args)
    cfg = load_config(path, overrides, section="reward")
    cfg.sources = resolve_judges(cfg.sources, _run_root(path, overrides))
    reward = RewardFunction(cfg)
    server = serve(reward, args.host, args.port, key)
    host, port = server.server_address[:2]
    needs = f", for calls that send the key in {REWARD_KEY_ENV}" if key else ""
    print(f"relay serve-reward: {', '.join(reward.names)} on http://{host}:{port}/score{needs}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _stage(args) -> int:
    from orchestrator.config.docs import record_launch
    from orchestrator.config.schema import PipelineConfig, StageConfig

    path, overrides = _split(args)
    if args.stage == "pipeline":
        cfg = load_config(path, overrides, root=PipelineConfig, local=True)
        print(record_launch(cfg, "pipeline"), flush=True)
        quiet_libraries(Path(cfg.run_root) / cfg.name, args.verbose)
        from orchestrator.stages.pipeline import run_pipeline

        run_pipeline(cfg)
        return 0
    cfg = load_config(path, overrides, root=StageConfig, local=True)
    print(record_launch(cfg, args.stage), flush=True)
    quiet_libraries(Path(cfg.run_root) / cfg.name, args.verbose)
    from orchestrator.stages.supervised import run_stage

    run_stage(cfg, args.stage)
    return 0


def _eval(args) -> int:
    from orchestrator.tools.eval_checkpoint import evaluate_checkpoint

    cfg = load_config(args.config, args.overrides)
    out = Path(args.out or Path(args.checkpoint) / "eval")
    quiet_libraries(out, args.verbose)
    report = evaluate_checkpoint(
        cfg,
        args.checkpoint,
        args.reference,
        str(out),
        args.reward_model,
        args.run,
    )
    if args.report:
        print(report["table"], end="", flush=True)
    return 0


def _plot(args) -> int:
    from orchestrator.tools.plots import plot_run

    figure = plot_run(Path(args.run_dir) / "metrics.jsonl", args.out or Path(args.run_dir) / "curves.png")
    print(figure or f"relay plot: {args.run_dir}/metrics.jsonl holds no training step to draw")
    return 0 if figure else 1


def _data(args) -> int:
    from orchestrator.data.generate import demonstrations, preferences, write_jsonl
    from orchestrator.data.tasks import draw_task
    from runtime.seeds import stream_seed

    # trainable prompts only (tasks.reserved: never a run's held-out one), as relay sft/rm draw them; the
    # rejected answers from their own stream (the task's seed would replay the sums' random sequence)
    examples = draw_task(args.task, args.n, stream_seed(args.seed, "task"), held_out=False)
    demos = args.kind == "demos"
    rows = demonstrations(examples) if demos else preferences(examples, stream_seed(args.seed, "rejected"))
    print(f"relay data: {len(rows)} rows -> {write_jsonl(rows, args.out)}")
    return 0


def _plan(args) -> int:
    from orchestrator.tools.plan import load, make_plan, render

    path, overrides = _split(args)
    dtype_lines: list[str] = []  # in the report, not on stderr
    kind, cfg = load(path, overrides, dtype_lines)
    plan = make_plan(kind, cfg, args.gpu_memory_gb, args.host_memory_gb)
    print(render(plan, path, args.gpu_memory_gb, dtype_lines), end="")
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
