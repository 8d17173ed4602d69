"""The engine of a single process: autocast to the compute dtype, fp32 parameters, torch's AdamW
(fused by default), clipping and the fp16 loss scale. The single-process reference every sharded
layout is checked against.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from megatron.checkpointing.param_slices import check_shapes, make_engine_state
from megatron.config.schema import OptimizerConfig
from megatron.engine.protocol import LossFn, adamw_param_groups, autocast_dtype_of
from megatron.loss_scale import DynamicLossScale, LossScaleSettings


class SingleProcessEngine:
    """One process: autocast to the compute dtype, fp32 parameters and torch's AdamW."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, opt_cfg: OptimizerConfig, precision: str,
                 accumulation_steps: int, device: torch.device, loss_scaling: Optional[LossScaleSettings] = None):
        self.model = model.to(device)
        self.loss_fn = loss_fn
        self.opt_cfg = opt_cfg
        self.device = device
        self.accumulation_steps = accumulation_steps
        self.autocast_dtype = autocast_dtype_of(precision)
        # fused: one kernel for every parameter, told of a non-finite gradient on the device (found_inf)
        self.fused = bool(opt_cfg.fused)
        self.optimizer = torch.optim.AdamW(
            adamw_param_groups(model, opt_cfg.weight_decay), lr=0.0, betas=tuple(opt_cfg.betas),
            eps=opt_cfg.eps, **({"fused": True} if self.fused else {"foreach": False}))
        # fp16 needs loss scaling (the fp16 block's settings); bf16 and fp32 run at scale 1.
        self.loss_scale = DynamicLossScale(loss_scaling or LossScaleSettings.from_precision(precision))

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.autocast_dtype,
                              enabled=self.autocast_dtype is not None)

    def forward_backward(self, batch: dict) -> torch.Tensor:
        self.model.train()
        with self._autocast():
            loss = self.loss_fn(self.model, batch)
        (loss / self.accumulation_steps * self.loss_scale.scale).backward()
        return loss.detach()

    def optimizer_step(self, lr: float) -> dict:
        """Unscale, clip, AdamW; a step whose gradients are not finite (any precision) is skipped:
        parameters, moments and AdamW's step count stay as they were. Fused, nothing here waits for
        the device (the kernel skips on its own ``found_inf``; only fp16's dynamic scale reads the
        norm back): the stats are device scalars the loop reads once the step is queued."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        scale = self.loss_scale.scale
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if scale != 1.0 and grads:
            torch._foreach_div_(grads, scale)
        clip = self.opt_cfg.gradient_clipping
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        not_finite = (~torch.isfinite(grad_norm)).float()
        if self.fused:
            self.optimizer.found_inf = not_finite  # read by the fused step (torch's GradScaler protocol)
            self.optimizer.step()
            if self.loss_scale.dynamic:
                self.loss_scale.update(not bool(not_finite))
        else:
            finite = math.isfinite(float(grad_norm))
            if finite:
                self.optimizer.step()
            self.loss_scale.update(finite)
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm.detach(), "loss_scale": scale, "skipped_step": not_finite}

    @torch.no_grad()
    def eval_loss(self, batch: dict) -> torch.Tensor:
        self.model.eval()
        with self._autocast():
            return self.loss_fn(self.model, batch).detach()

    def all_reduce_sum(self, values: list, sync_ledger: bool = False) -> list[float]:
        return [float(v) for v in values]

    def gather_objects(self, obj: Any) -> list:
        return [obj]

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def comm_metrics(self) -> dict:
        return {}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().clone() for k, v in self.model.state_dict().items()}

    # -- checkpoint hooks: one rank, so this rank's pieces are whole parameters -----------------
    def checkpoint_state(self) -> dict:
        pieces, shapes = [], {}
        step = 0
        for name, param in self.model.named_parameters():
            state = self.optimizer.state.get(param, {})
            zeros = torch.zeros(param.numel())
            step = int(state["step"]) if "step" in state else step
            shapes[name] = tuple(param.shape)
            pieces.append({"name": name, "offset": 0, "length": param.numel(),
                           "master": param.detach().float().flatten().cpu().clone(),
                           "exp_avg": state.get("exp_avg", zeros).detach().float().flatten().cpu().clone(),
                           "exp_avg_sq": state.get("exp_avg_sq", zeros).detach().float().flatten().cpu().clone()})
        return make_engine_state(pieces, shapes, step, {"loss_scaler": self.loss_scale.state_dict()})

    def _step_tensor(self, step: int, param: torch.Tensor) -> torch.Tensor:
        """AdamW's step count as torch keeps it: on the parameter's device for the fused kernel."""
        return torch.tensor(float(step), dtype=torch.float32, device=param.device if self.fused else "cpu")

    @torch.no_grad()
    def load_full_state(self, full: dict) -> None:
        params = dict(self.model.named_parameters())
        check_shapes(full["shapes"], {n: tuple(p.shape) for n, p in params.items()}, "being loaded")
        for name, param in params.items():
            param.copy_(full["params"][name])
            if full["step"] > 0:
                self.optimizer.state[param] = {
                    "step": self._step_tensor(full["step"], param),
                    "exp_avg": full["exp_avg"][name].to(param.device, param.dtype).clone(),
                    "exp_avg_sq": full["exp_avg_sq"][name].to(param.device, param.dtype).clone()}
        self.loss_scale.load_state_dict(full.get("loss_scaler"))

    @torch.no_grad()
    def load_checkpoint(self, reader, weights_only: bool = False) -> None:
        """Load from a checkpoint reader (megatron.checkpointing.reader): the only rank reads whole
        parameters. ``weights_only`` (finetune): no optimizer state, step 0."""
        params = dict(self.model.named_parameters())
        check_shapes(reader.shapes, {n: tuple(p.shape) for n, p in params.items()}, str(reader.step_dir))
        step = 0 if weights_only else int(reader.step)
        keys = ("master",) if weights_only else ("master", "exp_avg", "exp_avg_sq")
        for name, param in params.items():
            values = reader.read(name, 0, param.numel(), keys)
            param.copy_(values["master"].view(param.shape))
            if step > 0:
                self.optimizer.state[param] = {
                    "step": self._step_tensor(step, param),
                    "exp_avg": values["exp_avg"].view(param.shape).to(param.device, param.dtype),
                    "exp_avg_sq": values["exp_avg_sq"].view(param.shape).to(param.device, param.dtype)}
        self.loss_scale.load_state_dict(reader.shared.get("loss_scaler"))
