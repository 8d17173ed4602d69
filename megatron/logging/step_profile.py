"""Where one training step's time goes: the step run once under torch.profiler, the time of what it
ran summed by kind of work (matmul, attention, optimizer, ...), beside the step's wall time.

On a GPU the events counted are the device's kernels, memory copies and memsets: their sum per kind
says what the device spent its time on, the union of their intervals how long it was busy, and the
rest of the step's wall time is the device *idle* (waiting for the host to launch, or for a host
sync). The host syncs inside the step (``cuda*Synchronize`` / ``hip*Synchronize`` and blocking
copies, from the runtime's events) and the kernel launches are counted too. On a CPU the events are
the aten ops and gloo's collectives (spans on threads of gloo's own), each counted by its *self*
time (its duration less that of the events it encloses), so the kinds add up to the busy time where
one thread works at a time, and the idle is the Python between the ops, hooks included (the
autograd engine's wrappers, in which hooks run, are left out: a wait for a collective inside a
hook is not compute).

*Exposed communication* is the time in which a collective runs and nothing else does: the busy time
less the union of every event that is not communication. A collective hidden behind compute (the
engine's prefetched gathers, its overlapped reductions) costs nothing there; a blocking one costs
its whole length.

Kinds are told by name, the first match in ``CATEGORIES`` winning (so a flash-attention kernel
built with cutlass is attention, not matmul); what matches none is ``other``, and the largest names
are listed so that the next reader can see what it is. Kernel names of CUDA, ROCm, cuBLAS, cuDNN,
flash-attention and Triton (torch.compile's kernels are ``triton_*``: their own kind, ``compiled``)
and aten op names are both covered.
"""
from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from megatron.logging.host_syncs import HOST_READ_OPS

STEP_MARK = "neox_topo.profiled_step"

# (kind, substrings of a lower-cased kernel or op name), first match wins.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Collectives: NCCL/RCCL kernels on a GPU; on a CPU, gloo's work (spans on its own threads,
    # whatever runs inside them included) and the c10d ops that hand it over.
    ("communication", ("nccl", "rccl", "gloo:", "c10d::", "record_param_comms")),
    # The engine's INT8/INT4 block codecs: Triton kernels on a GPU, the C++ ops on a CPU.
    ("quantization", ("neox_quant::", "quantize", "_reduce8_kernel", "_reduce4_kernel", "_hadamard_kernel")),
    # torch.compile's kernels next: inductor names a fused kernel after the ops it holds, which may
    # include "attention" or "gemm" for the copies around them.
    ("compiled", ("triton_", "compiledfxgraph", "compiled region", "compiledfunction")),
    ("attention", ("flash", "fmha", "sdpa", "scaled_dot_product", "attention", "attn", "bwd_kernel_d")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitkreduce", "cijk_", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::baddbmm")),
    ("optimizer", ("adam", "multi_tensor_apply", "foreach", "lpnorm", "vector_norm", "clip_grad")),
    ("layernorm", ("layer_norm", "layernorm", "gammabeta")),
    ("loss", ("softmax", "nll_loss", "cross_entropy")),
    ("embedding", ("embedding", "indexselect", "index_select")),
    ("elementwise", ("elementwise", "memcpy", "memset", "copy", "gelu", "fill", "aten::cat", "catarray", "aten::add",
                     "aten::mul", "aten::div", "aten::sub", "aten::neg", "aten::where", "aten::clamp")),
)
KINDS = tuple(kind for kind, _ in CATEGORIES) + ("other",)

