"""What the rank files' CRC-32 costs, on a ~1 GB rank file (docs/checkpoints.md, "Checksums").

    .venv/bin/python bench/checkpoint_checksum.py [--gb 1.0] [--repeats 3] [--dir /tmp]

Measured, each the median of ``repeats``:
- crc32 alone over the bytes in memory (the CPU cost, without any I/O);
- what the checksum adds to a save, without the disk's noise: torch.save into a sink that keeps
  nothing, directly and through the checksumming writer ``write_rank_state`` uses;
- the save to disk as the checkpointer makes it (torch.save through that writer, fsync), for scale;
- the verification a read makes first (``file_checksum``: stream the file, 16 MiB at a time), cold
  (page cache dropped for the file with posix_fadvise, as on a fresh node) and warm (just written).
The rank state is fp32 pieces, like a real rank file's master and moments.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron.checkpointing.rank_files import _ChecksummingFile, file_checksum, write_rank_state  # noqa: E402


class _Sink:
    """A file that keeps nothing: torch.save's serialization cost alone."""

    def write(self, data) -> int:
        return memoryview(data).nbytes

    def flush(self) -> None:
        pass


def _state(gb: float) -> dict:
    per_key = int(gb * 1e9) // 4 // 3  # master, exp_avg, exp_avg_sq
    return {"engine": {"pieces": [{"name": "w", "offset": 0, "length": per_key,
                                   **{k: torch.randn(per_key) for k in ("master", "exp_avg", "exp_avg_sq")}}]}}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    state = _state(args.gb)
    path = Path(args.dir) / "checksum_bench_rank.pt"
    plain, hashed, disk, cold, warm, memory = [], [], [], [], [], []
    try:
        for _ in range(args.repeats):
            plain.append(_timed(lambda: torch.save(state, _Sink())))
            hashed.append(_timed(lambda: torch.save(state, _ChecksummingFile(_Sink()))))
            disk.append(_timed(lambda: write_rank_state(path, state)))
            warm.append(_timed(lambda: file_checksum(path)))
            _drop_cache(path)
            cold.append(_timed(lambda: file_checksum(path)))
            data = path.read_bytes()
            memory.append(_timed(lambda: zlib.crc32(data)))
            del data
        size = path.stat().st_size / 1e9
    finally:
        path.unlink(missing_ok=True)
    med = statistics.median
    print(f"rank file {size:.2f} GB, median of {args.repeats}, per GB:")
    print(f"  crc32 in memory           {med(memory) / size:6.3f} s/GB")
    print(f"  torch.save, no disk       {med(plain) / size:6.3f} s/GB")
    print(f"  the same, checksummed     {med(hashed) / size:6.3f} s/GB  (adds {(med(hashed) - med(plain)) / size:.3f})")
    print(f"  save to disk + fsync      {med(disk) / size:6.3f} s/GB  (checksummed, as the checkpointer saves)")
    print(f"  verify, warm page cache   {med(warm) / size:6.3f} s/GB")
    print(f"  verify, cold              {med(cold) / size:6.3f} s/GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
