"""The emulated cluster's network on one machine: K "nodes" as network namespaces on a bridge, each
node's link rate-limited by a token bucket. tools/emulate_cluster.py builds it and starts ranks
inside; the benchmarks ask it whether this machine can emulate at all (`environment_problem`).

The network. A bridge in the root namespace; per node a namespace `<run>-node<i>` holding one end
of a veth pair (`<run>n<i>`, address 198.18.0.<i+1>/24, the benchmarking range RFC 2544 reserves),
the other end (`<run>h<i>`) on the bridge. Neither the bridge nor the root namespace has an address
in that range and the namespaces have no default route, so nothing is routed out. A token bucket
(`tc ... tbf rate R burst 64kb latency 100ms`) sits on both ends' egress: inside the namespace it
limits what the node sends, on the bridge side what it receives, as a NIC of rate R per direction
on a non-blocking switch. Each namespace's loopback is up: ranks of one node talk over it,
unlimited (the in-node tier), even when they address each other by the veth's address. Only the
rate is emulated; netem (delay, loss) is not available here (docs/emulated_cluster.md).

Interface counters: /sys/class/net/<if>/statistics/{tx,rx}_{bytes,packets} of each node's
interface, read inside its namespace (`read_counters`), count what crossed node boundaries.

Three tiers (`Cluster.gpus` > 0, a Frontier-like node of G GPUs, each a pair of GCDs). The node's
namespace holds no address: it is the node's switch, a bridge `<run>s<i>` joining its uplink
`<run>n<i>` (rate-limited to the inter-node rate, as above) and one veth per GPU (`<run>p<k>`, k the
GPU's index in the cluster). The GPU's end `<run>g<k>` sits in the GPU's own namespace
`<run>-node<i>gpu<j>` with address 198.18.0.<k+1>; both ends carry a token bucket at the in-node rate.
The GPU's ranks (its GCD pair) talk over that namespace's loopback, unlimited; a rank of another GPU of
the node is one GPU link out and one in; a rank of another node is a GPU link, the node's uplink, the
other node's uplink and that GPU's link. Counters per tier (`read_tier_counters`, `tier_bytes`):
inter_node = what the uplinks sent, intra_node = what the GPU links sent less that (inter-node traffic
crosses a GPU link too), intra_gpu = what the GPU namespaces' loopbacks carried.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, TextIO

SUBNET = "198.18.0"  # /24 inside 198.18.0.0/15; each run's bridge is its own segment
TBF = ["burst", "64kb", "latency", "100ms"]  # 64 kB suffices at 1 Gbit/s (measured: 950 Mbit/s of payload)
COUNTERS = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
OWNER_TAG = "neox-topo emulate_cluster pid="  # the bridge's alias: which process owns a run
# after the run id: bridge, host end, node end, namespace; three tiers add the node's bridge, a GPU
# link's two ends and the GPU's namespace
RUN_PARTS = r"(?:b|h\d+|n\d+|s\d+|g\d+|p\d+|-node\d+(?:gpu\d+)?)"
IFNAMSIZ = 15  # the kernel's limit on an interface name
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


class EmulationError(RuntimeError):
    """The machine cannot host the emulated network (one line says why); the tool exits 69."""


class UsageError(ValueError):
    """Bad arguments or config (one line); the tool exits 2."""



# --- names and checks --------------------------------------------------------------------------------

def parse_rate(rate: str) -> Optional[float]:
    """tc's rate syntax (1gbit, 200mbit, 125mbps = bytes/s) -> bits/s; None for `unlimited`."""
    if rate == "unlimited":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", rate.strip().lower())
    if not m or m.group(2) not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise UsageError(f"--rate {rate!r}: expected a tc rate such as 1gbit, 200mbit or 125mbps, or unlimited")
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


