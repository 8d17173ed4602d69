"""Entry point run on every rank: `train.py --neox-config-json PATH` (deepy.py writes PATH once).

Parse, build, train, close — everything else lives in megatron/.
"""
from __future__ import annotations

import argparse
import os
import sys

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
    with user_errors():
        cfg = load_config_json(args.neox_config_json)
        run = build_training(cfg)
        run.trainer.fit()
        run.report()
        run.write_memory_report()
        # Not in a `finally`: its barrier waits for every peer, and after an exception mid-step the
        # peers are blocked in that step's collective, so the run would hang instead of failing.
        run.runtime.close()
    code = exit_code(run.trainer)
    if run.runtime.distributed:
        # Everything is written and the process group is destroyed; skip the interpreter's C++
        # teardown, where gloo's threads, still referenced by Python objects, intermittently abort
        # ("terminate called without an active exception", seen here at 8 ranks) after a good run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
