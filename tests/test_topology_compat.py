"""The collective-name shim: new names when torch has them, old names otherwise, a clear error if neither."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.topology import compat

NAMES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")


@pytest.fixture
def calls(monkeypatch):
    """Replace the four torch functions by recorders; tests then hide some of them."""
    record = []
    for name in NAMES:
        monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: record.append((_n, k.get("op"), k.get("group"))),
                            raising=False)
    return record


def test_prefers_the_new_names(calls):
    out, inp = torch.zeros(4), torch.zeros(2)
    compat.all_gather_tensor(out, inp, group="g")
    compat.reduce_scatter_tensor(inp, out, group="g")
    assert calls == [("all_gather_single", None, "g"), ("reduce_scatter_single", dist.ReduceOp.SUM, "g")]


def test_falls_back_to_the_old_names(calls, monkeypatch):
    monkeypatch.delattr(dist, "all_gather_single")
    monkeypatch.delattr(dist, "reduce_scatter_single")
    compat.all_gather_tensor(torch.zeros(4), torch.zeros(2))
    compat.reduce_scatter_tensor(torch.zeros(2), torch.zeros(4))
    assert [c[0] for c in calls] == ["all_gather_into_tensor", "reduce_scatter_tensor"]


def test_neither_name_is_a_clear_error(calls, monkeypatch):
    monkeypatch.delattr(dist, "all_gather_single")
    monkeypatch.delattr(dist, "all_gather_into_tensor")
    with pytest.raises(RuntimeError, match="torch >= 2.4"):
        compat.all_gather_tensor(torch.zeros(4), torch.zeros(2))


def test_this_torch_has_a_usable_name():
    assert any(hasattr(dist, n) for n in NAMES[:2]) and any(hasattr(dist, n) for n in NAMES[2:])