@dataclass(frozen=True)
class Cluster:
    """The names and addresses of one run's network. ``gpus`` > 0 makes it three-tier: that many GPU
    namespaces per node behind links of ``gpu_rate`` (module docstring)."""
    run_id: str
    nodes: int
    rate: str
    gpus: int = 0                    # GPUs per node; 0: two tiers (the ranks share the node's namespace)
    gpu_rate: str = "unlimited"      # each GPU's link to its node's switch, per direction

    @property
    def three_tier(self) -> bool:
        return self.gpus > 0

    def gpu_index(self, node: int, gpu: int) -> int:
        return node * self.gpus + gpu

    def gpu_namespace(self, node: int, gpu: int) -> str:
        return f"{self.run_id}-node{node}gpu{gpu}"

    def gpu_if(self, node: int, gpu: int) -> str:
        """The GPU's end of its link, inside the GPU's namespace."""
        return f"{self.run_id}g{self.gpu_index(node, gpu)}"

    def gpu_port(self, node: int, gpu: int) -> str:
        """The switch's end of the GPU's link, inside the node's namespace."""
        return f"{self.run_id}p{self.gpu_index(node, gpu)}"

    def node_bridge(self, node: int) -> str:
        return f"{self.run_id}s{node}"

    def rank_place(self, node: int, gpu: int = 0) -> tuple[str, str, str]:
        """(namespace, interface, address) where the ranks of (node, gpu) run; gpu is ignored on two tiers."""
        if not self.three_tier:
            return self.namespace(node), self.node_if(node), self.address(node)
        k = self.gpu_index(node, gpu)
        return self.gpu_namespace(node, gpu), self.gpu_if(node, gpu), f"{SUBNET}.{k + 1}"

    def master_address(self) -> str:
        return self.rank_place(0, 0)[2]

    @property
    def bridge(self) -> str:
        return f"{self.run_id}b"

    def namespace(self, node: int) -> str:
        return f"{self.run_id}-node{node}"

    def node_if(self, node: int) -> str:
        return f"{self.run_id}n{node}"

    def host_if(self, node: int) -> str:
        return f"{self.run_id}h{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"


def new_cluster(prefix: str, nodes: int, rate: str, gpus: int = 0, gpu_rate: str = "unlimited") -> Cluster:
    """A run id unique on this machine: the prefix and 4 random hex digits (interface names are at
    most 15 characters: prefix <= 8, and on three tiers prefix + 5 + the digits of the GPU count)."""
    if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", prefix):
        raise UsageError(f"--prefix {prefix!r}: 1-8 lowercase letters or digits, starting with a letter")
    if not 1 <= nodes <= 250:
        raise UsageError(f"--nodes {nodes}: between 1 and 250")
    if gpus < 0 or nodes * gpus > 250:
        raise UsageError(f"--gpus-per-node {gpus}: at least 0 (0: two tiers) and at most 250 GPUs in all")
    if gpus and len(prefix) + 5 + len(str(nodes * gpus - 1)) > IFNAMSIZ:
        raise UsageError(f"--prefix {prefix!r} is too long for {nodes * gpus} GPUs' interface names "
                         f"(at most {IFNAMSIZ} characters)")
    parse_rate(rate)
    parse_rate(gpu_rate)
    taken = set(_netns_names()) | set(_link_names())
    while True:
        run_id = prefix + secrets.token_hex(2)
        if not any(name.startswith(run_id) for name in taken):
            return Cluster(run_id, nodes, rate, gpus, gpu_rate)


def environment_problem() -> Optional[str]:
    """Why this machine cannot emulate (one line), or None."""
    if sys.platform != "linux":
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc); run it as root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs iproute2: {' and '.join(missing)} not found on PATH"
    return None


# --- the network ---------------------------------------------------------------------------------------

def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise EmulationError(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()}")
    return done


