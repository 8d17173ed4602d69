"""Parity with the peers: train the same GPT-NeoX, data and seed under our engine or a peer on gloo
ranks, and record the global mean loss of every optimizer step (docs/peers.md). The command line is
bench/peers.py (``--peer ours|deepspeed|fsdp2 --preset zero3|hsdp``, ``--compare A B``).

Peers: ``ours`` (the ZeRO-topo engine built from the config, preset zero3 = (4,4,4) or hsdp =
(2,2,2) x 2 replicas on the simulated 2 nodes x 2 ranks), ``deepspeed`` (DeepSpeed ZeRO-3 on its CPU
accelerator) and ``fsdp2`` (torch ``fully_shard``: a 1-D mesh of 4 for zero3, a (replicate=2, shard=2)
mesh for hsdp). Each run is fp32, AdamW (0.9, 0.95, eps 1e-8, weight decay 0.01 on matrices only),
gradient clipping 1.0 and a constant learning rate 1e-3, for every requested accumulation count.

The command line trains the parity shape (``Shape()``: 2 layers, hidden 64, 2 x 2 ranks). The pieces
(``Shape``, ``run_config``, ``micro_batch``, the trainers) take any layout, model size and
accumulation; megatron/benchmarking/compare_peers.py times the same trainers on an emulated cluster.

``launch`` starts the ranks (bench/peers.py with --rank, through megatron/launch/spawner.py;
rendezvous through a FileStore in a private folder, so parallel runs never collide on a port); each
rank writes its result before tearing down the process group and the launcher judges by those files
(gloo's teardown can hang or abort after the work is done: it must not lose finished work).
DeepSpeed's first start JIT-compiles a shared-memory op, cached under ``TORCH_EXTENSIONS_DIR``
(default ``~/.cache/neox_topo/torch_extensions``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from megatron.benchmarking import CHECKOUT
from megatron.config import NeoXConfig, load_config
from megatron.engine import adamw_param_groups, lm_loss
from megatron.launch.spawner import RankCommand, RankProcesses
from megatron.model import GPTNeoX
from megatron.topology import ShardLayout

PEERS = ("ours", "deepspeed", "fsdp2")
PRESETS = ("zero3", "hsdp")
# (peer, preset) pairs that mean something: DeepSpeed has no hybrid sharding that matches hsdp.
SUPPORTED = {("ours", "zero3"), ("ours", "hsdp"), ("deepspeed", "zero3"), ("fsdp2", "zero3"), ("fsdp2", "hsdp")}
LR = 1e-3                        # constant: no schedule can differ between peers
PG_TIMEOUT_S = 300
DEFAULT_EXTENSIONS_DIR = Path.home() / ".cache" / "neox_topo" / "torch_extensions"
RANK_SCRIPT = CHECKOUT / "bench" / "peers.py"  # the command line; with --rank R --workdir W it is one rank


class PeerError(Exception):
    """A user mistake (unsupported peer/preset, unreadable result file); reported as one line."""


# ----------------------------------------------------------------------------------- the shared run

@dataclass(frozen=True)
class Shape:
    """What every peer of one run shares: the layout, the model's size and the batch.

    The defaults are the parity run of docs/peers.md (149,248 parameters on 2 x 2 ranks)."""
    tiers: tuple = (2, 2)        # ranks per tier, slowest first: (nodes, ranks per node) or (nodes, gpus, gcds)
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    seq_length: int = 32
    vocab: int = 384
    micro_batch: int = 2         # sequences per rank per micro-step
    accumulation: int = 1

    @property
    def nodes(self) -> int:
        return self.tiers[0]

    @property
    def ranks_per_node(self) -> int:
        return math.prod(self.tiers[1:])

    @property
    def world_size(self) -> int:
        return math.prod(self.tiers)

    def with_accumulation(self, accumulation: int) -> "Shape":
        return dataclasses.replace(self, accumulation=accumulation)

    def describe(self) -> dict:
        return {"tiers": list(self.tiers), "world_size": self.world_size, "num_layers": self.num_layers,
                "hidden_size": self.hidden_size, "num_heads": self.num_heads, "seq_length": self.seq_length,
                "vocab": self.vocab, "micro_batch": self.micro_batch, "accumulation": self.accumulation,
                "global_batch": self.micro_batch * self.world_size * self.accumulation}


PARITY = Shape()  # what the command line (and tests/test_peers.py) trains


def run_config(shape: Shape, preset: str, overrides: Sequence[str] = ()) -> NeoXConfig:
    """The one config every peer reads: tiny-cpu's optimizer, the shape's model, layout and batch,
    the preset file (configs/<preset>.yml), then ``overrides`` (``key=value``, as ``--set``)."""
    s = shape
    sizes = [f"num_layers={s.num_layers}", f"hidden_size={s.hidden_size}", f"num_attention_heads={s.num_heads}",
             f"seq_length={s.seq_length}", f"train_micro_batch_size_per_gpu={s.micro_batch}",
             f"gradient_accumulation_steps={s.accumulation}",
             f"train_batch_size={s.micro_batch * s.accumulation * s.world_size}",
             f"topology.simulate=[{', '.join(map(str, s.tiers))}]"]
    fixed = ["lr_decay_style=constant", "hidden_dropout=0.0", "attention_dropout=0.0", "gradient_clipping=1.0",
             "weight_decay=0.01"]
    files = [CHECKOUT / "configs" / "tiny-cpu.yml", CHECKOUT / "configs" / f"{preset}.yml"]
    return load_config(files, [*sizes, *fixed, *overrides], notices=[])


def build_model(cfg: NeoXConfig, shape: Shape) -> GPTNeoX:
    """Seeded identically on every rank, so all ranks (and all peers) start from the same weights."""
    torch.manual_seed(cfg.data.seed)
    return GPTNeoX(cfg.model, shape.vocab)


def micro_batch(cfg: NeoXConfig, shape: Shape, step: int, micro: int, rank: int) -> dict:
    """Rank ``rank``'s slice of the global batch of (step, micro): the same tokens for every peer."""
    gen = torch.Generator().manual_seed(cfg.data.seed * 1_000_003 + step * 1_000 + micro)
    mb = shape.micro_batch
    tokens = torch.randint(0, shape.vocab, (mb * shape.world_size, shape.seq_length + 1), generator=gen)
    mine = tokens[rank * mb:(rank + 1) * mb]
    return {"tokens": mine[:, :-1].contiguous(), "labels": mine[:, 1:].contiguous()}


