"""What every script deepy.py starts on a rank (train.py, generate.py, eval.py) does around its
work: read `--neox-config-json PATH`, guard the rank, turn the outcome into one exit code, and leave.

    sys.exit(run_script(_train, __doc__))   # _train(config_json) -> exit code

User mistakes are the work's `user_errors()` one line and exit 2 (megatron/build.py); a bug prints
its traceback (the launcher's root cause) and exits 1.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Callable, Mapping, Optional

from megatron.config import ConfigError
from megatron.launch.rank_guard import guard_rank


def run_script(work: Callable[[str], int], description: Optional[str] = None,
               argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--neox-config-json", required=True,
                        help="the validated config deepy.py serialized (never YAML: ranks do not re-parse)")
    args = parser.parse_args(argv)
    guard_rank(os.environ)  # first: a rank never outlives its launcher, nor ignores a stop it cannot act on
    try:
        code = work(args.neox_config_json)
    except SystemExit as stop:  # user_errors' one line is printed already
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: BLE001 - a bug: the traceback is the launcher's root cause
        traceback.print_exc()
        code = 1
    leave_without_gloo_teardown(code)
    return code


def leave_without_gloo_teardown(code: int, env: Optional[Mapping[str, str]] = None,
                                exit_now: Callable[[int], None] = os._exit) -> None:
    """Once a process group exists, exit without the interpreter's C++ teardown: gloo's threads, still
    referenced by Python objects, intermittently abort there ("terminate called without an active
    exception", exit 134), after a good run and after an error alike, which would hide the real code
    (seen here at 8 ranks, and on the 2-rank diverging-run test under CI load).

    By then `runtime.close()` has destroyed the group, so a launched rank is also recognised by its
    launcher's variables, read as the runtime reads them (`launched_as`: WORLD_SIZE, or under srun
    SLURM_NTASKS). Reading WORLD_SIZE alone missed every srun task: those left through the teardown,
    slowly or by SIGABRT, and srun's --kill-on-bad-exit then ended their peers (143 instead of 75)."""
    if in_a_launched_group(os.environ if env is None else env):
        sys.stdout.flush()
        sys.stderr.flush()
        exit_now(code)


def in_a_launched_group(env: Mapping[str, str]) -> bool:
    import torch.distributed as dist
    from megatron.runtime import launched_as

    if dist.is_available() and dist.is_initialized():
        return True
    try:
        return launched_as(env)[1] > 1
    except ConfigError:  # an unreadable count: the work has said so in one line; leave the hard way
        return True
