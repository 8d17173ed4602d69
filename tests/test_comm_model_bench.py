"""The volume benchmark runs on a small shape and shows the model's headline property."""
import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "comm_volume.py"


def test_bench_summary_on_a_small_shape(capsys):
    spec = importlib.util.spec_from_file_location("comm_volume", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256", "--layout", "2", "2", "2",
                "--micro-batches", "1", "4"])
    out = capsys.readouterr().out
    summary = out.split("summary")[1].splitlines()[2:]
    rows = {(cols[0], cols[1]): cols for cols in (line.split() for line in summary if line.strip())}
    assert set(rows) == {(p, a) for p in ("zero3", "zeropp", "hsdp", "zero_topo") for a in ("1", "4")}
    # column 3 = inter-node bytes per rank / parameters: flat in accumulation for zero_topo, linear for zero3
    assert rows[("zero_topo", "1")][3] == rows[("zero_topo", "4")][3]
    assert float(rows[("zero3", "4")][3]) > 3 * float(rows[("zero3", "1")][3])
