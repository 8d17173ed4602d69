"""Entry point run on every rank: `train.py --neox-config-json PATH` (deepy.py writes PATH once).

Parse, build, train, close — everything else lives in megatron/ (megatron/launch/entry_point.py: the
argument, the rank guard, exit codes, and why a rank leaves with os._exit once it is in a group).
"""
from __future__ import annotations

import os
import signal
import sys

from megatron.launch.rank_guard import rank_name  # no torch: light enough to come before the handler


def _interrupted(signum, frame) -> None:
    """SIGINT outside the training loop (which saves first: training.StopRequest): one line, 130.

    It leaves at once rather than raising: an exception thrown wherever the signal lands (inside an
    import, a library's catch-all) was not reliably one line (seen under load: a traceback after
    it). Nothing is lost: there is nothing to save, and a save-folder lock left behind is stale (its
    pid is gone) and taken over by the next run."""
    sys.stdout.flush()
    print(f"{rank_name(os.environ)}: interrupted (SIGINT) while not training: nothing to save; "
          f"exit code {128 + signum}", file=sys.stderr, flush=True)
    os._exit(128 + signum)


if __name__ == "__main__":  # before torch's imports (seconds): a Ctrl-C there is one line too
    signal.signal(signal.SIGINT, _interrupted)

from megatron.build import build_training, user_errors  # noqa: E402 - after the handler, on purpose
from megatron.config import load_config_json  # noqa: E402
from megatron.launch.entry_point import run_script  # noqa: E402
from megatron.launch.exit_codes import STOPPED_SAVED, STOPPED_UNSAVED, SUCCESS  # noqa: E402


def exit_code(trainer) -> int:
    """0 for a finished run; a stop signal before train_iters: STOPPED_SAVED when this step's state
    is on disk (the scheduler requeues, the run resumes), else STOPPED_UNSAVED."""
    if not trainer.stopped_early:
        return SUCCESS
    return STOPPED_SAVED if trainer.last_saved_iteration == trainer.iteration else STOPPED_UNSAVED


def main(argv: list[str] | None = None) -> int:
    return run_script(_train, __doc__, argv)


def _train(config_json: str) -> int:
    signal.signal(signal.SIGINT, _interrupted)  # instead of KeyboardInterrupt's traceback
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


if __name__ == "__main__":
    sys.exit(main())
