"""What the benchmarks in bench/ share: the parity run against the peers (peers.py: one config, one
batch stream and one trainer per peer, ours, DeepSpeed ZeRO-3 and FSDP2, on gloo ranks started by
megatron/launch/spawner.py), the timed comparison of every configuration on an emulated cluster
(compare_peers.py) and its report (compare_report.py). The scripts in bench/ are their command lines;
they read configs/ and run tools/ of the source checkout the package is installed from (editable),
which CHECKOUT names."""
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