def _ns(cluster: Cluster, node: int, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run("ip", "netns", "exec", cluster.namespace(node), *cmd, check=check)


def _no_ipv6(ns_cmd, names: Sequence[str]) -> None:
    """Router solicitations and MLD reports would land in the counters; the emulation is IPv4 only.
    Best effort: a kernel without IPv6 has nothing to turn off."""
    script = "; ".join(f"echo 1 > /proc/sys/net/ipv6/conf/{n}/disable_ipv6" for n in names)
    ns_cmd("sh", "-c", script + " 2>/dev/null; true")


def build(cluster: Cluster) -> None:
    """Bridge first (it carries the owner's pid, which --cleanup reads), then one namespace per node."""
    br = cluster.bridge
    _run("ip", "link", "add", br, "type", "bridge", "mcast_snooping", "0")  # no IGMP of its own
    _run("ip", "link", "set", br, "alias", f"{OWNER_TAG}{os.getpid()}")
    _no_ipv6(lambda *c: _run(*c, check=False), [br])
    _run("ip", "link", "set", br, "up")
    for node in range(cluster.nodes):
        ns, inside, outside = cluster.namespace(node), cluster.node_if(node), cluster.host_if(node)
        _run("ip", "netns", "add", ns)
        _no_ipv6(lambda *c: _ns(cluster, node, *c, check=False), ["all", "default"])
        _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside, "netns", ns)
        _no_ipv6(lambda *c: _run(*c, check=False), [outside])
        _no_ipv6(lambda *c: _ns(cluster, node, *c, check=False), [inside])
        _run("ip", "link", "set", outside, "master", br, "up")
        if not cluster.three_tier:
            _run("ip", "-n", ns, "addr", "add", f"{cluster.address(node)}/24", "dev", inside)
        _run("ip", "-n", ns, "link", "set", inside, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _limit(cluster.rate, lambda *c: _ns(cluster, node, *c), inside)
        _limit(cluster.rate, _run, outside)
        if cluster.three_tier:
            _build_gpus(cluster, node)


def _limit(rate: str, runner, device: str) -> None:
    """A token bucket of `rate` on `device`'s egress (nothing for `unlimited`)."""
    if parse_rate(rate) is not None:
        runner("tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, *TBF)


def _build_gpus(cluster: Cluster, node: int) -> None:
    """The node's switch (a bridge in its namespace, the uplink on it) and one namespace per GPU, its
    link on the switch limited to the in-node rate both ways; the GPU's pair of ranks shares its loopback."""
    ns, switch = cluster.namespace(node), cluster.node_bridge(node)
    _run("ip", "-n", ns, "link", "add", switch, "type", "bridge", "mcast_snooping", "0")
    _no_ipv6(lambda *c: _ns(cluster, node, *c, check=False), [switch])
    _run("ip", "-n", ns, "link", "set", switch, "up")
    _run("ip", "-n", ns, "link", "set", cluster.node_if(node), "master", switch)
    for gpu in range(cluster.gpus):
        gns, inside, address = cluster.rank_place(node, gpu)
        port = cluster.gpu_port(node, gpu)
        _run("ip", "netns", "add", gns)
        _no_ipv6(lambda *c: _run("ip", "netns", "exec", gns, *c, check=False), ["all", "default"])
        _run("ip", "-n", ns, "link", "add", port, "type", "veth", "peer", "name", inside, "netns", gns)
        _no_ipv6(lambda *c: _ns(cluster, node, *c, check=False), [port])
        _no_ipv6(lambda *c: _run("ip", "netns", "exec", gns, *c, check=False), [inside])
        _run("ip", "-n", ns, "link", "set", port, "master", switch, "up")
        _run("ip", "-n", gns, "addr", "add", f"{address}/24", "dev", inside)
        _run("ip", "-n", gns, "link", "set", inside, "up")
        _run("ip", "-n", gns, "link", "set", "lo", "up")
        _limit(cluster.gpu_rate, lambda *c: _run("ip", "netns", "exec", gns, *c), inside)
        _limit(cluster.gpu_rate, lambda *c: _ns(cluster, node, *c), port)


def teardown(cluster: Cluster) -> list[str]:
    """Remove the run's links and namespaces (idempotent); returns what is still there."""
    remove_run(cluster.run_id)
    return run_leftovers(cluster.run_id)


def remove_run(run_id: str) -> None:
    """Processes still inside the run's namespaces (ranks of a killed run, or their children) are
    killed first, then the host-side veth ends (each takes its peer along), namespaces, bridge."""
    mine = re.compile(re.escape(run_id) + RUN_PARTS).fullmatch
    for ns in _netns_names():
        if mine(ns):
            for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
    for name in _link_names():
        if mine(name) and name != f"{run_id}b":
            _run("ip", "link", "del", name, check=False)  # a veth end: its peer goes with it
    for ns in sorted(_netns_names(), key=lambda n: "gpu" not in n):  # GPUs first
        if mine(ns):
            _run("ip", "netns", "del", ns, check=False)
    _run("ip", "link", "del", f"{run_id}b", check=False)


def _netns_names() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _link_names() -> list[str]:
    out = _run("ip", "-o", "link", "show", check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2]


def run_leftovers(run_id: str) -> list[str]:
    """The run's namespaces and root-namespace links that exist."""
    mine = re.compile(re.escape(run_id) + RUN_PARTS).fullmatch
    return ([f"netns {n}" for n in _netns_names() if mine(n)]
            + [f"link {n}" for n in _link_names() if mine(n)])


def _owner(run_id: str) -> Optional[int]:
    try:
        alias = Path(f"/sys/class/net/{run_id}b/ifalias").read_text().strip()
    except OSError:
        return None
    return int(alias[len(OWNER_TAG):]) if alias.startswith(OWNER_TAG) and alias[len(OWNER_TAG):].isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup(prefix: str, out: TextIO) -> int:
    """Remove every run of `prefix` whose owner is gone; a live run's network is left alone."""
    pattern = re.compile(rf"({re.escape(prefix)}[0-9a-f]{{4}}){RUN_PARTS}")
    runs = sorted({m.group(1) for name in _netns_names() + _link_names() if (m := pattern.fullmatch(name))})
    for run_id in runs:
        owner = _owner(run_id)
        if owner is not None and owner != os.getpid() and _alive(owner):
            print(f"emulate_cluster: {run_id} belongs to running pid {owner}; left alone", file=out)
            continue
        remove_run(run_id)
        left = run_leftovers(run_id)
        print(f"emulate_cluster: removed {run_id}" + (f"; still there: {', '.join(left)}" if left else ""), file=out)
    if not runs:
        print(f"emulate_cluster: nothing of prefix {prefix!r} to remove", file=out)
    return 0


def read_counters(cluster: Cluster) -> list[dict[str, int]]:
    """Each node's interface counters, read inside its namespace."""
    out = []
    for node in range(cluster.nodes):
        files = [f"/sys/class/net/{cluster.node_if(node)}/statistics/{c}" for c in COUNTERS]
        values = _ns(cluster, node, "cat", *files).stdout.split()
        out.append(dict(zip(COUNTERS, map(int, values))))
    return out


def _read(namespace: str, files: Sequence[str]) -> list[int]:
    return [int(v) for v in _run("ip", "netns", "exec", namespace, "cat", *files).stdout.split()]


def read_tier_counters(cluster: Cluster) -> dict[str, list[dict[str, int]]]:
    """Three tiers: the counters of every node's uplink (``inter_node``, read in the node's namespace),
    every GPU's link (``gpu_link``, its end in the GPU's namespace) and every GPU namespace's loopback
    (``intra_gpu``), in node-major order."""
    stats = lambda dev: [f"/sys/class/net/{dev}/statistics/{c}" for c in COUNTERS]  # noqa: E731
    out = {"inter_node": read_counters(cluster), "gpu_link": [], "intra_gpu": []}
    for node in range(cluster.nodes):
        for gpu in range(cluster.gpus):
            gns, inside, _ = cluster.rank_place(node, gpu)
            values = _read(gns, stats(inside) + stats("lo"))
            out["gpu_link"].append(dict(zip(COUNTERS, values[:4])))
            out["intra_gpu"].append(dict(zip(COUNTERS, values[4:])))
    return out


def tier_bytes(before: dict, after: dict, counter: str = "tx_bytes") -> dict[str, int]:
    """Bytes sent per ledger tier between two `read_tier_counters`: inter_node = the uplinks', intra_node
    = the GPU links' less the inter-node bytes (which cross a GPU link on their way out), intra_gpu = the
    loopbacks' (each frame counted once: lo's tx)."""
    sent = {tier: sum(a[counter] - b[counter] for a, b in zip(after[tier], before[tier])) for tier in after}
    return {"intra_gpu": sent["intra_gpu"], "intra_node": sent["gpu_link"] - sent["inter_node"],
            "inter_node": sent["inter_node"]}