def global_mean(local_losses: list[float]) -> float:
    """Mean over every rank's micro-batch losses (equal token counts, so the mean over tokens)."""
    buf = torch.tensor([sum(local_losses), float(len(local_losses))], dtype=torch.float64)
    dist.all_reduce(buf)
    return float(buf[0] / buf[1])


@torch.no_grad()
def untrained_losses(cfg: NeoXConfig, shape: Shape, steps: int) -> list[float]:
    """Per-step global mean loss of the initial weights on the same batches (one process): the
    trajectory a peer that never updated its weights would report. Parity within the tolerance means
    something only when the trained losses are far from these."""
    model = build_model(cfg, shape)
    losses = []
    for step in range(steps):
        per_micro = []
        for m in range(shape.accumulation):
            parts = [micro_batch(cfg, shape, step, m, r) for r in range(shape.world_size)]
            batch = {k: torch.cat([part[k] for part in parts]) for k in parts[0]}
            per_micro.append(lm_loss(model, batch).item())
        losses.append(sum(per_micro) / shape.accumulation)
    return losses


def scalar(value) -> float:
    """A norm as a float, whether it came back as a float, a tensor or a DTensor."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


# ----------------------------------------------------------------------------------------- the peers
#
# A trainer is one peer built on this rank: ``step(i)`` runs optimizer step i (every micro-batch of
# it) and returns this rank's micro-batch losses and the pre-clip global gradient norm. The loop
# around it (train() here, the timed loop of bench/compare_peers.py) is the caller's, so every peer
# is written once and timed alike.

class OursTrainer:
    peer = "ours"

    def __init__(self, cfg: NeoXConfig, shape: Shape, rank: int):
        from megatron.engine.setup import engine_from_config
        self.cfg, self.shape, self.rank = cfg, shape, rank
        self.engine = engine_from_config(cfg, build_model(cfg, shape), lm_loss, shape.world_size)
        self.ledger = self.engine.ledger  # what this rank sent, by (phase, tier)

    def step(self, step: int) -> tuple[list[float], float]:
        local = [self.engine.forward_backward(micro_batch(self.cfg, self.shape, step, m, self.rank)).item()
                 for m in range(self.shape.accumulation)]
        return local, scalar(self.engine.optimizer_step(LR)["grad_norm"])

    def info(self) -> dict:
        return {"factors": list(self.engine.groups.factors.as_tuple())}

    def close(self) -> None:
        pass


def deepspeed_config(cfg: NeoXConfig, shape: Shape, hpz: int = 1, quantized_weights: bool = False,
                     quantized_gradients: bool = False, mics: int = 0, mics_hierarchical: bool = True,
                     bf16: bool = False) -> dict:
    """ZeRO-3 as DeepSpeed 0.19.8 runs it by default, plus hpZ (``zero_hpz_partition_size``) and
    qwZ / qgZ when asked: the ZeRO++ knobs. ``mics`` > 0: MiCS with shards of that many ranks
    (``mics_shard_size``) and, unless ``mics_hierarchical`` is false, its hierarchical gather
    (``mics_hierarchical_params_gather``); DeepSpeed
    reduces gradients across the MiCS replicas only at the accumulation boundary. MiCS was removed in
    0.19.7: it needs DeepSpeed 0.19.6 (compare_peers runs it from DEEPSPEED_MICS_DIR). ``bf16``: DeepSpeed's
    bf16 mode (bf16 weights and compute, fp32 master weights and optimizer; gradients reduced in bf16)."""
    opt = cfg.optimizer
    zero = {"stage": 3}
    if hpz > 1:
        zero["zero_hpz_partition_size"] = hpz
    if quantized_weights:
        zero["zero_quantized_weights"] = True
    if quantized_gradients:
        zero["zero_quantized_gradients"] = True
    if mics > 0:
        zero["mics_shard_size"] = mics
        zero["mics_hierarchical_params_gather"] = mics_hierarchical
    return {
        "train_micro_batch_size_per_gpu": shape.micro_batch,
        "gradient_accumulation_steps": shape.accumulation,
        "zero_optimization": zero,
        # torch_adam: torch.optim.AdamW over DeepSpeed's fp32 partitions (no cpu_adam op to compile);
        # per-group weight decay comes from the parameter groups passed as model_parameters.
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(opt.betas), "eps": opt.eps,
                                                  "weight_decay": opt.weight_decay, "torch_adam": True}},
        "gradient_clipping": opt.gradient_clipping,
        "fp16": {"enabled": False},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10_000,
        "wall_clock_breakdown": False,
    }


class DeepSpeedTrainer:
    peer = "deepspeed"

    def __init__(self, cfg: NeoXConfig, shape: Shape, rank: int, **zero_options):
        import deepspeed
        self.cfg, self.shape, self.rank = cfg, shape, rank
        config = deepspeed_config(cfg, shape, **zero_options)
        model = build_model(cfg, shape)
        if zero_options.get("mics", 0) > 0:  # MiCS partitions the model in its own Init context
            deepspeed.zero.MiCS_Init(module=model, config_dict_or_path=config)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, config=config, model_parameters=adamw_param_groups(model, cfg.optimizer.weight_decay))
        self.version = deepspeed.__version__

    def step(self, step: int) -> tuple[list[float], float]:
        local = []
        for m in range(self.shape.accumulation):
            loss = lm_loss(self.engine, micro_batch(self.cfg, self.shape, step, m, self.rank))
            self.engine.backward(loss)  # DeepSpeed divides by the accumulation count itself
            self.engine.step()          # an optimizer step only at the accumulation boundary
            local.append(loss.item())
        return local, scalar(self.engine.get_global_grad_norm())

    def info(self) -> dict:
        return {"deepspeed": self.version}

    def close(self) -> None:
        self.engine.destroy()


class FSDP2Trainer:
    """FSDP2 ``fully_shard`` on each unit, then the root. The mesh mirrors our sharding: ``os`` ranks
    shard, N / os replicate (HSDP when > 1). The knobs an expert turns for gradient accumulation:

    - ``reshard_after_forward``: True (the default: gather again in backward), False (keep the gathered
      weights from forward to backward), or an int: reshard after forward to groups of that many ranks
      (node-local when it is the node's rank count), so backward's gather stays inside them.
    - ``defer``: what the micro-batches before the last skip. "none" (the default: every micro-batch
      reduces fully); "all_reduce" (HSDP: reduce-scatter in the shard group every micro-batch, the
      cross-replica all-reduce only on the last: ``set_requires_all_reduce``); "gradient" (no gradient
      communication before the last micro-batch, unsharded gradients kept meanwhile:
      ``set_requires_gradient_sync``).
    """
    peer = "fsdp2"

    def __init__(self, cfg: NeoXConfig, shape: Shape, rank: int, reshard_after_forward=True, defer: str = "none",
                 bf16: bool = False):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        if defer not in ("none", "all_reduce", "gradient"):
            raise PeerError(f"defer {defer!r}: none, all_reduce or gradient")
        self.cfg, self.shape, self.rank, self.defer = cfg, shape, rank, defer
        layout = ShardLayout.from_config(cfg)
        shard = layout.factors.os
        replicas = layout.world_size // shard
        if replicas > 1:  # row-major: the shard groups are consecutive ranks, i.e. one node each
            self.mesh = init_device_mesh("cpu", (replicas, shard), mesh_dim_names=("replicate", "shard"))
        else:
            self.mesh = init_device_mesh("cpu", (shard,), mesh_dim_names=("shard",))
        if defer == "all_reduce" and replicas == 1:
            raise PeerError("defer all_reduce needs HSDP (a replicate dimension); use defer gradient")
        self.reshard_after_forward = reshard_after_forward
        # bf16: weights gathered and gradients reduced in bf16 (half the bytes), fp32 sharded master weights
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
        self.model = build_model(cfg, shape)
        for unit in self.model.units():  # the same units our engine shards, then the root
            fully_shard(unit, mesh=self.mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
        fully_shard(self.model, mesh=self.mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(adamw_param_groups(self.model, opt.weight_decay), lr=LR,
                                           betas=tuple(opt.betas), eps=opt.eps, foreach=False)

    def step(self, step: int) -> tuple[list[float], float]:
        accumulation = self.shape.accumulation
        local = []
        for m in range(accumulation):
            last = m == accumulation - 1
            if self.defer == "all_reduce":
                self.model.set_requires_all_reduce(last)
            elif self.defer == "gradient":
                self.model.set_requires_gradient_sync(last)
            loss = lm_loss(self.model, micro_batch(self.cfg, self.shape, step, m, self.rank))
            (loss / accumulation).backward()
            local.append(loss.item())
        norm = scalar(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optimizer.gradient_clipping))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return local, norm

    def info(self) -> dict:
        return {"mesh": list(self.mesh.shape), "reshard_after_forward": self.reshard_after_forward,
                "defer": self.defer}

    def close(self) -> None:
        pass


TRAINERS = {"ours": OursTrainer, "deepspeed": DeepSpeedTrainer, "fsdp2": FSDP2Trainer}


def make_trainer(peer: str, cfg: NeoXConfig, shape: Shape, rank: int, **options):
    """``options``: DeepSpeed's ``hpz``, ``quantized_weights``, ``quantized_gradients``, ``mics``,
    ``mics_hierarchical``, ``bf16``; FSDP2's ``bf16``,
    ``reshard_after_forward`` and ``defer``; none for ours (it reads everything from ``cfg``)."""
    return TRAINERS[peer](cfg, shape, rank, **options)


def train(trainer, steps: int) -> dict:
    """The parity loop: every step's global mean loss and pre-clip global gradient norm."""
    losses, norms = [], []
    for step in range(steps):
        local, norm = trainer.step(step)
        losses.append(global_mean(local))
        norms.append(norm)
    return {"losses": losses, "grad_norms": norms, **trainer.info()}


# --------------------------------------------------------------------------------- one rank (child)

def rank_main(args: argparse.Namespace) -> None:
    """Join the group, train every accumulation count, write the result file, tear down, exit."""
    workdir, rank = Path(args.workdir), args.rank
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{workdir / 'store'}", rank=rank,
                                world_size=PARITY.world_size, timeout=timedelta(seconds=PG_TIMEOUT_S))
        runs = {}
        for accumulation in args.accumulation:
            start = time.perf_counter()
            shape = PARITY.with_accumulation(accumulation)
            cfg = run_config(shape, args.preset)
            trainer = make_trainer(args.peer, cfg, shape, rank)
            result = train(trainer, args.steps)
            trainer.close()
            result["seconds"] = round(time.perf_counter() - start, 2)
            if rank == 0:
                result["untrained_losses"] = untrained_losses(cfg, shape, args.steps)
            runs[str(accumulation)] = result
        payload = {"ok": True, "runs": runs}
    except BaseException:  # noqa: BLE001 - everything a rank raises goes to the launcher
        payload = {"ok": False, "error": traceback.format_exc()}
    tmp = workdir / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, workdir / f"rank{rank}.json")
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# ----------------------------------------------------------------------------------------- launcher

