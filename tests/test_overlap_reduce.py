"""Overlapped, bucketed gradient reduction (megatron/engine/grad_reduce.py, engine hooks).

One 4-rank launch (2 nodes x 2 ranks) trains every case four times: overlap off/on, with one piece
per unit and with small buckets (many pieces per unit). Judged here:
- overlap changes nothing: losses, parameters, error-feedback residuals and every ledger cell are
  bit-identical with overlap on and off, for either bucket size;
- overlap really defers: with it two pieces are in flight at once, without it none ever waits;
- buckets change no byte (the ledger is identical) and the values only by fp32 rounding;
and, without processes, the window's issue order and bound, and the column cuts, by hand.
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
from megatron.engine.grad_reduce import ReductionWindow, column_ranges, piece_of
from megatron.engine.quantized import QuantSpec
from test_engine import LR, OPT, build_model, make_batch

LAYOUT, STEPS, ACCUM = [2, 2], 2, 2
SMALL_BUCKET = 256  # elements: every unit is cut into 2 to 13 pieces (a multiple of the block, 8); more pieces
#                    only add collectives (~10 ms each on 2 cores), not cases
QUANT = QuantSpec(weight_gather_bits=8, grad_reduce_bits=4, cross_node_grad_bits=4, refresh_bits=8, block_size=8, impl="reference")
CASES = [  # (name, preset, quantization)
    ("zero3", "stage3", None),
    ("hsdp", "hsdp", None),
    ("zero_topo", "zero_topo", None),
    ("zeropp_qgz", "zeropp", QuantSpec(weight_gather_bits=8, grad_reduce_bits=4, block_size=8, impl="reference")),
    ("zero_topo_int4_ef", "zero_topo", QuantSpec(weight_gather_bits=8, grad_reduce_bits=4, cross_node_grad_bits=4, refresh_bits=8,
                                                     block_size=8, error_feedback=True, impl="reference")),
    ("zeropp_qgz_ef", "zeropp", QuantSpec(weight_gather_bits=8, grad_reduce_bits=4, block_size=8, error_feedback=True,
                                              impl="reference")),
]
SETTINGS = [(False, None), (True, None), (False, SMALL_BUCKET), (True, SMALL_BUCKET)]  # (overlap, bucket)


# -------------------------------------------------------------------------------- without processes

class _FakePending:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(("wait", self.name))


def _chain(log: list, name: str, hops: int):
    for hop in range(hops):
        log.append(("issue", f"{name}{hop}"))
        yield _FakePending(log, f"{name}{hop}")
    return name


def test_the_window_moves_earlier_pieces_one_hop_per_submit_and_keeps_its_bound():
    log, done = [], []
    window = ReductionWindow(overlap=True, max_in_flight=2)
    for name in "abc":
        window.submit(_chain(log, name, 2), 2, done.append)
        assert window.in_flight <= 2
    window.drain()
    assert done == ["a", "b", "c"]
    assert log == [("issue", "a0"),
                   ("wait", "a0"), ("issue", "a1"), ("issue", "b0"),    # b's submit moves a on
                   ("wait", "b0"), ("issue", "b1"),                     # c's moves b on (a has no hop left)
                   ("wait", "a1"), ("issue", "c0"),                     # the window is full: a finishes first
                   ("wait", "b1"), ("wait", "c0"), ("issue", "c1"), ("wait", "c1")]  # drain, oldest first
    assert window.peak_in_flight == 2 and window.in_flight == 0


def test_without_overlap_every_hop_is_waited_for_at_once():
    log, done = [], []
    window = ReductionWindow(overlap=False)
    window.submit(_chain(log, "a", 2), 2, done.append)
    assert log == [("issue", "a0"), ("wait", "a0"), ("issue", "a1"), ("wait", "a1")] and done == ["a"]
    assert window.peak_in_flight == 0


def test_abandon_forgets_without_waiting():
    log, done = [], []
    window = ReductionWindow(overlap=True)
    window.submit(_chain(log, "a", 1), 1, done.append)
    window.abandon()
    window.drain()
    assert log == [("issue", "a0")] and done == []


def test_column_ranges_and_pieces_by_hand():
    assert column_ranges(10, 4, 1000) == [(0, 10)]
    assert column_ranges(10, 4, 12) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert column_ranges(16, 2, 20, quantum=8) == [(0, 8), (8, 16)]
    assert column_ranges(16, 2, 2, quantum=8) == [(0, 8), (8, 16)]  # at least one block per piece
    x = torch.arange(12.0)
    assert piece_of(x, 3, 0, 4) is x
    assert piece_of(x, 3, 1, 3).tolist() == [1.0, 2.0, 5.0, 6.0, 9.0, 10.0]


# ---------------------------------------------------------------------------------------- the worker

def _engine(rank: int, preset: str, quant, overlap: bool, bucket) -> ZeroTopoEngine:
    topology = Topology.simulated(LAYOUT)
    groups = ProcessGroups(topology, ShardLayout.from_topology(topology, preset=preset), rank)
    torch.manual_seed(0)
    model = build_model()
    extra = {"reduce_bucket_elements": bucket} if bucket else {}
    return ZeroTopoEngine(model, lm_loss, groups, Communicator(groups), EngineSettings(optimizer=OPT, precision="fp32", accumulation_steps=ACCUM, quant=quant, overlap_reduce=overlap, **extra))


def _worker(rank: int, world_size: int) -> dict:
    results = {}
    for name, preset, quant in CASES:
        for overlap, bucket in SETTINGS:
            engine = _engine(rank, preset, quant, overlap, bucket)
            losses, ledgers = [], []
            for step in range(STEPS):
                engine.ledger.reset()
                losses += [engine.forward_backward(make_batch(step, m, rank)).item() for m in range(ACCUM)]
                engine.optimizer_step(LR)
                ledgers.append(engine.ledger.snapshot())
            results[(name, overlap, bucket)] = {
                "losses": losses, "ledgers": ledgers, "params": engine.full_state_dict(),
                "residuals": [{k: v.clone() for k, v in u.residuals.items()} for u in engine.units],
                "peak": engine.reductions.peak_in_flight, "sizes": [u.size for u in engine.units]}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks("test_overlap_reduce:_worker", 4, tmp_path_factory.mktemp("overlap"))


def _same(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    assert a["ledgers"] == b["ledgers"]
    for key, value in a["params"].items():
        assert torch.equal(value, b["params"][key]), key
    for ra, rb in zip(a["residuals"], b["residuals"]):
        assert ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_overlap_changes_no_value_and_no_byte(runs, name):
    for rank, result in enumerate(runs):
        for bucket in (None, SMALL_BUCKET):
            _same(result[(name, True, bucket)], result[(name, False, bucket)])


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_overlap_keeps_pieces_in_flight_within_the_bound(runs, name):
    result = runs[0]
    assert all(s > SMALL_BUCKET for s in result[(name, True, None)]["sizes"])  # really cut in pieces
    for bucket in (None, SMALL_BUCKET):
        assert result[(name, True, bucket)]["peak"] == 2  # the bound (reduce_buckets_in_flight) reached
        assert result[(name, False, bucket)]["peak"] == 0


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_buckets_change_no_byte_and_values_only_by_rounding(runs, name):
    quantized = dict((c[0], c[2]) for c in CASES)[name] is not None
    for result in runs:
        whole, cut = result[(name, False, None)], result[(name, False, SMALL_BUCKET)]
        assert whole["ledgers"] == cut["ledgers"]
        if quantized:  # blocks are cut at block boundaries: the same messages, summed in another order
            tol = dict(atol=1e-5, rtol=1e-4)
        else:
            tol = dict(atol=1e-6, rtol=1e-5)
        for key, value in whole["params"].items():
            torch.testing.assert_close(cut["params"][key], value, **tol)
        torch.testing.assert_close(torch.tensor(cut["losses"]), torch.tensor(whole["losses"]), **tol)
