from megatron.training import Batching


def test_micro_batches_partition_the_global_batch():
    world, accumulation, micro = 4, 2, 3
    seen = []
    for rank in range(world):
        b = Batching(micro, accumulation, world, rank)
        for m in range(accumulation):
            seen.extend(b.micro_indices(96, m))
    assert sorted(seen) == list(range(96, 96 + micro * accumulation * world))
    assert Batching(micro, accumulation, world, 0).global_batch == 24


def test_single_process_order_is_sequential():
    b = Batching(4, 8, 1, 0)
    assert [list(b.micro_indices(32, m)) for m in (0, 1)] == [[32, 33, 34, 35], [36, 37, 38, 39]]