def rank_env(rank: int) -> dict:
    world = PARITY.world_size
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="0",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(DEFAULT_EXTENSIONS_DIR))
    return env


def launch(args: argparse.Namespace) -> dict:
    """Start PARITY.world_size ranks of RANK_SCRIPT, wait for their result files, return rank 0's runs."""
    workdir = Path(tempfile.mkdtemp(prefix=f"peers_{args.peer}_{args.preset}_"))
    rank_args = ["--peer", args.peer, "--preset", args.preset, "--steps", str(args.steps),
                 "--accumulation", *map(str, args.accumulation)]
    commands = [RankCommand([sys.executable, str(RANK_SCRIPT), *rank_args, "--rank", str(rank),
                             "--workdir", str(workdir)], rank_env(rank), output=workdir / f"rank{rank}.log", cwd=CHECKOUT)
                for rank in range(PARITY.world_size)]
    paths = [workdir / f"rank{r}.json" for r in range(PARITY.world_size)]
    deadline = time.monotonic() + args.timeout
    with RankProcesses(grace_s=0) as ranks:  # on the way out: stragglers killed, their results are on disk
        ranks.start_all(commands)
        while time.monotonic() < deadline and not all(p.exists() for p in paths):
            ranks.next_exit(timeout=0.1)
            failed = [r for r, p in enumerate(paths) if p.exists() and not json.loads(p.read_text())["ok"]]
            died = [r for r in ranks.ended if not paths[r].exists()]
            if failed or died:
                break  # peers of a failed rank wait in a collective until the group timeout
        ranks.wait_all(timeout_s=10)  # a short grace for a clean teardown once the results are in
    results = []
    for rank, path in enumerate(paths):
        if not path.exists():
            tail = (workdir / f"rank{rank}.log").read_text()[-3000:]
            raise PeerError(f"rank {rank} of {args.peer}/{args.preset} wrote no result (log {workdir}); "
                            f"its log ends:\n{tail}")
        result = json.loads(path.read_text())
        if not result["ok"]:
            raise PeerError(f"rank {rank} of {args.peer}/{args.preset} raised (log {workdir}):\n{result['error']}")
        results.append(result["runs"])
    for rank, runs in enumerate(results[1:], start=1):  # every rank saw the same global losses
        for acc, run in runs.items():
            if run["losses"] != results[0][acc]["losses"]:
                raise PeerError(f"rank {rank} reports other global losses than rank 0 (accumulation {acc})")
    shutil.rmtree(workdir, ignore_errors=True)
    return results[0]


