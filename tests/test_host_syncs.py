"""HostSyncs (megatron/logging/host_syncs.py): each kind of host wait counted, by hand, on the meta
device standing in for a GPU and on a CPU run."""
from __future__ import annotations

import pytest
import torch

from megatron.logging.host_syncs import HostSyncs
from megatron.rehearsal.meta_device import answers_reads


def test_each_kind_on_the_meta_device():
    with answers_reads(), HostSyncs() as syncs:
        x = torch.ones(4, device="meta")
        assert float(x.sum()) == 0.0  # a read, answered by the meta kernel standing in
        assert torch.equal(x, x)  # a read
        assert x.tolist() == [0.0, 0.0, 0.0, 0.0]  # device -> host
        assert x.cpu().sum().item() == 0.0  # device -> host (the CPU .item() is a read of the host's own)
        x.copy_(torch.arange(4.0))  # blocking host -> device
        torch.arange(4.0).to("meta", non_blocking=True)  # pageable: a GPU stages it and waits
        torch.full((2,), 3.0, device="meta")  # a fill from a Python number: no copy at all
        with pytest.raises(RuntimeError, match="not on the expected device"):
            x + torch.ones(4)  # a host tensor mixed into device work fails, as on a GPU
    assert syncs.by_kind == {"reads": 3, "device_to_host": 2, "blocking_host_to_device": 1,
                             "pageable_host_to_device": 1, "async_host_to_device": 0}
    assert syncs.count == 7


def test_a_cpu_run_sees_the_reads_only():
    with HostSyncs() as syncs:
        x = torch.ones(3)
        x.sum().item()
        x.tolist()  # a host tensor: nothing dispatched, nothing waited for
        x.to("cpu")
    assert syncs.by_kind["reads"] == 1 and syncs.count == 1
