"""Gradient hops that cross nodes run in fp32 under fp32_allreduce (docs/numerics.md, "Sums across
ranks"), also inside a micro-step: stage 2/3 and unquantized zeropp reduce over groups that span
nodes, and with bf16 compute those sums used to be rounded to bf16 at every ring step.

- The engine's own reduction (``_reduce_gradient``, as the backward calls it) on a simulated 2x2,
  bf16 compute, known bf16 gradients on every rank: with fp32_allreduce each rank's share equals a
  float64 sum of the same inputs to fp32 rounding; without it (a bf16 ring) it is visibly worse.
- The comm model charges those hops 4 bytes per element, by hand (the ledger's equality with the
  model on a training step is tests/test_ledger_equals_model.py's ``*-bf16-fp32ar-*`` cases).
"""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks
from megatron.engine.settings import EngineSettings
from megatron.topology.layout import ShardLayout
from megatron.engine import lm_loss
from megatron.topology import ProcessGroups, Topology
from megatron.engine import Communicator, ZeroTopoEngine
from megatron.analytic.comm_model import CommSpec, padded_unit_numels, predict_ledger
from test_engine import OPT, build_model

LAYOUT, WORLD = [2, 2], 4
# (name, preset, reduce_bucket_elements): the small bucket sends each unit in several pieces.
RUNS = [("stage3", "stage3", None), ("stage3-buckets", "stage3", 96), ("stage2", "stage2", None),
        ("zeropp", "zeropp", None)]


def _gradient(rank: int, size: int) -> torch.Tensor:
    """bf16 values over ~6 decades, so a bf16 partial sum rounds away real bits."""
    gen = torch.Generator().manual_seed(700 + rank)
    return (torch.randn(size, generator=gen) * torch.logspace(-3, 3, size)[torch.randperm(size, generator=gen)]
            ).to(torch.bfloat16)


def _worker(rank: int, world_size: int) -> dict:
    topology = Topology.simulated(LAYOUT)
    out = {}
    for name, preset, bucket in RUNS:
        for fp32 in (True, False):
            groups = ProcessGroups(topology, ShardLayout.from_topology(topology, preset=preset), rank)
            model = build_model()
            extra = {} if bucket is None else {"reduce_bucket_elements": bucket}
            engine = ZeroTopoEngine(model, lm_loss, groups, Communicator(groups), EngineSettings(optimizer=OPT, precision="bfloat16", accumulation_steps=1, fp32_allreduce=fp32, **extra))
            unit = engine.units[1]
            unit.grad_accum.zero_()
            engine.reduce_gradient(unit, _gradient(rank, unit.size))
            engine.reductions.drain()
            index, parts = 0, 1  # this rank's share after the weight then the stride hop
            for group in (groups.weight, groups.stride):
                index, parts = index * group.size + group.index(rank), parts * group.size
            out[(name, fp32)] = {"share": unit.grad_accum.clone(), "index": index, "parts": parts,
                                 "size": unit.size, "sent": engine.ledger.snapshot()}
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_ranks("test_cross_node_fp32:_worker", WORLD, tmp_path_factory.mktemp("cross_fp32"))


@pytest.mark.parametrize("name", [name for name, _, _ in RUNS])
def test_cross_node_gradient_hops_sum_in_fp32(four, name):
    size = four[0][(name, True)]["size"]
    inputs = [_gradient(r, size).double() for r in range(WORLD)]
    total = sum(inputs)                              # the float64 reference
    magnitude = sum(x.abs() for x in inputs)         # a sum's rounding error scales with sum |x_i|
    errors = {}
    for fp32 in (True, False):
        worst = 0.0
        for rank in range(WORLD):
            got = four[rank][(name, fp32)]
            exact, scale = (t.view(got["parts"], -1)[got["index"]] for t in (total, magnitude))
            worst = max(worst, ((got["share"].double() - exact).abs() / scale).max().item())
        errors[fp32] = worst
    assert errors[True] <= 3 * 2.0 ** -24, errors    # fp32: three roundings of 2^-24 at most
    assert errors[False] >= 2.0 ** -10, errors       # a bf16 ring: 8-bit roundings
    # and what crossed nodes was fp32: twice the bf16 run's bytes
    crossed = {fp32: sum(four[r][(name, fp32)]["sent"][("grad_reduce", "inter_node")] for r in range(WORLD))
               for fp32 in (True, False)}
    assert crossed[False] > 0 and crossed[True] == 2 * crossed[False], crossed


def test_the_comm_model_charges_cross_node_gradient_hops_four_bytes():
    """stage3 bf16 on 2x2, A = 1, one reduce-scatter over the world (k = 4) per unit: each rank sends
    3/4 of the S-element buffer to the next rank of the ring; the ring 0-1-2-3-0 crosses nodes on
    1->2 and 3->0. So per unit: inter_node 2 x 3/4 x S x 4 bytes, intra_node the same (0->1, 2->3).
    With fp32_allreduce off the same hops move 2 bytes per element."""
    units = (1000, 3000, 2000)
    for fp32, elem in ((True, 4), (False, 2)):
        spec = CommSpec(units, ShardLayout.resolve((2, 2), preset="stage3"), compute_bytes=2, fp32_allreduce=fp32)
        sizes = padded_unit_numels(spec)
        ledger = predict_ledger(spec)
        for tier in ("inter_node", "intra_node"):
            assert ledger[("grad_reduce", tier)] == sum(2 * 3 * (s // 4) * elem for s in sizes), (fp32, tier)
    # zero_topo's micro-step hops stay inside a node: fp32_allreduce changes only its boundary hops
    plain, wide = (predict_ledger(CommSpec(units, ShardLayout.resolve((2, 2), preset="zero_topo"), compute_bytes=2, fp32_allreduce=f))
                   for f in (False, True))
    assert plain[("grad_reduce", "intra_node")] == wide[("grad_reduce", "intra_node")]
    assert wide[("cross_grad_reduce", "inter_node")] == 2 * plain[("cross_grad_reduce", "inter_node")]
