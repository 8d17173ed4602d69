"""The training loop: micro-batches, accumulation, evaluation, logging and checkpoint cadence.

It sees the model and optimizer only through the `Engine` interface, so every sharding setting runs
this same loop. Data is indexed by the number of samples consumed — the loop's whole data state.
"""
from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron.checkpointing.checkpointer import Checkpointer
from megatron.checkpointing.folders import latest_step_dir, save_folder_conflict
from megatron.checkpointing.rank_files import CheckpointError, load_meta
from megatron.checkpointing.reader import CheckpointReader
from megatron.config import config_to_dict
from megatron.engine import Engine
from megatron.logging import MetricsWriter, ProgressLine, format_bytes
from megatron.logging.memory import PhasePeaks
from megatron.logging.metrics import log_print
from megatron.logging.step_profile import ProfiledSteps
from megatron.logging.throughput import Throughput, device_peak_flops
from megatron.model.sizes import model_flops_per_token
from megatron.numerics import NumericsWatch
from megatron.runtime import Runtime
from megatron.schedule import learning_rate, schedule_from_config

# Written to metrics.jsonl (and tensorboard/wandb) after every step, not only every log_interval.
EVERY_STEP_METRICS = ("train/loss_scale", "train/skipped_steps")


@dataclass
class Batching:
    """How one optimizer step's global batch is split over ranks and micro-steps."""
    micro_batch: int
    accumulation: int
    world_size: int
    rank: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.world_size

    def micro_indices(self, start: int, micro_step: int) -> range:
        """Sample indices of this rank's `micro_step` in the global batch that begins at `start`."""
        first = start + micro_step * self.micro_batch * self.world_size + self.rank * self.micro_batch
        return range(first, first + self.micro_batch)


def collate(dataset, indices, device: torch.device) -> dict:
    """The samples at ``indices`` as a batch on ``device``: stacked on the host, pinned when the
    device is a GPU and copied without waiting (a copy from pageable memory makes the host wait for
    the device every micro-step)."""
    samples = [dataset[i] for i in indices]
    batch = {}
    for key in ("tokens", "labels"):
        host = torch.stack([s[key] for s in samples])
        if device.type == "cuda":
            host = host.pin_memory()
        batch[key] = host.to(device, non_blocking=True)
    return batch


