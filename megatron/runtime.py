"""Process-level set-up: rank and device from the launcher's environment, the process group, the
topology and the engine. Everything built here is returned and passed on — no module globals.

Two clocks bound how long a rank waits for the others (docs/launch.md, "Timeouts"):

- collectives (and the rendezvous at start-up) give up after ``distributed_timeout_minutes``; under
  NCCL the watchdog then ends the process;
- work that rank 0 does alone while the others wait for its result (the demo corpus, the data's
  sample and blend indices and digest) is not a collective: :meth:`Runtime.on_rank_zero` runs it on
  rank 0 and hands its result, or its error, to the other ranks through the rendezvous store, where
  they wait up to :data:`RANK_ZERO_WAIT` (24 h). A build longer than the collective timeout (the
  Pile's sample index) therefore cannot trip it.
"""
from __future__ import annotations

import inspect
import os
import pickle
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Mapping, Optional, TypeVar

import torch
import torch.distributed as dist

from megatron.config import ConfigError, world_size_of
from megatron.topology.device_binding import warn_if_gcd_pairs_broken

T = TypeVar("T")
# How long the other ranks wait for rank 0's work (on the store, not in a collective): longer than
# any index build, short enough that a rank 0 that hangs without dying does not hold a job forever.
RANK_ZERO_WAIT = timedelta(hours=24)
# How long a failing rank 0 keeps the store (it hosts the TCPStore server) up for the others to read
# its error, and how long those wait for it to leave before they do (so the launcher names rank 0).
ERROR_HANDOFF = timedelta(seconds=60)


class RankZeroError(RuntimeError):
    """Work this rank was waiting for failed on the rank doing it (or that rank was lost); the
    message is that rank's error in one line."""


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    extras: dict = field(default_factory=dict)  # topology, groups, communicator when distributed
    # A client of the rendezvous store of its own (init_runtime), for on_rank_zero: its long waits
    # never hold up the process group's use of the store (a TCPStore client serves one call at a time).
    store: Optional[dist.Store] = None
    _shared_calls: int = field(default=0, init=False, repr=False)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(**barrier_kwargs(dist.get_backend(), self.device))

    def on_rank_zero(self, what: str, fn: Callable[[], T], *, per_node: bool = False) -> T:
        """``fn()`` on rank 0, its result on every rank; the others wait on the store (up to
        :data:`RANK_ZERO_WAIT`), not in a collective, so the collective timeout does not bound ``fn``.

        ``what`` says what ``fn`` does ("build the train sample index of X"): the other ranks' error
        when it fails. The result must be small and picklable (a path, a few numbers): large data goes
        through files that ``fn`` writes. Every rank must make the same calls in the same order.
        ``per_node``: each node's local rank 0 runs ``fn`` for its node instead (a cache folder that is
        not shared between nodes; a node's ranks must be consecutive, as under block distribution).
        One process: just ``fn()``.
        """
        if not self.distributed:
            return fn()
        if self.store is None:
            raise RuntimeError("on_rank_zero needs the store init_runtime keeps; this Runtime has none")
        self._shared_calls += 1
        leader = self.rank - self.local_rank if per_node else 0
        return run_and_share(self.store, f"rank_zero/{self._shared_calls}", what, fn, rank=self.rank,
                             world_size=self.world_size, leader=leader)

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            self.barrier()  # no rank tears down while a peer still talks to it (gloo aborts otherwise)
            dist.destroy_process_group()


def run_and_share(store: dist.Store, key: str, what: str, fn: Callable[[], T], *, rank: int, world_size: int,
                  leader: int = 0, wait: timedelta = RANK_ZERO_WAIT, handoff: timedelta = ERROR_HANDOFF) -> T:
    """``fn()`` on rank ``leader``; every rank whose leader it is gets the result (pickled) through
    ``store`` under ``key``, waiting for it at most ``wait``. An exception in ``fn`` is raised as is
    on the leader and as a one-line :class:`RankZeroError` on the others; a leader lost before it
    published (its process died: rank 0 hosts a TCPStore, so its clients fail at once) is one too.

    Rank 0 serves the store, so a failing rank 0 waits (at most ``handoff``) until every other rank
    has reached this call, and those that read its error wait (as long) for it to leave before they
    raise: the launcher sees rank 0 fail first. Every rank but 0 counts itself in under
    ``<key>/arrived``; the last one sets ``<key>/all``.
    """
    result_key = f"{key}/result@{leader}"
    if rank == leader:
        try:
            result = fn()
            payload = pickle.dumps((what, True, result))  # an unpicklable result fails here, not elsewhere
        except BaseException as error:
            _quietly(store.set, result_key, pickle.dumps((what, False, _one_line(error))))
            _arrive(store, key, rank, world_size)
            if rank == 0:
                _wait_quietly(store, f"{key}/all", handoff)
            raise
        store.set(result_key, payload)
        _arrive(store, key, rank, world_size)
        return result
    try:
        store.wait([result_key], wait)
        leader_what, ok, value = pickle.loads(store.get(result_key))
    except RuntimeError as error:  # torch's DistError: timed out, or the leader (and its store) is gone
        raise RankZeroError(f"rank {leader} did not {what}: {_one_line(error)} (the other ranks wait "
                            f"up to {wait.total_seconds() / 3600:g} h for it)") from None
    finally:
        _arrive(store, key, rank, world_size)
    if leader_what != what:
        raise RuntimeError(f"ranks disagree on rank-0 work #{key}: rank {leader} did {leader_what!r}, "
                           f"rank {rank} expected {what!r}")
    if not ok:
        if leader == 0:
            _wait_quietly(store, f"{key}/rank0_left", handoff)  # never set: ends when rank 0's store does
        raise RankZeroError(f"rank {leader} failed to {what}: {value}")
    return value