DEVICE_EVENTS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_EVENTS = frozenset({"cpu_op"})
# gloo runs each collective on a thread of its own, marked by a span ("gloo:all_reduce", ...).
HOST_COMM_SPAN_PREFIXES = ("gloo:",)
# The autograd engine's wrappers around each node: their own time is the Python hooks run there
# (a sharded engine's gathers and reductions, and its waits for them), not an op's work. Left out
# on a host, as a GPU trace leaves out the host, so a wait inside a hook is idle or exposed
# communication, not compute; the ops they call still count.
HOST_WRAPPER_PREFIXES = ("autograd::engine::", "torch::autograd::")
RUNTIME_EVENTS = frozenset({"cuda_runtime", "cuda_driver"})
# Calls that make the host wait for the device: synchronizes, and the blocking (non-Async) copies.
BLOCKING_CALLS = ("cudaMemcpy", "hipMemcpy", "cudaMemcpy2D", "hipMemcpy2D")
# aten ops that hand a tensor's value to the host (``.item()``, ``float(t)``, ``bool(t)``,
# ``torch.equal``): on a GPU each waits for the device. Counted on a CPU too, where they cost
# nothing, so a CPU run shows the syncs a GPU run would have. Not seen there: ``.tolist()`` and
# ``.cpu()``, which dispatch nothing for a tensor already on the host.
# What calls them from Python; a read inside any other aten op is that kernel's own business on a
# CPU (torch's fused AdamW reads its step counts there, on a GPU it keeps them on the device).
READ_WRAPPERS = frozenset({"aten::item", "aten::is_nonzero", *HOST_READ_OPS})


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, needles in CATEGORIES:
        if any(needle in lowered for needle in needles):
            return kind
    return "other"


def is_host_sync(name: str) -> bool:
    return name.endswith("Synchronize") or name in BLOCKING_CALLS


@dataclass
class StepBreakdown:
    """One profiled step. Times in milliseconds; ``by_kind`` adds up to ``busy_ms`` where nothing runs
    in parallel (one stream on a device, one thread on a host), and to more where things do."""
    on_device: bool
    step_ms: float
    busy_ms: float
    by_kind: dict = field(default_factory=dict)
    events: int = 0
    exposed_comm_ms: float = 0.0  # communication alone: busy, less the union of everything else
    host_syncs: int = 0  # the device's sync calls; on a host, the ops that would be (HOST_READ_OPS)
    top: list = field(default_factory=list)  # [kind, name, ms, calls] of the largest names

    @property
    def idle_ms(self) -> float:
        return max(self.step_ms - self.busy_ms, 0.0)

    def as_dict(self) -> dict:
        return {"on_device": self.on_device, "step_ms": self.step_ms, "busy_ms": self.busy_ms,
                "idle_ms": self.idle_ms, "by_kind": self.by_kind, "events": self.events,
                "exposed_comm_ms": self.exposed_comm_ms, "host_syncs": self.host_syncs, "top": self.top}


def self_times(events: list[dict]) -> list[float]:
    """Each complete event's duration less that of the events nested in it on the same thread
    (pid, tid): an op's own time, its callees' excluded. Events are chrome-trace dicts (ts, dur in us)."""
    return _own_times(events, enclosing(events))


def _own_times(events: list[dict], parents: list[Optional[int]]) -> list[float]:
    own = [float(e["dur"]) for e in events]
    for i, parent in enumerate(parents):
        if parent is not None:
            own[parent] -= events[i]["dur"]
    return [max(t, 0.0) for t in own]


