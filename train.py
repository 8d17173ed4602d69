"""Entry point run on every rank: `train.py --neox-config-json PATH` (deepy.py writes PATH once).

Parse, build, train, close — everything else lives in megatron/.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

from megatron.build import build_training, user_errors
from megatron.config import load_config_json
from megatron.exit_codes import STOPPED_SAVED, STOPPED_UNSAVED, SUCCESS
from megatron.rank_guard import guard_rank


def exit_code(trainer) -> int:
    """0 for a finished run; a stop signal before train_iters: STOPPED_SAVED when this step's state
    is on disk (the scheduler requeues, the run resumes), else STOPPED_UNSAVED."""
    if not trainer.stopped_early:
        return SUCCESS
    return STOPPED_SAVED if trainer.last_saved_iteration == trainer.iteration else STOPPED_UNSAVED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--neox-config-json", required=True,
                        help="the validated config deepy.py serialized (never YAML: ranks do not re-parse)")
    args = parser.parse_args(argv)
    guard_rank(os.environ)  # first: a rank never outlives its launcher, nor ignores a stop it cannot act on
    try:
        code = _train(args.neox_config_json)
    except SystemExit as stop:  # user_errors' one line is printed already
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: BLE001 - a bug: the traceback is the launcher's root cause
        traceback.print_exc()
        code = 1
    _leave_without_gloo_teardown(code)
    return code


def _train(config_json: str) -> int:
    with user_errors():
        cfg = load_config_json(config_json)
        run = build_training(cfg)
        run.trainer.fit()
        run.report()
        run.write_memory_report()
        # Not in a `finally`: its barrier waits for every peer, and after an exception mid-step the
        # peers are blocked in that step's collective, so the run would hang instead of failing.
        run.runtime.close()
    return exit_code(run.trainer)


def _leave_without_gloo_teardown(code: int) -> None:
    """Once a process group exists, exit without the interpreter's C++ teardown: gloo's threads, still
    referenced by Python objects, intermittently abort there ("terminate called without an active
    exception", exit 134), after a good run and after an error alike, which would hide the real code
    (seen here at 8 ranks, and on the 2-rank diverging-run test under CI load)."""
    import torch.distributed as dist

    in_a_group = (dist.is_available() and dist.is_initialized()) or os.environ.get("WORLD_SIZE", "1") != "1"
    if in_a_group:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
