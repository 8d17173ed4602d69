#!/usr/bin/env python
"""Measure the figures the step-time model reads, on the running job (docs/time_model.md, "The probe").

    # on the three-tier emulated cluster: 2 nodes x 2 GPUs x 2 GCDs, one process per rank (the pair
    # on loopback, GPU links at --gpu-rate, node links at --rate; without --gpus-per-node every rank
    # of a node shares one loopback and the intra_gpu and intra_node fits measure the same thing)
    python tools/emulate_cluster.py --nodes 2 --gpus-per-node 2 --ranks-per-node 4 --rate 640mbit \\
        --gpu-rate 640mbit --command ".venv/bin/python tools/probe_links.py --layout 2 2 2 --out /tmp/probe.json"
    # on Frontier, inside an allocation of 8 nodes (after `source tools/slurm/frontier/env.sh`)
    srun -N 8 -n 64 -c7 --gpus-per-task=1 --gpu-bind=closest python tools/probe_links.py --layout 8 4 2 \\
        --dtype bf16 --model 2 6144 64 2048 50432 4 --out probe.json

Every rank runs it (env:// rendezvous). Rank, world size and local rank are read as the trainer reads
them (RANK / WORLD_SIZE / LOCAL_RANK, else srun's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID); under
srun MASTER_ADDR / MASTER_PORT default to the allocation's first host and the job's port, as deepy's
slurm launcher sets them; each rank takes the trainer's device (under --gpus-per-task=1, the one
GPU its task sees). For each tier it
makes the *band* groups (the ranks that differ only in that tier's digit: the GCD pairs, the GPUs of
a node, one rank per node) and times, in all of them at once and through the engine's own
``Communicator``, an all-gather, a reduce-scatter, an all-to-all and an all-reduce of a few buffer
sizes; a line ``steps x latency + load / bandwidth`` fitted to each (algorithm, tier) gives the
figures, with the load and steps the time model itself computes for those groups
(``time_model.footprint``), so the two read the same numbers. The same samples, and those of the
world ring and of qgZ's two all-to-all hops (the node group, then the rail: one rank per node), give
a curve per (algorithm, group shape) (``hardware.LinkCurve``: the domain's rate against the bytes of
one algorithm step), which the time model reads before the tier figures, so a probe of an allocation
replaces a published figure set (frontier-measured) with the machine's own. Then, with every rank at once: the
model's forward + backward (achieved FLOP/s), the AdamW update (elements/s), a quantize +
dequantize (elements/s), a local copy (bytes/s), and per tier the overlap efficiency (an all-gather in the tier's band
groups issued before a forward + backward: the share of min(compute, communication) that
disappeared). Last, the world and
node groups' all-gather and reduce-scatter are timed and set beside the fitted model's prediction
(``checks``). Rank 0 writes the JSON (format ``neox-topo-link-probe/1``) that ``topology.link_figures``,
``Hardware.with_probe`` and ``tools/plan.py --probe`` read.

On one device (``--layout 1 1``, WORLD_SIZE=1) only the device's rates are measured: the file then
replaces the preset's compute, optimizer and quantizer rates and keeps its links and overlap.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron.topology.layout import ShardLayout
from megatron.config.schema import ModelConfig
from megatron.topology import ProcessGroups, ShardFactors, Topology
from megatron.topology.groups import RankGroup
from megatron.engine.comm import Communicator
from megatron.analytic.comm_model import rank_coords
from megatron.topology.names import TIERS_BY_DEPTH
from megatron.model.sizes import unit_flops_per_token
from megatron.analytic.hardware import PROBE_FORMAT, group_shape
from megatron.analytic.time_model import algorithm_of, footprint
from megatron.launch.launcher import slurm_rendezvous
from megatron.runtime import launched_as, pick_device

OPS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")  # megatron.topology.names' spellings
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PHASE = "control"  # the ledger needs a phase; nothing reads the probe's ledger


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", type=int, nargs="+", required=True, help="tier sizes, slowest first: nodes gpus [gcds]")
    p.add_argument("--out", required=True, help="the probe JSON (written by rank 0)")
    p.add_argument("--sizes-kb", type=int, nargs="+", default=[64, 512, 4096], help="buffer sizes B in KiB")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (the median is kept)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="buffers and compute dtype")
    p.add_argument("--model", type=int, nargs=6, default=[4, 256, 4, 128, 2048, 1],
                   metavar=("LAYERS", "HIDDEN", "HEADS", "SEQ", "VOCAB", "MICRO_BATCH"),
                   help="the GPT-NeoX whose forward + backward gives the achieved FLOP/s (untied)")
    p.add_argument("--optimizer-elements", type=int, default=2_000_000)
    p.add_argument("--timeout-s", type=float, default=300)
    return p.parse_args(argv)


def band_groups(layout: tuple, tier_index: int) -> list:
    """The groups of ranks whose coordinates differ only in digit ``tier_index`` (slowest first)."""
    n = math.prod(layout)
    bands: dict = {}
    for rank in range(n):
        coords = rank_coords(rank, layout)
        key = coords[:tier_index] + coords[tier_index + 1:]
        bands.setdefault(key, []).append(rank)
    return [sorted(g) for g in bands.values()]


class Probe:
    def __init__(self, args: argparse.Namespace, rank: int, device: torch.device, backend: str):
        self.args, self.rank, self.device, self.backend = args, rank, device, backend
        self.layout = tuple(args.layout)
        self.topology = Topology.simulated(self.layout)
        self.comm = Communicator(ProcessGroups(self.topology, ShardLayout.from_topology(self.topology, ShardFactors(1, 1, 1)), rank, create=False), device=device)
        self.dtype = DTYPES[args.dtype]
        self.kinds = {}  # name -> (all groups, this rank's RankGroup)
        depth = len(self.layout)
        for t, tier in enumerate(TIERS_BY_DEPTH[depth]):
            if self.layout[t] > 1:
                self._make(f"band:{tier}", band_groups(self.layout, t))
        per_node = math.prod(self.layout[1:])
        if per_node > 1 and depth == 3:
            self._make("node", [list(range(b, b + per_node)) for b in range(0, math.prod(self.layout), per_node)])
        self._make("world", [list(range(math.prod(self.layout)))])

    def _make(self, name: str, groups: list) -> None:
        mine = None
        for ranks in groups:  # every rank creates every group, in the same order
            handle = dist.new_group(ranks, timeout=timedelta(seconds=self.args.timeout_s)) if len(ranks) < dist.get_world_size() else dist.group.WORLD
            if self.rank in ranks:
                mine = RankGroup(name, tuple(ranks), handle)
        self.kinds[name] = (groups, mine)

    def slowest(self, seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=self.device)  # NCCL: device tensors only
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def time_op(self, op: str, group: RankGroup, nbytes: int) -> float:
        k = group.size
        elems = max(nbytes // torch.tensor([], dtype=self.dtype).element_size() // k, 1) * k
        full = torch.ones(elems, dtype=self.dtype, device=self.device)
        part = torch.ones(elems // k, dtype=self.dtype, device=self.device)
        runs = []
        for _ in range(self.args.repeats + 1):  # the first run warms the connection up
            dist.barrier()
            start = time.perf_counter()
            if op == "all_gather":
                self.comm.all_gather(full, part, group, PHASE)
            elif op == "reduce_scatter":
                self.comm.reduce_scatter(part, full, group, PHASE)
            elif op == "all_to_all":
                self.comm.all_to_all(torch.empty_like(full), full, group, PHASE)
            else:
                self.comm.all_reduce(full, group, PHASE)
            self._sync()
            runs.append(self.slowest(time.perf_counter() - start))
        return statistics.median(runs[1:])

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def links(self) -> tuple[dict, dict, list]:
        """{algorithm: {tier: figures}} fitted on the band groups; {algorithm: {shape: curve}} from
        the band groups and, where the layout has them, the world ring and qgZ's node all-to-all;
        and every sample."""
        samples, fits, curves = [], {}, {}
        for name, (groups, mine) in self.kinds.items():
            if len(groups[0]) == 1:
                continue
            ops = OPS if name.startswith("band:") or name == "world" else ("all_to_all", "all_gather")
            shape = group_shape(groups[0], self.layout)
            for op in ops:
                algorithm = algorithm_of(op, groups[0], self.layout, self.backend)
                fp = footprint(groups, self.layout, algorithm)
                points, rates = [], []
                for kb in self.args.sizes_kb:
                    nbytes = kb * 1024
                    seconds = self.time_op(op, mine, nbytes)
                    points.append((nbytes * fp.domain_load[fp.slowest_tier], seconds))
                    rates.append([nbytes / fp.k, nbytes * fp.domain_load[fp.slowest_tier] / seconds / 1e9])
                    samples.append({"group": name, "op": op, "algorithm": algorithm, "k": fp.k, "shape": shape,
                                    "bytes": nbytes, "seconds": seconds})
                if name.startswith("band:"):
                    fits.setdefault(algorithm, {})[name.split(":", 1)[1]] = fit_line(points, fp.steps)
                if self._gives_curve(name, shape):
                    curves.setdefault(algorithm, {})[shape] = {"points": sorted(rates), "group": name, "k": fp.k}
        return fits, curves, samples

    def _gives_curve(self, name: str, shape: str) -> bool:
        """One group kind per shape: the GCD pair, the whole node (zeropp's gathers, qgZ's first hop;
        on a three-tier layout the node group rather than its one-GCD-per-GPU band), one rank per
        node (the cross and rail groups), the world."""
        if shape == "node" and "node" in self.kinds:
            return name == "node"
        return name.startswith("band:") or name == "world"

    def checks(self, fits: dict, samples: list) -> list:
        """The spanning groups timed (their samples from ``links`` where it took them), beside the
        fitted model's prediction."""
        from megatron.analytic.hardware import Device, Hardware, tier_link
        from megatron.analytic.time_model import footprint_time_s
        tiers = dict(fits.get("ring_allgather", {}))
        if not tiers:  # one device: no link was fitted, none to check
            return []
        hw = Hardware({t: tier_link(v, "probe") for t, v in tiers.items()},
                      Device("probe", 1, 1, 1, 0, 1), self.backend,
                      {(a, t): tier_link(v, "probe") for a, per in fits.items() for t, v in per.items()})
        out = []
        nbytes = self.args.sizes_kb[-1] * 1024
        taken = {(x["group"], x["op"]): x["seconds"] for x in samples if x["bytes"] == nbytes}
        for name in ("node", "world"):
            if name not in self.kinds:
                continue
            groups, mine = self.kinds[name]
            for op in ("all_gather", "reduce_scatter"):
                algorithm = algorithm_of(op, groups[0], self.layout, self.backend)
                measured = taken.get((name, op))
                if measured is None:
                    measured = self.time_op(op, mine, nbytes)
                predicted = footprint_time_s(footprint(groups, self.layout, algorithm), nbytes, hw)
                out.append({"group": name, "op": op, "algorithm": algorithm, "bytes": nbytes,
                            "measured_s": measured, "predicted_s": predicted})
        return out

    # -- the device ----------------------------------------------------------------------------------
    def model(self):
        from megatron.model import GPTNeoX
        layers, hidden, heads, seq, vocab, micro = self.args.model
        cfg = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq,
                          max_position_embeddings=seq, no_weight_tying=True)
        torch.manual_seed(0)
        model = GPTNeoX(cfg, vocab).to(self.device)
        tokens = torch.randint(0, vocab, (micro, seq + 1), device=self.device)
        flops = 3 * sum(unit_flops_per_token(cfg, vocab)) * micro * seq
        return model, tokens, flops

    def forward_backward(self, model, tokens) -> None:
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        self._sync()

    def timed_all(self, fn, repeats: int) -> float:
        runs = []
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            fn()
            self._sync()  # a GPU's kernels run after their launch returns
            runs.append(self.slowest(time.perf_counter() - start))
        return statistics.median(runs[1:])

    def device_figures(self, fits: dict) -> dict:
        from megatron.ops.quant import get_quantizer
        from megatron.engine.optimizer import AdamWHyper, adamw_update
        model, tokens, flops = self.model()
        compute_s = self.timed_all(lambda: self.forward_backward(model, tokens), self.args.repeats)
        n = self.args.optimizer_elements
        bufs = [torch.rand(n, device=self.device) for _ in range(4)]
        hyper = AdamWHyper(0.9, 0.95, 1e-8, 0.01)
        adam_s = self.timed_all(lambda: adamw_update(*bufs, [(0, n)], lr=1e-4, step=1, hyper=hyper), self.args.repeats)
        quantizer = get_quantizer("auto", device=self.device)
        x = torch.randn(n - n % 256, device=self.device)

        def quantize_round_trip() -> None:
            codes, scales = quantizer.quantize(x, bits=8, block=256)
            quantizer.dequantize(codes, scales, bits=8, block=256, numel=x.numel(), dtype=torch.float32)
        quant_s = self.timed_all(quantize_round_trip, self.args.repeats)
        copy_s = self.timed_all(lambda: bufs[0].clone(), self.args.repeats)  # a local copy (swizzle, secondary)
        by_tier = self.overlap_efficiency(model, tokens, compute_s, fits.get("ring_allgather", {}))
        figures = {"achieved_flops": flops / compute_s, "optimizer_elements_per_s": n / adam_s,
                   "quantize_elements_per_s": x.numel() / quant_s, "copy_bytes_per_s": n * 4 / copy_s}
        if by_tier:  # one device alone (--layout 1 1) has no link to overlap: the preset's share stays
            figures.update(overlap_efficiency=next(iter(by_tier.values())),  # the slowest tier's: the default
                           overlap_by_tier=by_tier)
        if self.device.type == "cuda":
            figures["memory_bytes"] = float(torch.cuda.get_device_properties(self.device).total_memory)
        return {"figures": figures, "compute_s": compute_s, "model_flops": flops, "adam_s": adam_s, "quant_s": quant_s,
                "copy_s": copy_s}

    def overlap_efficiency(self, model, tokens, compute_s: float, gather_fits: dict) -> dict:
        """{tier: (Tc + Tm - Tboth) / min(Tc, Tm)} for an all-gather in the tier's band groups issued
        before a forward + backward, clipped to [0, 1]: how much of that tier's transfers the device
        hides behind compute (on a CPU, a slow NIC's hides and a loopback copy does not). The buffer
        is sized by the tier's fitted figures so the gather takes about as long as the compute: with
        a gather much shorter than the compute, noise decides the ratio."""
        out = {}
        for name, (groups, group) in self.kinds.items():
            if not name.startswith("band:"):
                continue
            tier = name.split(":", 1)[1]
            k = group.size
            load = footprint(groups, self.layout, algorithm_of("all_gather", groups[0], self.layout,
                                                               self.backend)).domain_load[tier]
            fig = gather_fits.get(tier)
            nbytes = self.args.sizes_kb[-1] * 1024
            if fig and load > 0:  # as long as the compute, within [largest probed size, 256 MiB]
                nbytes = compute_s * fig["bandwidth_gbs"] * 1e9 / load
                nbytes = min(max(nbytes, self.args.sizes_kb[-1] * 1024), 256 * 2**20)
            elems = max(int(nbytes) // 4 // k, 1) * k
            full, part = torch.empty(elems, device=self.device), torch.ones(elems // k, device=self.device)

            def comm_only() -> None:
                _charges, pending = self.comm.start_all_gather(full, part, group, PHASE)
                pending.wait()

            def both() -> None:
                _charges, pending = self.comm.start_all_gather(full, part, group, PHASE)
                self.forward_backward(model, tokens)
                pending.wait()
            comm_s = self.timed_all(comm_only, self.args.repeats)
            both_s = self.timed_all(both, self.args.repeats)
            hidden = (compute_s + comm_s - both_s) / min(compute_s, comm_s)
            out[tier] = min(max(hidden, 0.0), 1.0)
        return out


def fit_line(points: list, steps: int) -> dict:
    """seconds = steps x latency + load / bandwidth, least squares over (load bytes, seconds); a
    negative intercept is read as no latency, a slope <= 0 (noise) as the fastest point's rate."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var if var else 0.0
    if slope <= 0:
        slope = min(y / x for x, y in points if x > 0)
    intercept = max(mean_y - slope * mean_x, 0.0)
    return {"bandwidth_gbs": 1.0 / slope / 1e9, "latency_us": intercept / max(steps, 1) * 1e6}


def run_probe(args: argparse.Namespace, rank: int, device: torch.device, backend: str,
              argv: Optional[list] = None) -> Optional[dict]:
    """Every measurement, in an initialised process group of prod(--layout) ranks; rank 0 writes
    --out atomically and returns what it wrote, the other ranks return None."""
    started = time.monotonic()
    probe = Probe(args, rank, device, backend)
    fits, curves, samples = probe.links()
    device_part = probe.device_figures(fits)
    checks = probe.checks(fits, samples)
    result = None
    if rank == 0:
        result = {"format": PROBE_FORMAT, "layout": list(args.layout), "backend": backend,
                  "device_type": device.type, "dtype": args.dtype, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": "tools/probe_links.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  "tiers": fits.get("ring_allgather", {}), "algorithms": fits, "curves": curves,
                  "device": device_part.pop("figures"),
                  "device_timings": device_part, "samples": samples, "checks": checks,
                  "wall_s": round(time.monotonic() - started, 1)}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, args.out)
        print(f"probe_links: {len(samples)} samples in {result['wall_s']} s; wrote {args.out}", flush=True)
    dist.barrier()
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    # Started by deepy's local launcher, torchrun or plain srun alike: the runtime's reading of RANK /
    # WORLD_SIZE / LOCAL_RANK, else Slurm's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID.
    rank, world, local_rank = launched_as()
    if math.prod(args.layout) != world:
        print(f"probe_links: --layout {args.layout} has {math.prod(args.layout)} ranks, but {world} were started",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # one core per rank, as the emulated cluster's ranks train
    # The trainer's choice: LOCAL_RANK modulo the GPUs this task sees (one, device 0, under srun
    # --gpus-per-task=1; cuda:$LOCAL_RANK there does not exist).
    device = pick_device("auto", local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    for key, value in slurm_rendezvous(os.environ).items():  # under plain srun, as deepy's srun line has them
        os.environ.setdefault(key, value)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout_s))
    run_probe(args, rank, device, backend, argv)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's C++ teardown can abort after the work is done (seen on 2-core CPU runs)


if __name__ == "__main__":
    sys.exit(main())