def enclosing(events: list[dict]) -> list[Optional[int]]:
    """The index of the innermost event that encloses each event on its thread (pid, tid), or None."""
    parents: list[Optional[int]] = [None] * len(events)
    by_thread = defaultdict(list)
    for i, e in enumerate(events):
        by_thread[(e.get("pid"), e.get("tid"))].append(i)
    for indices in by_thread.values():
        indices.sort(key=lambda i: (events[i]["ts"], -events[i]["dur"]))
        open_ends: list[tuple[float, int]] = []  # (end, index) of the enclosing events, innermost last
        for i in indices:
            start = events[i]["ts"]
            while open_ends and start >= open_ends[-1][0]:
                open_ends.pop()
            if open_ends:
                parents[i] = open_ends[-1][1]
            open_ends.append((start + events[i]["dur"], i))
    return parents


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def breakdown(trace_events: list[dict], on_device: bool, top: int = 12) -> StepBreakdown:
    """The step marked ``STEP_MARK`` in a chrome trace's events, broken down (see the module doc)."""
    # The host's span (on a GPU the device's timeline repeats it as a "gpu_user_annotation").
    marks = [e for e in trace_events
             if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") == STEP_MARK]
    if len(marks) != 1:
        raise ValueError(f"the trace holds {len(marks)} '{STEP_MARK}' spans; expected one")
    begin, end = marks[0]["ts"], marks[0]["ts"] + marks[0]["dur"]

    def timed(e: dict) -> bool:
        if e.get("ph") != "X" or not begin <= e["ts"] < end:
            return False
        if on_device:
            return e.get("cat") in DEVICE_EVENTS
        if e.get("cat") == "user_annotation":
            return e["name"].startswith(HOST_COMM_SPAN_PREFIXES)
        return e.get("cat") in HOST_EVENTS and not e["name"].startswith(HOST_WRAPPER_PREFIXES)
    events = [e for e in trace_events if timed(e)]
    parents = enclosing(events)
    own = _own_times(events, parents)
    kinds = [kind_of(e["name"]) for e in events]
    # What runs inside a collective's span is the collective's (gloo's copies): parents first.
    for i in sorted(range(len(events)), key=lambda i: (events[i]["ts"], -events[i]["dur"])):
        if parents[i] is not None and kinds[parents[i]] == "communication":
            kinds[i] = "communication"
    by_kind = dict.fromkeys(KINDS, 0.0)
    by_name: dict[tuple[str, str], list] = {}
    for e, us, kind in zip(events, own, kinds):
        by_kind[kind] += us / 1e3
        entry = by_name.setdefault((kind, e["name"]), [kind, e["name"], 0.0, 0])
        entry[2] += us / 1e3
        entry[3] += 1

    def span(e: dict) -> tuple[float, float]:
        return e["ts"], min(e["ts"] + e["dur"], end)
    busy = union_us([span(e) for e in events])
    exposed = busy - union_us([span(e) for e, kind in zip(events, kinds) if kind != "communication"])
    if on_device:
        syncs = sum(1 for e in trace_events if e.get("ph") == "X" and e.get("cat") in RUNTIME_EVENTS
                    and begin <= e["ts"] < end and is_host_sync(e["name"]))
    else:
        syncs = sum(1 for i, e in enumerate(events) if e["name"] in HOST_READ_OPS and _read_by_python(i, events, parents))
    largest = sorted(by_name.values(), key=lambda entry: -entry[2])[:top]
    return StepBreakdown(on_device=on_device, step_ms=(end - begin) / 1e3, busy_ms=busy / 1e3, by_kind=by_kind,
                         events=len(events), exposed_comm_ms=exposed / 1e3, host_syncs=syncs,
                         top=[[k, n[:160], ms, c] for k, n, ms, c in largest])


def _read_by_python(i: int, events: list[dict], parents: list[Optional[int]]) -> bool:
    """Whether host read ``i`` was asked for by Python code (under no aten op but its wrappers)."""
    parent = parents[i]
    while parent is not None:
        name = events[parent]["name"]
        if name.startswith("aten::") and name not in READ_WRAPPERS:
            return False
        parent = parents[parent]
    return True


def read_trace(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        data = json.load(handle)
    return data["traceEvents"] if isinstance(data, dict) else data


def profile_step(run: Callable[[], object], device: torch.device, trace_path: Optional[str] = None) -> StepBreakdown:
    """Run ``run()`` (one whole step, ending in whatever host read the loop does) once under the
    profiler and break it down; the chrome trace is kept at ``trace_path`` (``.json`` or ``.json.gz``)
    when given. The device is synchronized before the step and inside the profile after it, so every
    kernel the step queued is in the trace."""
    on_device = device.type == "cuda"  # ROCm builds report their GPUs as "cuda" too
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    if on_device:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        with record_function(STEP_MARK):
            run()
        if on_device:
            torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as scratch:
        path = trace_path or os.path.join(scratch, "step.json")
        prof.export_chrome_trace(path)
        return breakdown(read_trace(path), on_device)


def breakdown_table(rows: list[tuple[str, StepBreakdown]]) -> str:
    """A markdown table, a row per profiled step: ms per kind, busy, idle, exposed communication,
    events and host syncs."""
    head = ["row", "step ms", *KINDS, "busy ms", "idle ms", "exposed comm ms", "events", "host syncs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, b in rows:
        cells = [name, f"{b.step_ms:.1f}", *(f"{b.by_kind[k]:.1f}" for k in KINDS), f"{b.busy_ms:.1f}",
                 f"{b.idle_ms:.1f}", f"{b.exposed_comm_ms:.1f}", str(b.events), str(b.host_syncs)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


class ProfiledSteps:
    """GPT-NeoX's ``profile`` keys in the training loop: which steps are profiled, and what each one
    leaves behind. Every rank writes its own trace and breakdown (no collective, so the byte ledger
    and the step's syncs are the same as unprofiled); rank 0's breakdown goes to the metrics."""

    def __init__(self, log_dir: str, start: int, stop: int, rank: int, device: torch.device):
        self.folder = os.path.join(log_dir, "profile")
        self.start, self.stop, self.rank, self.device = start, stop, rank, device

    def covers(self, iteration: int) -> bool:
        return self.start <= iteration < self.stop

    def trace_path(self, iteration: int, rank: int | str) -> str:
        rank_text = rank if isinstance(rank, str) else f"{rank:05d}"
        return os.path.join(self.folder, f"step_{iteration:07d}_rank_{rank_text}.json.gz")

    def run(self, iteration: int, step: Callable[[], dict]) -> tuple[dict, StepBreakdown]:
        """``step()``'s metrics and its breakdown; the trace and the breakdown as JSON are on disk."""
        os.makedirs(self.folder, exist_ok=True)
        out: dict = {}
        trace = self.trace_path(iteration, self.rank)
        result = profile_step(lambda: out.update(step()), self.device, trace)
        with open(trace[:-len(".json.gz")] + ".breakdown.json", "w") as handle:
            json.dump({"iteration": iteration, "rank": self.rank, **result.as_dict()}, handle, indent=1)
        return out, result

    @staticmethod
    def metrics(result: StepBreakdown) -> dict:
        """``profile/...`` metrics: ms per kind, busy, idle, exposed communication, events, host syncs."""
        out = {f"profile/{kind}_ms": ms for kind, ms in result.by_kind.items()}
        out.update({"profile/step_ms": result.step_ms, "profile/busy_ms": result.busy_ms,
                    "profile/idle_ms": result.idle_ms, "profile/exposed_comm_ms": result.exposed_comm_ms,
                    "profile/events": result.events, "profile/host_syncs": result.host_syncs})
        return out

    def line(self, iteration: int, result: StepBreakdown) -> str:
        """One log line: the step's time, busy and idle, then the kinds that took time, largest first."""
        kinds = sorted(((ms, kind) for kind, ms in result.by_kind.items() if ms >= 0.05), reverse=True)
        where = "device" if result.on_device else "host"
        syncs = f", {result.host_syncs} host {'syncs' if result.on_device else 'reads'}"
        return (f"profile step {iteration} (rank {self.rank}, {where}): {result.step_ms:.1f} ms, busy "
                f"{result.busy_ms:.1f}, idle {result.idle_ms:.1f}, exposed communication "
                f"{result.exposed_comm_ms:.1f}{syncs} | " + ", ".join(f"{kind} {ms:.1f}" for ms, kind in kinds)
                + f" | traces {self.trace_path(iteration, '*')}")