def _arrive(store: dist.Store, key: str, rank: int, world_size: int) -> None:
    """Count this rank in (rank 0 never counts); the last to arrive sets ``<key>/all``."""
    if rank != 0 and _quietly(store.add, f"{key}/arrived", 1) == world_size - 1:
        _quietly(store.set, f"{key}/all", b"")


def _quietly(op: Callable, *args):
    """A store operation whose failure (the store is gone) changes nothing for the caller: None then."""
    try:
        return op(*args)
    except RuntimeError:  # torch's DistError
        return None


def _wait_quietly(store: dist.Store, key: str, timeout: timedelta) -> None:
    """Until ``key`` is set, the store is gone or ``timeout`` has passed, whichever comes first."""
    _quietly(store.wait, [key], timeout)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def process_group_kwargs(backend: str, device: torch.device, timeout: timedelta) -> dict:
    """init_process_group's keywords beyond the store: the timeout and, under NCCL (RCCL on ROCm) where
    torch accepts it (2.3+), ``device_id``, which binds the group to this rank's GPU and creates its
    communicators now rather than inside the first training step."""
    kwargs = {"timeout": timeout}
    if (backend == "nccl" and device.type == "cuda" and device.index is not None
            and "device_id" in inspect.signature(dist.init_process_group).parameters):
        kwargs["device_id"] = torch.device("cuda", device.index)
    return kwargs


def barrier_kwargs(backend: str, device: torch.device) -> dict:
    """dist.barrier's keywords: under NCCL the rank's GPU (otherwise NCCL guesses it from the rank
    number and warns); gloo takes none."""
    if backend == "nccl" and device.type == "cuda" and device.index is not None:
        return {"device_ids": [device.index]}
    return {}


def _env_int(env: Mapping[str, str], *names: str, default: int) -> int:
    """The first of `names` set to something in `env`; an empty value counts as unset (a job
    script's `WORLD_SIZE=` must not hide Slurm's SLURM_NTASKS), a value that is no number is one line."""
    for name in names:
        raw = (env.get(name) or "").strip()
        if raw:
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(f"environment variable {name}={env[name]!r} is not a number; "
                                  "unset it or give the rank count") from None
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


def launched_as(env: Optional[Mapping[str, str]] = None) -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun-style or, under srun, Slurm's variables
    (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID); (0, 1, 0) when alone. The one place a process
    learns it is a launched rank (train.py, tools/probe_links.py)."""
    env = os.environ if env is None else env
    return (_env_int(env, "RANK", "SLURM_PROCID", default=0), _env_int(env, "WORLD_SIZE", "SLURM_NTASKS", default=1),
            _env_int(env, "LOCAL_RANK", "SLURM_LOCALID", default=0))


SHOW_LAUNCH = "NEOX_TOPO_SHOW_LAUNCH"  # =1: every rank prints `launch_line` at start (docs/launch.md)


def launch_line(env: Mapping[str, str], rank: int, world_size: int, local_rank: int) -> str:
    """One rank's view of its launch, for checking a new cluster's job scripts:
    'launch: rank 3 of 4, local rank 1, node node2, rendezvous node1:20017'."""
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    return (f"launch: rank {rank} of {world_size}, local rank {local_rank}, node {node}, "
            f"rendezvous {env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}")


def init_runtime(cfg) -> Runtime:
    """Read rank/world size from torchrun-style or Slurm variables and join the process group.

    The rendezvous is torch's env:// (MASTER_ADDR, MASTER_PORT; rank 0 serves a TCPStore), done
    here so the store is kept: the process group uses it, and :meth:`Runtime.on_rank_zero` a clone
    of it (a connection of its own). ``launcher.distributed_timeout_minutes`` bounds the rendezvous
    and every collective."""
    rank, world_size, local_rank = launched_as()
    if os.environ.get(SHOW_LAUNCH) == "1":
        print(launch_line(os.environ, rank, world_size, local_rank), flush=True)
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
        timeout = timedelta(minutes=cfg.launcher.distributed_timeout_minutes)
        store, rank, world_size = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
        # As init_process_group does with a store it makes itself: its keys under a prefix of their own.
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                                world_size=world_size, **process_group_kwargs(backend, device, timeout))
        runtime.store = dist.PrefixStore("neox_topo", store.clone() if hasattr(store, "clone") else store)
        # Split GCD pairs only slow training down, so this warns (ROCm only) and never stops it.
        warn_if_gcd_pairs_broken(cfg, runtime)
    return runtime
