"""The exit codes of deepy.py and train.py, for people and for schedulers (docs/launch.md has the table).

deepy.py returns the ranks' code: the local launcher waits for its ranks, the slurm and hostfile
launchers replace deepy by `srun` / `deepspeed`, which return their tasks' highest code.
"""
from __future__ import annotations

import signal

SUCCESS = 0
INTERNAL_ERROR = 1  # a bug: one line, NEOX_DEBUG=1 for the traceback
USAGE_ERROR = 2  # a mistake the message explains: config, data, checkpoint folder, full disk
LAUNCHER_GONE = 3  # a rank whose launcher died (deepy killed; under srun, its slurmstepd): megatron/launch/rank_guard.py
# EX_TEMPFAIL (sysexits.h): stopped by SIGTERM/SIGUSR1 before train_iters, with a checkpoint saved;
# run again with `load` = `save` to continue. The job scripts requeue themselves on it.
STOPPED_SAVED = 75
# Stopped the same way but that step was not saved (no `save` folder, or the trainer declined to
# save it): the shell's code for a process killed by SIGTERM, which no job script requeues. Under
# srun --kill-on-bad-exit=1 a failed rank's peers are SIGTERMed and srun returns the highest code, so
# one rank's 1 or 2 also comes back as 143 (docs/launch.md, "Exit codes").
STOPPED_UNSAVED = 128 + signal.SIGTERM
# A rank exiting with one of these finished cleanly (the launcher waits for the others, no "failed").
STOP_CODES = (STOPPED_SAVED, STOPPED_UNSAVED)
