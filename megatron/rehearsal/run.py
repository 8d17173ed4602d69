"""One rehearsal process: rank R of the config's whole world on the fake backend (fake_world.py), the
real build, steps, save and load, each measured (docs/rehearsal.md). ``rehearse`` returns a JSON-able
dict; tools/rehearse.py runs one process per configuration and compares them with the models.

What is measured, in the order it happens:

- start-up: joining the process group, building every group the rank would build, the data's
  sample index (on a synthetic corpus of the config's vocabulary: rank R does rank 0's part), the
  model build (the model on meta, each unit made real, its shards kept: per unit), the first step;
- memory (``cpu``/``cuda``): each phase's peak (the CPU allocator's, by trace; the GPU's
  allocation), build, step, save, load;
- host time (``meta``: no compute, so the wall time is the host's): per micro-step the engine's
  forward-backward against the same model's forward-backward without the engine (the difference is
  the engine's own cost), the optimizer step, and the trainer's rest of a step; beside them the
  micro-step's CPU time (this thread's) and the hypervisor's steal share of the machine while the
  steps ran, which tell a slow sitting of a VM from slow code;
- collectives issued per step by (op, group kind), the ledger's bytes per (phase, tier), and what
  makes the host wait (megatron/logging/host_syncs.py) per micro-step, optimizer step and trainer;
- the checkpoint: the files this rank wrote (its rank file; the commit's files, done for the absent
  rank 0), their bytes, and the files the load opened.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from megatron.analytic.model_inputs import padded_vocab_of
from megatron.build import build_engine, freeze_build_objects
from megatron.checkpointing.checkpointer import Checkpointer
from megatron.config import world_size_of
from megatron.data import build_datasets
from megatron.engine.setup import layout_from_config
from megatron.logging.host_syncs import HostSyncs
from megatron.logging.memory import PhasePeaks
from megatron.model import GPTNeoX
from megatron.rehearsal.fake_world import RehearsalError, join_fake_world, synthetic_corpus
from megatron.rehearsal.host_clock import HostClock
from megatron.rehearsal.meta_device import answers_reads
from megatron.rehearsal.predict import predictions
from megatron.runtime import Runtime
from megatron.topology import ProcessGroups, Topology
from megatron.topology.names import GROUP_KINDS
from megatron.training import Trainer

NO_PIECES = {"pieces": [], "per_rank": []}  # an absent rank's index entry: its file is not in the rehearsal


@dataclasses.dataclass(frozen=True)
class Settings:
    """One rehearsal process."""
    rank: int
    device: str = "meta"       # meta (host time, placement, syncs), cpu (memory), cuda (a GPU's memory)
    steps: int = 3             # timed optimizer steps after the first
    work_dir: Path = Path("rehearsal")
    allocator: bool = True     # cpu: each phase's peak from the allocator's trace, not the resident set


def rehearse(cfg, settings: Settings) -> dict:
    """Rank ``settings.rank`` of ``cfg``'s world, measured (module docstring)."""
    device = torch.device(settings.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RehearsalError("--device cuda, but torch sees no GPU")
    meta = device.type == "meta"
    with answers_reads() if meta else contextlib.nullcontext():
        return _rehearse(cfg, settings, device)


def _clock() -> float:
    return time.perf_counter()


def _rehearse(cfg, settings: Settings, device: torch.device) -> dict:
    rank, world = settings.rank, world_size_of(cfg)
    work = Path(settings.work_dir)
    startup: dict[str, float] = {}
    t = _clock()
    join_fake_world(rank, world)
    startup["process group"] = _clock() - t

    t = _clock()
    cfg, layout, _plan = layout_from_config(cfg, world)
    topology = Topology.from_config(cfg, world)
    groups = ProcessGroups.build(topology, layout)
    startup["groups"] = _clock() - t

    vocab = padded_vocab_of(cfg)
    if vocab is None:
        raise RehearsalError("the config names no vocabulary size: set vocab_size (or a readable vocab_file)")
    tokenizer_vocab = cfg.tokenizer.vocab_size or vocab
    tcfg = cfg.training
    global_batch = tcfg.train_batch_size  # micro x accumulation x ranks, derived once by validation
    samples = (settings.steps + 2) * global_batch  # the first step, the timed ones, the counted one
    t = _clock()
    corpus = synthetic_corpus(work / "data" / f"synthetic_{tokenizer_vocab}", tokenizer_vocab,
                              tokens=samples * cfg.model.seq_length + 4096, seed=cfg.data.seed)
    startup["synthetic corpus"] = _clock() - t
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, data_path=str(corpus), train_data_paths=None,
                                                            split="1,0,0"))
    t = _clock()
    train_data, _valid, _test = build_datasets(cfg, tokenizer_vocab, samples, 0, cache_dir=str(work / "index"))
    startup["data index"] = _clock() - t

    runtime = Runtime(rank=rank, world_size=world, local_rank=rank % topology.ranks_per_node, device=device)
    trace = settings.allocator and device.type == "cpu"
    memory = PhasePeaks(device, trace_allocator=trace)
    unit_starts: list[float] = []
    t = _clock()
    with memory.phase("build"):
        torch.manual_seed(cfg.data.seed)
        with torch.device("meta"):
            model = GPTNeoX(cfg.model, vocab)
        engine = build_engine(cfg, model, runtime, groups=groups, on_unit=lambda i: unit_starts.append(_clock()))
    built = _clock()
    startup["model build"] = built - t
    unit_s = [b - a for a, b in zip(unit_starts, unit_starts[1:] + [built])]

    trainer = Trainer(cfg, runtime, engine, train_data, None, memory=memory)
    trainer.checkpointer = Checkpointer(cfg.checkpoint.save, rank=rank, world_size=world, barrier=runtime.barrier,
                                        commits=True)  # rank 0's part too: it is not here
    calls = _Timed(engine)
    t = _clock()
    with memory.phase("step"):
        trainer.train_step()
    startup["first step"] = _clock() - t
    freeze_build_objects()  # as Trainer.fit does after its first step
    engine.synced_ledger()

    step_s, issued, ledgers = [], [], []
    calls.reset()
    ticks = cpu_ticks()
    rules, engine.comm.rules = engine.comm.rules, None  # timed as a job runs: NCCL's rules were checked above
    for _ in range(settings.steps):
        before = dict(engine.comm.issued)
        t = _clock()
        with memory.phase("step"):
            trainer.train_step()
        step_s.append(_clock() - t)
        issued.append(_issued_since(engine.comm, before))
        ledgers.append(engine.synced_ledger())
    engine.comm.rules = rules
    steal = steal_share(ticks, cpu_ticks())
    timed = {"micro step": calls.times["forward_backward"], "optimizer step": calls.times["optimizer_step"],
             "micro step cpu": calls.cpu["forward_backward"],
             "train step": step_s, "engine in micro step": calls.engine_own["forward_backward"],
             "backend in micro step": calls.backend["forward_backward"],
             "kernels in micro step": calls.kernels["forward_backward"],
             "backend in optimizer step": calls.backend["optimizer_step"],
             "kernels in optimizer step": calls.kernels["optimizer_step"]}
    syncs = _count_syncs(trainer, calls)
    baseline = _model_only_micro_steps(cfg, vocab, engine, device, settings.steps) if device.type == "meta" else None
    checkpoint = _save_and_load(trainer, engine, memory, rank, world, Path(cfg.checkpoint.save))
    calls.restore()
    return {"predicted": predictions(cfg, vocab, layout, rank, device.type),
        "rank": rank, "world_size": world, "device": device.type, "preset": layout.preset,
        "factors": list(layout.factors.as_tuple()), "layers": cfg.model.num_layers, "vocab": vocab,
        "seq_length": cfg.model.seq_length, "micro_batch": tcfg.train_micro_batch_size_per_gpu,
        "accumulation": tcfg.gradient_accumulation_steps, "precision": cfg.precision.precision,
        "quantized": engine.quant.summary() if engine.quant.enabled else "",
        "units": len(engine.units), "unit_numels": [u.numel for u in engine.units],
        "startup_s": startup, "unit_build_s": unit_s,
        "host_s": {name: statistics.median(v) for name, v in timed.items() if v}, "steal_share": steal,
        "model_only_micro_step_s": baseline,
        "collectives_per_step": _stable(issued), "ledger_per_step": _ledger_json(_stable(ledgers)),
        "host_syncs": syncs, "memory": _memory_json(memory, trace), "checkpoint": checkpoint,
    }


