#!/usr/bin/env python
"""GPT-NeoX's launcher front end: merge YAML configs, validate once, start the ranks.

    python deepy.py train.py configs/tiny-cpu.yml [more.yml ...] [--set KEY=VALUE ...] [-- script args]
    python deepy.py --print-config configs/tiny-cpu.yml configs/sim-2x2x2.yml [--set ...]
    python deepy.py --dry-run configs/20B.yml configs/frontier.yml configs/zero_topo.yml configs/local_setup.yml
    python deepy.py generate.py CONFIGS... --set load=DIR    (or eval.py: docs/generate_eval.md)

The validated config is written once as JSON (under log_dir) and every rank runs
`train.py --neox-config-json PATH`; ranks never re-parse YAML. Mistakes end with one line on
stderr and exit code 2, never a traceback (set NEOX_DEBUG=1 to see one for internal errors).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import yaml

from megatron.config import (ConfigError, NeoXConfig, config_to_dict, launch_environment_error, load_config,
                             save_config_json, world_size_of)
from megatron.checkpointing.folders import save_folder_conflict
from megatron.launch.exit_codes import INTERNAL_ERROR, USAGE_ERROR
from megatron.launch.launcher import launch

INTERRUPTED = 128 + signal.SIGINT  # the shell's code for Ctrl-C (docs/errors.md)
DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny-cpu.yml"
SCRIPTS_THAT_NEVER_SAVE = ("generate.py", "eval.py")  # docs/generate_eval.md


class _ConfigDumper(yaml.SafeDumper):
    """Block mappings, flow lists: one line per field."""


_ConfigDumper.add_representer(
    list, lambda dumper, value: dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=True))


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(f"{message}; usage: deepy.py [--print-config | --dry-run] [train.py] CONFIG.yml ... [--set KEY=VALUE]")


def _parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="deepy.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--print-config", action="store_true",
                   help="print the merged, validated, derived config as YAML and exit (reads no data, touches no device)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate, then print the command line(s) and environment the launch would use, the "
                        "rank layout, the (w, g, os) groups and the tier each spans, the parameter count and "
                        "model-state memory per device; start and write nothing")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override after merging; dotted keys reach into dicts (zero_optimization.stage=3); repeatable")
    p.add_argument("-d", "--conf_dir", default=None, help="directory the config file names are relative to (NeoX's -d)")
    p.add_argument("--rank-output", choices=("all", "errors"), default="all",
                   help="local launcher: stream the other ranks' output prefixed (all) or only a failing rank's (errors)")
    p.add_argument("args", nargs="*", metavar="[SCRIPT.py] CONFIG.yml",
                   help="the training script (omit with --print-config), then config files merged in order")
    return p


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Arguments after `--` go to the training script untouched."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def render_config(cfg: NeoXConfig) -> str:
    """The config as YAML, one section per group; the merged files are listed by path only."""
    data = config_to_dict(cfg)
    data["config_files"] = [entry["path"] for entry in data["config_files"]]
    header = (f"# NeoX-Topo config: {world_size_of(cfg)} rank(s), layout {cfg.topology.layout or [1]}, "
              f"shard factors (w, g, os) = {_factors_text(cfg)}\n")
    return header + yaml.dump(data, Dumper=_ConfigDumper, sort_keys=False, default_flow_style=False, width=100)


def _factors_text(cfg: NeoXConfig) -> str:
    factors = cfg.zero.resolved_factors
    return str(tuple(factors)) if factors is not None else "chosen at start-up (plan: auto)"


def run_config_path(cfg: NeoXConfig) -> Path:
    """Where the JSON every rank reads goes: <log_dir>/neox_config_<time>_<pid>.json."""
    name = f"neox_config_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}.json"
    return (Path(cfg.logging.log_dir) / name).resolve()


def write_run_config(cfg: NeoXConfig) -> Path:
    """Write the run's JSON at run_config_path, else (log_dir not writable) in a temp dir."""
    path = run_config_path(cfg)
    try:
        return save_config_json(cfg, path)
    except OSError:
        return save_config_json(cfg, Path(tempfile.mkdtemp(prefix="neox_config_")) / path.name).resolve()