class StopRequest:
    """SIGTERM/SIGUSR1 (Slurm's warning before the time limit) and SIGINT (Ctrl-C at a terminal, or
    srun passing one on) -> save at the next step, then exit (75 once saved). Why SIGINT too: Python
    would raise KeyboardInterrupt wherever the rank is, mid-step or mid-save, and print its
    traceback. A second SIGTERM/SIGINT ends the rank at once with one line (rank_guard.py)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum, frame):
        self.requested = True

    def restore(self) -> None:
        """Give the signals back to whoever had them (the loop is over)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class Trainer:
    def __init__(self, cfg, runtime: Runtime, engine: Engine, train_data, valid_data,
                 memory: PhasePeaks | None = None):
        self.cfg = cfg
        self.runtime = runtime
        self.engine = engine
        self.train_data = train_data
        self.valid_data = valid_data
        tcfg = cfg.training
        self.batching = Batching(tcfg.train_micro_batch_size_per_gpu, tcfg.gradient_accumulation_steps,
                                 runtime.world_size, runtime.rank)
        self.schedule = schedule_from_config(cfg)
        self.iteration = 0
        self.consumed_samples = 0
        self.metrics = MetricsWriter(cfg.logging.log_dir, enabled=runtime.is_main,
                                     tensorboard_dir=cfg.logging.tensorboard_dir,
                                     use_wandb=cfg.logging.use_wandb,
                                     wandb_project=cfg.logging.wandb_project,
                                     wandb_group=cfg.logging.wandb_group,
                                     run_config=config_to_dict(cfg))
        ck = cfg.checkpoint
        self.checkpointer = (Checkpointer(ck.save, rank=runtime.rank, world_size=runtime.world_size,
                                          barrier=runtime.barrier, keep_last_n=ck.keep_last_n_checkpoints)
                             if ck.save else None)
        if self.checkpointer is not None and self.checkpointer.commits:
            self.checkpointer.ensure_writable()
            self.checkpointer.lock()  # before resume reads the folder: one run saves there at a time
            # deepy's check again, now under the lock: a run started beside this one may have saved
            # steps between deepy's look and this one (two runs started at once, the other faster)
            problem = save_folder_conflict(ck.save, ck.load, ck.overwrite_checkpoints)
            if problem:
                self.checkpointer.unlock()
                raise CheckpointError(problem)
        self.stop = StopRequest()
        self.numerics = NumericsWatch(tcfg.max_consecutive_skipped_steps, tcfg.loss_spike_factor)
        self.save_deferred = False  # a checkpoint was due at a skipped step
        self.memory = memory or PhasePeaks(runtime.device)  # measured peak memory per phase
        log = cfg.logging
        self.profiler = (ProfiledSteps(log.log_dir, log.profile_step_start, log.profile_step_stop, runtime.rank,
                                       runtime.device) if log.profile else None)
        self.flops_per_token = model_flops_per_token(cfg.model, cfg.model.padded_vocab_size)
        self.peak_flops = device_peak_flops(runtime.device, cfg.precision.precision, cfg.logging.peak_tflops_per_gpu)
        self.last_valid_loss: float | None = None
        self.comm_totals: dict[str, int] = {}
        self.start_iteration = 0
        self.last_saved_iteration: int | None = None
        self.stop_agreed = False
        self.stopped_early = False  # a stop signal ended the run before train_iters

    # -- one optimizer step ------------------------------------------------------------------
    def train_step(self) -> dict:
        # DeepSpeed's rule: a skipped step does not advance the schedule (the data position does).
        lr = learning_rate(self.iteration - self.numerics.skipped_steps + 1, **self.schedule)
        local_loss_sum = torch.zeros((), dtype=torch.float32, device=self.runtime.device)
        for micro_step in range(self.batching.accumulation):
            indices = self.batching.micro_indices(self.consumed_samples, micro_step)
            batch = collate(self.train_data, indices, self.runtime.device)
            local_loss_sum += self.engine.forward_backward(batch)  # stays on the device: no sync per micro-step
        stats = self.engine.optimizer_step(lr)
        # The stop flag and the byte ledger ride with the loss: every rank learns of a signal any rank
        # got, same step. The loop's one host sync: the loss read back after all its work was queued
        # (the engine's step has its own, the gradient norm).
        loss_sum, count, stops = self.engine.all_reduce_sum(
            [local_loss_sum, float(self.batching.accumulation), float(self.stop.requested)], sync_ledger=True)
        stats = {key: float(value) for key, value in stats.items()}  # device scalars, ready by now
        self.stop_agreed = stops > 0
        self.iteration += 1
        self.consumed_samples += self.batching.global_batch
        loss = loss_sum / count
        self.numerics.observe(self.iteration, loss, bool(stats["skipped_step"]), self.runtime.rank)
        return {"train/lm_loss": loss, "train/learning_rate": lr, "train/grad_norm": stats["grad_norm"],
                "train/loss_scale": stats["loss_scale"], "train/skipped_steps": self.numerics.skipped_steps}

    def evaluate(self) -> dict:
        loss_sum = 0.0
        # The same first validation samples every time, so evaluations compare like with like.
        for step in range(self.cfg.training.eval_iters):
            indices = self.batching.micro_indices(0, step)
            loss_sum += float(self.engine.eval_loss(collate(self.valid_data, indices, self.runtime.device)))
        total, count = self.engine.all_reduce_sum([loss_sum, float(self.cfg.training.eval_iters)])
        loss = total / count
        self.last_valid_loss = loss
        return {"validation/lm_loss": loss, "validation/lm_loss_ppl": math.exp(min(loss, 50.0))}

    # -- the loop ----------------------------------------------------------------------------
    def fit(self) -> None:
        try:
            self._fit()
        finally:  # on any way out that unwinds (an error, too); a hard exit leaves a stale lock (lock.py)
            self.close()

    def close(self) -> None:
        """Release the save folder and the signals (idempotent)."""
        if self.checkpointer is not None:
            self.checkpointer.unlock()
        self.stop.restore()

    def _fit(self) -> None:
        tcfg = self.cfg.training
        seq = self.cfg.model.seq_length
        progress = ProgressLine(tcfg.train_iters, start_iter=self.iteration)
        log_interval = self.cfg.logging.log_interval
        while self.iteration < tcfg.train_iters:
            start = time.perf_counter()
            profiled = self.profiler is not None and self.profiler.covers(self.iteration + 1)
            with self.memory.phase("step"):
                if profiled:  # timed by the profile's own span: its trace's export is not the step's
                    metrics, report = self.profiler.run(self.iteration + 1, self.train_step)
                else:
                    metrics = self.train_step()
            seconds = report.step_ms / 1e3 if profiled else time.perf_counter() - start
            speed = Throughput(self.batching.global_batch * seq, seconds, self.flops_per_token,
                               self.runtime.world_size, self.peak_flops)
            metrics.update(speed.metrics())
            if profiled:
                metrics.update(self.profiler.metrics(report))
                log_print(self.profiler.line(self.iteration, report), self.runtime.rank)
            metrics["runtime/samples_consumed"] = self.consumed_samples
            peak_memory = self.memory.peak_bytes("step")
            if peak_memory is not None:
                metrics["runtime/peak_memory_bytes"] = peak_memory
            metrics.update(self._comm_metrics())
            if (self.iteration % log_interval == 0 or self.iteration == tcfg.train_iters or self.iteration == 1
                    or profiled):
                self.metrics.log(self.iteration, metrics)
                if self.runtime.is_main:
                    progress.print(self.iteration, metrics["train/lm_loss"], metrics["train/learning_rate"],
                                   metrics["train/grad_norm"], speed, peak_memory)
            else:  # the numerics every step, as NeoX logs them: a skip between logged steps is not lost
                self.metrics.log(self.iteration, {key: metrics[key] for key in EVERY_STEP_METRICS})
            self.numerics.raise_if_diverged(self.iteration)
            if self.valid_data is not None and tcfg.eval_iters > 0 and (
                    self.iteration % tcfg.eval_interval == 0 or self.iteration == tcfg.train_iters):
                valid = self.evaluate()
                self.metrics.log(self.iteration, valid)
                log_print(f"validation at step {self.iteration} | loss {valid['validation/lm_loss']:.4f} "
                          f"| ppl {valid['validation/lm_loss_ppl']:.2f}", self.runtime.rank)
            factor = self.cfg.checkpoint.checkpoint_factor
            if self.checkpointer is not None and (self.save_deferred or (factor and self.iteration % factor == 0)):
                self.save_if_finite()
            if self.stop_agreed:
                log_print(f"stop signal received at step {self.iteration}: "
                          f"{'saving and ' if self.checkpointer else ''}exiting", self.runtime.rank)
                self.stopped_early = self.iteration < tcfg.train_iters  # train.py's exit code says so
                break
        if self.checkpointer is not None:
            self.save_if_finite()
        self.metrics.close()

    def _comm_metrics(self) -> dict:
        """The byte ledger synced with this step's vector (this step, plus any eval or checkpoint traffic
        that came after the previous step), summed over ranks; the shared all-reduce is counted."""
        metrics = self.engine.comm_metrics()
        for key, value in metrics.items():
            self.comm_totals[key] = self.comm_totals.get(key, 0) + value
        return metrics

    def comm_summary(self) -> str:
        tiers = [(k.split("/")[-1], v) for k, v in self.comm_totals.items() if k.count("/") == 2]
        if not tiers:
            return ""
        steps = max(self.iteration - self.start_iteration, 1)
        per_tier = ", ".join(f"{tier} {format_bytes(v / steps)}" for tier, v in tiers)
        return f"communication per optimizer step (all ranks, ledger): {per_tier}"

    # -- checkpoints -------------------------------------------------------------------------
    def save_if_finite(self) -> None:
        """Save, unless this step was skipped (non-finite gradient) or its loss is not finite: a state
        the last forward could not use must not become `latest` (nor make keep_last_n_checkpoints
        drop a good one). The save is then retried after each step until one is clean."""
        numerics = self.numerics
        if numerics.consecutive_skips or not numerics.last_loss_finite:
            if not self.save_deferred:
                log_print(f"not saving step {self.iteration}: it was skipped (gradient not finite, loss "
                          f"{numerics.last_loss:.4g}); saving after the next clean step instead", self.runtime.rank)
            self.save_deferred = True
            return
        self.save_deferred = False
        self.save()

    def save(self) -> None:
        if self.last_saved_iteration == self.iteration:
            return
        start = time.perf_counter()
        with self.memory.phase("save"):
            rank_state = {"engine": self.engine.checkpoint_state(), "rng": _rng_state()}
            meta = {"consumed_samples": self.consumed_samples, "config": config_to_dict(self.cfg),
                    "numerics": self.numerics.state_dict()}
            # the piece lists travel to rank 0 for index.json by a small all-gather (no file reopened)
            path = self.checkpointer.save(self.iteration, rank_state, meta, gather=self.engine.gather_objects)
        self.last_saved_iteration = self.iteration  # only once written: a failed save raised above
        if self.runtime.is_main:
            size = sum(f.stat().st_size for f in path.iterdir())
            log_print(f"saved checkpoint {path} ({format_bytes(size)}, {time.perf_counter() - start:.2f} s)")

    def resume(self, load_dir: str) -> bool:
        try:
            return self._resume(load_dir)
        except BaseException:  # a refused checkpoint ends the run: it must not keep the folder locked
            self.close()
            raise

    def _resume(self, load_dir: str) -> bool:
        start = time.perf_counter()
        step_dir = latest_step_dir(load_dir)
        if step_dir is None:
            log_print(f"no checkpoint in {load_dir}: starting from scratch", self.runtime.rank)
            return False
        meta = load_meta(step_dir)
        # Each rank reads only the pieces overlapping its own slices (index.json), never full tensors;
        # a step without index.json is indexed by rank 0 alone and shared (one scan, not one per rank).
        reader = CheckpointReader(step_dir, rank=self.runtime.rank, share=self.engine.broadcast_object)
        finetune = bool(self.cfg.checkpoint.finetune)  # weights only: a new run from step 0
        self.engine.load_checkpoint(reader, weights_only=finetune)
        read = (f"rank 0 read {len(reader.opened)} of {reader.world_size} rank files, "
                f"{format_bytes(reader.bytes_copied)}")
        if finetune:
            reader.close()
            log_print(f"finetuning from the weights of {step_dir} ({read})", self.runtime.rank)
            return True
        same_rank = self.runtime.rank if self.runtime.rank < meta["world_size"] else 0
        _set_rng_state(reader.rank_state(same_rank)["rng"])  # through the reader: a file it mapped is not reopened
        reader.close()
        self.iteration = self.start_iteration = meta["iteration"]
        self.consumed_samples = meta["consumed_samples"]
        self.numerics.load_state_dict(meta.get("numerics"))  # skipped steps: the schedule's position
        if self.checkpointer is not None and step_dir.parent.resolve() == self.checkpointer.save_dir.resolve():
            self.last_saved_iteration = self.iteration  # this very state is on disk: not rewritten at once
        log_print(f"resumed from {step_dir} at step {self.iteration} ({read}; {time.perf_counter() - start:.2f} s)",
                  self.runtime.rank)
        return True


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def checkpoint_dir_exists(path: str | None) -> bool:
    return bool(path) and Path(path).is_dir()