class _Timed:
    """The engine's forward_backward and optimizer_step timed per call (instance attributes that
    shadow the methods; ``restore`` removes them): the wall time, the engine's own share and the
    backend's (host_clock.HostClock) and, when ``counting``, each call under its own HostSyncs."""

    NAMES = ("forward_backward", "optimizer_step")

    def __init__(self, engine):
        self.engine = engine
        self.clock = HostClock(engine)
        self.counting = False
        for name in self.NAMES:
            setattr(engine, name, self._wrap(name, getattr(engine, name)))
        self.reset()

    def _wrap(self, name: str, method: Callable) -> Callable:
        def timed(*args, **kwargs):
            counter = HostSyncs() if self.counting else contextlib.nullcontext()
            engine_s, backend_s, kernels_s = self.clock.engine_s, self.clock.backend_s, self.clock.kernels_s
            t, cpu = _clock(), time.thread_time()
            with counter:
                out = method(*args, **kwargs)
            self.times[name].append(_clock() - t)
            self.cpu[name].append(time.thread_time() - cpu)
            backend, kernels = self.clock.backend_s - backend_s, self.clock.kernels_s - kernels_s
            self.backend[name].append(backend)
            self.kernels[name].append(kernels)
            self.engine_own[name].append(self.clock.engine_s - engine_s - backend - kernels)
            if self.counting:
                self.syncs[name].append(dict(counter.by_kind))
            return out
        return timed

    def reset(self) -> None:
        self.times = {name: [] for name in self.NAMES}
        self.cpu = {name: [] for name in self.NAMES}  # this thread's CPU time: the wall less what the VM took
        self.engine_own = {name: [] for name in self.NAMES}
        self.backend = {name: [] for name in self.NAMES}
        self.kernels = {name: [] for name in self.NAMES}
        self.syncs = {name: [] for name in self.NAMES}

    def restore(self) -> None:
        for name in self.NAMES:
            delattr(self.engine, name)
        self.clock.restore()