# --------------------------------------------------------------------------------------- comparing

def load_result(path: str | Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise PeerError(f"cannot read peer result {path}: {err}") from None


def max_loss_differences(a: dict, b: dict) -> dict[str, float]:
    """Largest per-step |loss_a - loss_b| for every accumulation count both results hold."""
    common = sorted(set(a["runs"]) & set(b["runs"]), key=int)
    if not common:
        raise PeerError(f"{a['peer']} and {b['peer']} share no accumulation count")
    diffs = {}
    for acc in common:
        la, lb = a["runs"][acc]["losses"], b["runs"][acc]["losses"]
        if len(la) != len(lb):
            raise PeerError(f"accumulation {acc}: {len(la)} steps against {len(lb)}")
        diffs[acc] = max(abs(x - y) for x, y in zip(la, lb))
    return diffs


def describe(result: dict) -> str:
    lines = []
    for acc, run in sorted(result["runs"].items(), key=lambda kv: int(kv[0])):
        losses = " ".join(f"{x:.6f}" for x in run["losses"])
        untrained = run.get("untrained_losses") or run["losses"]
        moved = max(abs(x - y) for x, y in zip(run["losses"], untrained))
        lines.append(f"{result['peer']:>9} {result['preset']:>5} accumulation {acc}: losses {losses} "
                     f"(max |loss - untrained| {moved:.2e}; {run['seconds']:.1f} s)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peer", choices=PEERS)
    p.add_argument("--preset", choices=PRESETS)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--accumulation", type=int, nargs="+", default=[1], help="accumulation counts, one run each")
    p.add_argument("--out", help="result JSON (per-step global mean losses, grad norms)")
    p.add_argument("--timeout", type=float, default=900, help="seconds for the whole launch")
    p.add_argument("--compare", nargs=2, metavar="RESULT", help="print the max per-step loss difference of two results")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    return p.parse_args(argv)
