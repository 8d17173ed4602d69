"""Process-level set-up: rank and device from the launcher's environment, the process group, the
topology and the engine. Everything built here is returned and passed on — no module globals."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.config import ConfigError, world_size_of
from megatron.topology.device_binding import warn_if_gcd_pairs_broken


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    extras: dict = field(default_factory=dict)  # topology, groups, communicator when distributed

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.barrier()  # no rank tears down while a peer still talks to it (gloo aborts otherwise)
            dist.destroy_process_group()


def _env_int(*names: str, default: int) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def pick_device(requested: str, local_rank: int) -> torch.device:
    has_gpu = torch.cuda.is_available()
    if requested == "auto":
        requested = "cuda" if has_gpu else "cpu"
    if requested == "cuda":
        if not has_gpu:
            raise ConfigError("training.device is 'cuda' but no GPU is visible on this machine; "
                              "set `device: cpu` (or `auto`) to train on the CPU")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    if requested != "cpu":
        raise ConfigError(f"training.device must be auto, cpu or cuda, not {requested!r}")
    return torch.device("cpu")


def launched_as() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun-style or Slurm variables; (0, 1, 0) when alone."""
    return (_env_int("RANK", "SLURM_PROCID", default=0), _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1),
            _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0))


def init_runtime(cfg) -> Runtime:
    """Read rank/world size from torchrun-style or Slurm variables and join the process group."""
    rank, world_size, local_rank = launched_as()
    expected = world_size_of(cfg)
    if world_size != expected:
        raise ConfigError(f"the configured layout has {expected} ranks but {world_size} processes were "
                          "started; launch with `python deepy.py train.py ...` or fix `topology`")
    device = pick_device(cfg.training.device, local_rank)
    runtime = Runtime(rank=rank, world_size=world_size, local_rank=local_rank, device=device)
    if world_size > 1:
        backend = cfg.launcher.distributed_backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=600))
        # Split GCD pairs only slow training down, so this warns (ROCm only) and never stops it.
        warn_if_gcd_pairs_broken(cfg, runtime)
    return runtime