def cpu_ticks() -> Optional[list[int]]:
    """The machine's CPU time so far by state (/proc/stat's first line, in ticks); None off Linux."""
    try:
        return [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None


def steal_share(before: Optional[list[int]], after: Optional[list[int]]) -> Optional[float]:
    """The share of the machine's CPU time the hypervisor gave to other guests between two readings
    (``steal``, /proc/stat's eighth state): a VM's slow sittings, told apart from the code's."""
    if before is None or after is None or len(before) < 8:
        return None
    spent = [b - a for a, b in zip(before[:8], after[:8])]  # guest time is inside user time already
    return spent[7] / sum(spent) if sum(spent) else 0.0


def _count_syncs(trainer: Trainer, calls: _Timed) -> dict:
    """One more step, each call under HostSyncs: the waits per micro-step, optimizer step and the
    trainer's rest of the step (collate, the step vector), by kind."""
    calls.reset()
    calls.counting = True
    with HostSyncs() as whole:
        trainer.train_step()
    calls.counting = False
    micro = calls.syncs["forward_backward"]
    optimizer = calls.syncs["optimizer_step"][0]
    trainer_own = {k: whole.by_kind[k] - sum(m[k] for m in micro) - optimizer[k] for k in whole.by_kind}
    return {"micro step": micro[0], "optimizer step": optimizer, "trainer": trainer_own,
            "per step": whole.count}


def _model_only_micro_steps(cfg, vocab: int, engine, device: torch.device, repeats: int) -> float:
    """The same model's forward-backward on the same device without the engine (no units, no hooks,
    no collectives): the compute's and autograd's own host time, median of ``repeats`` + 1 runs."""
    with torch.device("meta"):
        model = GPTNeoX(cfg.model, vocab)
    model = model.to_empty(device=device).to(engine.dtype)
    model.init_buffers()
    tcfg = cfg.training
    shape = (tcfg.train_micro_batch_size_per_gpu, cfg.model.seq_length)
    batch = {"tokens": torch.zeros(shape, dtype=torch.long, device=device),
             "labels": torch.zeros(shape, dtype=torch.long, device=device)}
    times = []
    for _ in range(repeats + 1):
        t = _clock()
        engine.loss_fn(model, batch).backward()
        times.append(_clock() - t)
        for p in model.parameters():
            p.grad = None
    return statistics.median(times[1:] or times)


def _save_and_load(trainer: Trainer, engine, memory: PhasePeaks, rank: int, world: int, save_dir: Path) -> dict:
    """The trainer's save and resume. The piece lists still travel by the engine's all-gather (its
    collectives counted; not on meta, where it cannot unpickle what it gathers: meta_device.py), but
    the index lists this rank's pieces only: the others' files are absent. A save whose host pieces
    would not fit half this machine's memory is not rehearsed (hsdp's 1/8 optimizer slice at 20B:
    31 GB), and the result says so."""
    pieces = sum(3 * u.master.numel() * 4 + sum(r.numel() * 4 for r in u.residuals.values()) for u in engine.units)
    memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if pieces > memory_bytes // 2:
        return {"skipped": f"the save's {pieces / 1e9:.1f} GB of host pieces exceed half of this machine's "
                           f"{memory_bytes / 1e9:.0f} GB", "piece_bytes": pieces}
    real_gather = engine.gather_objects

    def gather(entry):
        if engine.device.type != "meta":
            real_gather(entry)
        return [entry if r == rank else NO_PIECES for r in range(world)]
    engine.gather_objects = gather
    before = dict(engine.comm.issued)
    t = _clock()
    trainer.save()
    save_s = _clock() - t
    del engine.gather_objects
    save_collectives = _issued_since(engine.comm, before)
    step_dir = save_dir / f"global_step{trainer.iteration}"
    files = {p.name: p.stat().st_size for p in sorted(step_dir.iterdir())}
    out = {"files": files, "bytes": sum(files.values()), "save_s": save_s, "save_collectives": save_collectives}
    replica = engine.groups.replica
    if replica.index(rank) != 0:  # its slices are in the first replica's files (state_io), absent here
        out["load_skipped"] = f"rank {rank} reads rank {replica.ranks[0]}'s file, which a rehearsal of rank {rank} lacks"
        return out
    t = _clock()
    with memory.phase("load"):
        trainer.resume(str(save_dir))
    return {**out, "load_s": _clock() - t}


def _issued_since(comm, before: dict) -> dict[str, int]:
    """{"op/kind": collectives issued since ``before`` (a copy of ``comm.issued``)}, each group named
    by the last kind with the same members (``predict.group_label``: zeropp's and zero3's weight group
    is the world)."""
    groups = comm.groups
    label = {kind: next(k for k in reversed(GROUP_KINDS) if getattr(groups, k).ranks == getattr(groups, kind).ranks)
             for kind in GROUP_KINDS}
    out: dict[str, int] = {}
    for (op, kind), n in comm.issued.items():
        if n - before.get((op, kind), 0):
            key = f"{op}/{label[kind]}"
            out[key] = out.get(key, 0) + n - before.get((op, kind), 0)
    return out


def _stable(per_step: list[dict]) -> dict:
    """The value every timed step had (they must agree: a step is a step)."""
    first = per_step[0]
    if any(other != first for other in per_step[1:]):
        raise RehearsalError(f"steps differ: {per_step}")
    return first


def _ledger_json(ledger: dict) -> dict:
    return {f"{phase}/{tier}": n for (phase, tier), n in ledger.items() if n}


def _memory_json(memory: PhasePeaks, traced: bool) -> Optional[dict]:
    """Each phase's measured peak: the allocator's (traced CPU run), the GPU's, or None (meta)."""
    if traced:
        return memory.allocator.peaks()
    if memory.device is not None and memory.device.type == "cuda":
        return dict(memory.device_peak)
    return None
