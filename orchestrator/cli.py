"""`relay`: the command line. Each subcommand is a thin call into the package that owns the work."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from orchestrator.load_config import ConfigError, load_config, to_yaml

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "grpo_tiny_cpu.yaml"

# Subcommands whose issue has not landed yet: name -> what is coming.
COMING = {
    "sft": "supervised fine-tuning (issue 7)",
    "rm": "reward-model training (issue 7)",
    "pipeline": "the SFT -> RM -> PPO pipeline (issue 7)",
    "eval": "policy-vs-reference evaluation report (issue 7)",
}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 0
    from orchestrator.data import DataError

    try:
        return args.func(args)
    except ConfigError as e:
        print(f"relay: config error: {e}", file=sys.stderr)
        return 2
    except DataError as e:
        print(f"relay: data error: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relay", description="Distributed rollout/learner RLHF on Ray, vLLM and DeepSpeed.")
    sub = p.add_subparsers(metavar="COMMAND")

    train = sub.add_parser("train", help="run PPO/GRPO/RLOO/REINFORCE training (default: the tiny CPU GRPO demo)")
    _config_args(train, default=DEFAULT_CONFIG)
    train.set_defaults(func=_train)

    config = sub.add_parser("config", help="inspect configs")
    config_sub = config.add_subparsers(metavar="ACTION", required=True)
    show = config_sub.add_parser("show", help="print the resolved, validated config tree")
    _config_args(show, default=None)
    show.set_defaults(func=_config_show)

    serve = sub.add_parser("serve-reward", help="serve the config's reward sources over HTTP (POST /score)")
    _config_args(serve, default=None)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    serve.add_argument("--port", type=int, default=8000)
    serve.set_defaults(func=_serve_reward)

    for name, what in COMING.items():
        stub = sub.add_parser(name, help=f"{what} [not yet implemented]")
        stub.add_argument("rest", nargs="*")
        stub.set_defaults(func=lambda a, name=name, what=what: _not_yet(name, what))
    return p


def _config_args(p: argparse.ArgumentParser, default: Path | None) -> None:
    p.add_argument("config", nargs="?" if default else None, default=default, help="a YAML file under configs/")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. algorithm.clip_eps=0.1")


def _split(args) -> tuple[Path, list[str]]:
    # `relay train k=v` with no file: the first positional is an override, not a config path
    if args.config is not None and "=" in str(args.config) and not Path(str(args.config)).exists():
        return DEFAULT_CONFIG, [str(args.config), *args.overrides]
    return Path(args.config), list(args.overrides)


def _config_show(args) -> int:
    path, overrides = _split(args)
    print(to_yaml(load_config(path, overrides)), end="")
    return 0


def _train(args) -> int:
    path, overrides = _split(args)
    cfg = load_config(path, overrides)  # every config error surfaces here, before Ray starts
    print(to_yaml(cfg), end="", flush=True)
    from orchestrator.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.shutdown()
    return 0


def _serve_reward(args) -> int:
    from reward_service.remote import serve
    from reward_service.service import RewardFunction

    path, overrides = _split(args)
    reward = RewardFunction(load_config(path, overrides, section="reward"))
    server = serve(reward, args.host, args.port)
    host, port = server.server_address[:2]
    print(f"relay serve-reward: {', '.join(reward.names)} on http://{host}:{port}/score", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _not_yet(name: str, what: str) -> int:
    print(f"relay {name}: not yet implemented — {what}.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
