"""Rank-0 work handed to the other ranks through a store (megatron/runtime.py: run_and_share,
Runtime.on_rank_zero), and the process-group keywords per backend, without a process group:
ranks are threads over one HashStore, or a second process serving a TCPStore."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron.data import DataError
from megatron.runtime import RankZeroError, Runtime, barrier_kwargs, process_group_kwargs, run_and_share

SHORT = timedelta(seconds=0.5)


def _ranks(world: int, work, **kwargs) -> list:
    """`work(rank)` on `world` threads; each one's result or exception, by rank."""
    out: list = [None] * world

    def run(rank: int) -> None:
        try:
            out[rank] = work(rank)
        except BaseException as error:  # noqa: BLE001 - the test looks at it
            out[rank] = error
    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    return out


def test_rank_zero_runs_once_and_every_rank_gets_its_result():
    store, calls = dist.HashStore(), []

    def slow():
        calls.append(1)
        time.sleep(0.3)  # the others are waiting by now
        return {"prefix": "/data/x_indexmap_abc", "epochs": 3}

    out = _ranks(3, lambda rank: run_and_share(store, "k1", "build the index", slow, rank=rank, world_size=3))
    assert calls == [1] and out == [{"prefix": "/data/x_indexmap_abc", "epochs": 3}] * 3


def test_an_error_on_rank_zero_reaches_the_others_in_one_line():
    store = dist.HashStore()

    def fail():
        raise DataError("the train split of /data/x has no tokens\nsecond line")

    out = _ranks(3, lambda rank: run_and_share(store, "k1", "build the train sample index", fail, rank=rank,
                                               world_size=3, handoff=SHORT))
    assert isinstance(out[0], DataError)  # rank 0 raises its own error, unchanged
    for error in out[1:]:
        assert isinstance(error, RankZeroError)
        assert str(error) == ("rank 0 failed to build the train sample index: "
                              "DataError: the train split of /data/x has no tokens")


def test_an_unpicklable_result_is_an_error_everywhere_not_a_hang():
    store = dist.HashStore()
    out = _ranks(2, lambda rank: run_and_share(store, "k1", "open a file", lambda: threading.Lock(), rank=rank,
                                               world_size=2, handoff=SHORT))
    assert isinstance(out[0], TypeError) and isinstance(out[1], RankZeroError) and "TypeError" in str(out[1])


def test_per_node_leaders_build_for_their_own_node():
    """Local rank 0 of each node runs fn (a cache folder not shared between nodes); 2 nodes x 2 ranks."""
    store, built_by = dist.HashStore(), []

    def runtime(rank: int) -> Runtime:
        return Runtime(rank=rank, world_size=4, local_rank=rank % 2, device=torch.device("cpu"), store=store)

    def work(rank: int):
        rt = runtime(rank)
        first = rt.on_rank_zero("build on the node", lambda: built_by.append(rank) or f"node of {rank}", per_node=True)
        second = rt.on_rank_zero("then on rank 0", lambda: built_by.append(rank) or "rank 0's")
        return first, second

    out = _ranks(4, work)
    assert sorted(built_by) == [0, 0, 2]
    assert out == [("node of 0", "rank 0's")] * 2 + [("node of 2", "rank 0's")] * 2


def test_a_silent_rank_zero_ends_the_wait_after_its_deadline():
    out = _ranks(1, lambda rank: run_and_share(dist.HashStore(), "k1", "build the index", lambda: None, rank=1,
                                               world_size=2, wait=SHORT))
    assert isinstance(out[0], RankZeroError) and "rank 0 did not build the index" in str(out[0])


def test_a_dead_rank_zero_ends_the_wait_at_once(tmp_path):
    """Rank 0 serves the TCPStore: when its process dies without publishing, a rank waiting for 24 h
    (the default) gets a one-line error as soon as the connection drops."""
    port_file = tmp_path / "port"
    serve = ("import os, sys, time, datetime, torch.distributed as dist\n"
             "s = dist.TCPStore('127.0.0.1', 0, 2, is_master=True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)\n"
             f"open({str(port_file)!r}, 'w').write(str(s.port))\n"
             "time.sleep(1.5)\n"
             "os._exit(1)\n")
    server = subprocess.Popen([sys.executable, "-c", serve])
    try:
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        client = dist.TCPStore("127.0.0.1", int(port_file.read_text()), 2, is_master=False,
                               timeout=timedelta(seconds=30))
        start = time.monotonic()
        with pytest.raises(RankZeroError, match="rank 0 did not build the index: "):
            run_and_share(client, "k1", "build the index", lambda: None, rank=1, world_size=2)
        assert time.monotonic() - start < 20
    finally:
        server.kill()
        server.wait()


def test_one_process_just_runs_the_work():
    assert Runtime(0, 1, 0, torch.device("cpu")).on_rank_zero("add", lambda: 1 + 1) == 2


def test_process_group_and_barrier_keywords_per_backend():
    timeout = timedelta(minutes=30)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 3)  # a device object needs no GPU
    assert process_group_kwargs("gloo", cpu, timeout) == {"timeout": timeout}
    assert process_group_kwargs("nccl", gpu, timeout) == {"timeout": timeout, "device_id": torch.device("cuda", 3)}
    assert barrier_kwargs("gloo", cpu) == {} and barrier_kwargs("gloo", gpu) == {}
    assert barrier_kwargs("nccl", gpu) == {"device_ids": [3]}