def main(argv: list[str] | None = None) -> int:
    ours, script_args = split_args(list(sys.argv[1:] if argv is None else argv))
    args = _parser().parse_intermixed_args(ours)
    positional = list(args.args)
    script = positional.pop(0) if positional and positional[0].endswith(".py") else None
    if script is None and args.dry_run:
        script = "train.py"
    if script is None and not args.print_config:
        raise ConfigError("no training script given; usage: deepy.py train.py CONFIG.yml ... "
                          "(or deepy.py --print-config CONFIG.yml ...)")
    if script is not None and not args.print_config and not args.dry_run and not Path(script).is_file():
        raise ConfigError(f"training script not found: {script}")
    configs = [str(Path(args.conf_dir) / c) if args.conf_dir else c for c in positional]
    if not configs:
        configs = [str(DEFAULT_CONFIG)]
        print(f"notice: no config file given: using {DEFAULT_CONFIG}", file=sys.stderr)
    cfg = load_config(configs, args.overrides)
    problem = launch_environment_error(cfg, os.environ)
    if problem:
        raise ConfigError(problem)
    if args.print_config:
        sys.stdout.write(render_config(cfg))
        return 0
    # Refused here, before any rank starts: once training has run, its first save would be lost.
    # generate.py and eval.py never save: their `load` may name any folder.
    ck = cfg.checkpoint
    saves = script is None or Path(script).name not in SCRIPTS_THAT_NEVER_SAVE
    problem = saves and save_folder_conflict(ck.save, ck.load, ck.overwrite_checkpoints)
    if problem:
        raise ConfigError(problem)
    if args.dry_run:
        from megatron.dry_run import render_dry_run
        from megatron.launch.launcher import plan_launch
        from megatron.analytic.model_inputs import padded_vocab_of
        plan = plan_launch(cfg, script, str(run_config_path(cfg)), script_args, os.environ)
        sys.stdout.write(render_dry_run(cfg, plan, os.environ, padded_vocab_of(cfg)))
        return 0
    path = write_run_config(cfg)
    print(f"deepy: {world_size_of(cfg)} rank(s), launcher {cfg.launcher.launcher}, "
          f"shard factors {_factors_text(cfg)}; config {path}", file=sys.stderr, flush=True)
    return launch(cfg, script, str(path), extra_args=script_args, rank_output=args.rank_output)


class _Interrupts:
    """Counts Ctrl-Cs while still raising KeyboardInterrupt for each, as Python's own handler does: the
    local launcher stops the ranks on the first (they save, then exit: `deepy: interrupted; stopped
    all ranks`, 130). One that reaches `run` came before any rank started, or is a second one while
    the ranks were saving: either way one line and 130, never the traceback of where it landed."""

    def __init__(self):
        self.count = 0

    def install(self) -> None:
        # A job started in the background by a non-interactive shell has SIGINT ignored: keep that.
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        self.count += 1
        raise KeyboardInterrupt

    def line(self) -> str:
        if self.count > 1:
            return ("deepy: interrupted again: stopped the ranks without waiting for their save (a step cut "
                    "short is not committed: `latest` names the last complete one)")
        return "deepy: interrupted"


def run(argv: list[str] | None = None) -> int:
    """main() with the one-line error contract."""
    interrupts = _Interrupts()
    interrupts.install()
    try:
        return main(argv)
    except KeyboardInterrupt:
        print(interrupts.line(), file=sys.stderr, flush=True)
        return INTERRUPTED
    except ConfigError as err:
        print(f"deepy: error: {err}", file=sys.stderr)
        return USAGE_ERROR
    except Exception as err:  # an internal bug: still one line unless asked for the traceback
        if os.environ.get("NEOX_DEBUG"):
            raise
        print(f"deepy: internal error: {type(err).__name__}: {err} (set NEOX_DEBUG=1 for the traceback)", file=sys.stderr)
        return INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(run())
