"""One training step, as `fastanchor train` runs it and `fastanchor bench step` measures it.

The anchoring stage's batch goes through Mixup/CutMix (masked samples stay masked), the forward
pass under autocast (BatchNorm keeps masked batches out of its running statistics when asked), the
anchored cross-entropy, the scaled backward, gradient clipping, the optimiser, the EMA copy. With
`skip_nonfinite` a nan/inf loss (on any process) leaves the weights alone and BatchNorm forgets
the batch.

`CompiledTrainStep` (train.compile = step or step-cudagraphs) is the same step as one torch.compile graph with
`fullgraph=True`: the anchoring op (the stage's `assemble`; the host-side draws of masks and references stay
outside), forward, loss, the gradients (`torch.autograd.grad`) and the SGD update (torch's own functional `sgd`, on
the optimiser's own momentum buffers, so checkpoints are the eager step's), the EMA copy and the BatchNorm policy;
with CUDA graphs (mode "reduce-overhead") on top. Why the update is not `optimizer.step()`: docs/compile.md.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch._inductor import config as inductor_config
from torch.optim.sgd import sgd as sgd_update

from fastanchor.pipeline.anchoring import AnchoredBatch, AnchoringStage, DrawnBatch
from fastanchor.pipeline.augment.mixing import BatchMixer
from fastanchor.trainer.batchnorm import UnmaskedRunningStats
from fastanchor.trainer.distributed import Processes
from fastanchor.trainer.losses import anchored_cross_entropy
from fastanchor.trainer.loss_window import finite_on_every_process


class TrainStep:
    """`step(batch)` -> the loss (on the device, no sync), or None when a non-finite loss was skipped.

    `model` is the network whose parameters the optimiser holds; `forward` the module the step calls
    (the model itself, or its DistributedDataParallel / torch.compile wrapper). The step owns the
    gradient scaler, the EMA copy and the mixer: their states are part of a checkpoint.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, device: torch.device,
                 autocast_dtype: torch.dtype | None, forward: torch.nn.Module | None = None,
                 mixer: BatchMixer | None = None, grad_clip: float = 0.0, ema_decay: float = 0.0,
                 label_smoothing: float = 0.0, masked_target: str = "uniform", unmasked_batchnorm: bool = False,
                 skip_nonfinite: bool = False, processes: Processes | None = None):
        self.model, self.optimizer = model, optimizer
        self.forward = forward if forward is not None else model  # (not `or`: a compiled module may refuse bool())
        self.device_type, self.autocast_dtype = device.type, autocast_dtype
        self.scaler = torch.amp.GradScaler(device.type, enabled=autocast_dtype == torch.float16)
        self.ema = copy.deepcopy(model).eval().requires_grad_(False) if ema_decay > 0 else None
        self.ema_decay, self.grad_clip = ema_decay, grad_clip
        self.mixer = mixer or BatchMixer()
        self.label_smoothing, self.masked_target = label_smoothing, masked_target
        self.running_stats = UnmaskedRunningStats(model) if unmasked_batchnorm else None
        self.skip_nonfinite, self.processes = skip_nonfinite, processes

    def on(self, stage: AnchoringStage, images: torch.Tensor, labels: torch.Tensor):
        """One step on a loader's batch through `stage`: (the loss or None, the batch the step trained on)."""
        batch = stage.process(images, labels)
        return self(batch), batch

    def wrap(self, *, ddp: bool, compile: bool, device: torch.device, backend: str = "inductor") -> None:
        """Call the model through DistributedDataParallel (several processes) and/or torch.compile (with `backend`)."""
        if ddp:
            self.forward = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type == "cuda" else None)
        if compile:
            self.forward = torch.compile(self.forward, backend=backend)

    @property
    def eval_model(self) -> torch.nn.Module:
        """The network to validate and save: the EMA copy when there is one."""
        return self.ema if self.ema is not None else self.model

    def __call__(self, batch: AnchoredBatch) -> torch.Tensor | None:
        inputs, mix = self.mixer(batch.inputs, batch.masked)
        kept_buffers = [buffer.clone() for buffer in self.model.buffers()] if self.skip_nonfinite else None
        with torch.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None), \
                self.running_stats.forward(batch.masked) if self.running_stats else contextlib.nullcontext():
            logits = self.forward(inputs)
            loss = anchored_cross_entropy(logits, batch.labels, batch.masked, mix=mix,
                                          label_smoothing=self.label_smoothing, masked_target=self.masked_target)
        if kept_buffers is not None and not finite_on_every_process(self.processes, loss):
            for buffer, kept in zip(self.model.buffers(), kept_buffers):
                buffer.copy_(kept)
            return None
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.ema is not None:
            with torch.no_grad():
                torch._foreach_lerp_(list(self.ema.parameters()), list(self.model.parameters()), 1.0 - self.ema_decay)
                for ema_buffer, buffer in zip(self.ema.buffers(), self.model.buffers()):
                    ema_buffer.copy_(buffer)
        return loss


class CompiledTrainStep(TrainStep):
    """The step as one graph: `on(stage, images, labels)` draws the batch's mask and references on the host
    (`stage.draw`), then runs the anchoring op, forward, loss, gradients and the SGD update compiled with
    `fullgraph=True` (`cudagraphs`: replayed as CUDA graphs). Takes what `trainer/config.py`'s
    `compiled_step_limits` lets through: SGD, bf16 or no autocast, no mixing, no skipped steps, one process."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.SGD, *, cudagraphs: bool = False,
                 backend: str = "inductor", **settings):
        super().__init__(model, optimizer, **settings)
        if not isinstance(optimizer, torch.optim.SGD) or self.scaler.is_enabled() or self.mixer.enabled \
                or self.skip_nonfinite:
            raise ValueError("a compiled step takes SGD, no fp16 scaler, no mixing and no skipped steps")
        self.cudagraphs = cudagraphs
        self.compile_with(backend)
        self.lrs: list[torch.Tensor] | None = None  # each group's rate as a device scalar: a new rate is no new graph

    def compile_with(self, backend: str) -> None:
        """Compile the step with torch.compile's `backend` (train.compile_backend: inductor; aot_eager traces the same
        one graph, forward and backward, without generating code; eager runs Dynamo's trace as it is)."""
        self.compiled = torch.compile(self._fused, fullgraph=True, backend=backend,
                                      mode="reduce-overhead" if self.cudagraphs else None)

    def wrap(self, *, ddp: bool, compile: bool, device: torch.device, backend: str = "inductor") -> None:
        if ddp or compile:
            raise ValueError("a compiled step runs in one process and compiles itself")

    def _momentum_buffers(self) -> list[list[torch.Tensor | None]]:
        """Each group's momentum buffers, made (zeros) where SGD has none yet: SGD's first step sets a buffer to the
        gradient, which zeros times the momentum plus the gradient gives too (dampening 0), and in the graph every
        buffer must exist before the first step."""
        buffers = []
        for group in self.optimizer.param_groups:
            if group["momentum"] == 0:
                buffers.append([None] * len(group["params"]))
                continue
            for parameter in group["params"]:
                state = self.optimizer.state[parameter]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
                if self.cudagraphs:  # updated in place at a fixed address (a loaded state brings new ones each time)
                    torch._dynamo.mark_static_address(state["momentum_buffer"])
            buffers.append([self.optimizer.state[p]["momentum_buffer"] for p in group["params"]])
        return buffers

    def _fused(self, assemble, drawn: DrawnBatch, lrs: list[torch.Tensor], buffers) -> torch.Tensor:
        batch = assemble(drawn)
        groups = self.optimizer.param_groups
        parameters = [p for group in groups for p in group["params"]]
        with torch.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None), \
                self.running_stats.forward(batch.masked) if self.running_stats else contextlib.nullcontext():
            logits = self.model(batch.inputs)
            loss = anchored_cross_entropy(logits, batch.labels, batch.masked, label_smoothing=self.label_smoothing,
                                          masked_target=self.masked_target)
        value = loss.detach()
        grads = list(torch.autograd.grad(loss, parameters))
        with torch.no_grad():
            if self.grad_clip > 0:  # clip_grad_norm_'s arithmetic, on the gradients in hand
                total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
                torch._foreach_mul_(grads, torch.clamp(self.grad_clip / (total + 1e-6), max=1.0))
            start = 0
            for group, lr, group_buffers in zip(groups, lrs, buffers):
                count = len(group["params"])
                sgd_update(group["params"], grads[start:start + count], group_buffers,
                                    weight_decay=group["weight_decay"], momentum=group["momentum"], lr=lr,
                                    dampening=group["dampening"], nesterov=group["nesterov"], maximize=False,
                                    foreach=True, has_sparse_grad=False)
                start += count
            if self.ema is not None:
                torch._foreach_lerp_(list(self.ema.parameters()), list(self.model.parameters()), 1.0 - self.ema_decay)
                for ema_buffer, buffer in zip(self.ema.buffers(), self.model.buffers()):
                    ema_buffer.copy_(buffer)
        return value

    def on(self, stage: AnchoringStage, images: torch.Tensor, labels: torch.Tensor):
        drawn = stage.draw(images, labels)
        groups = self.optimizer.param_groups
        if self.lrs is None:
            self.lrs = [torch.tensor(float(g["lr"]), device=drawn.images.device) for g in groups]
            if self.cudagraphs:  # filled in place below: fixed addresses, as the momentum buffers have
                for lr in self.lrs:
                    torch._dynamo.mark_static_address(lr)
        for lr, group in zip(self.lrs, groups):
            lr.fill_(group["lr"])
        # torch.autograd.grad inside the graph; asked for CUDA graphs, a graph inductor would not capture is an error,
        # not a silent fallback to the compiled step
        with torch._dynamo.config.patch(trace_autograd_ops=True), \
                inductor_config.patch({"triton.cudagraph_or_error": self.cudagraphs}):
            loss = self.compiled(stage.assemble, drawn, self.lrs, self._momentum_buffers())
        # the update above is the optimizer's step: say so to an LR scheduler, which otherwise warns, at its first
        # step, that it was called before `optimizer.step()` (the flag its wrapper of optimizer.step sets)
        self.optimizer._opt_called = True
        return (loss.clone() if self.cudagraphs else loss), drawn  # a replay overwrites its outputs

    def __call__(self, batch: AnchoredBatch):
        raise TypeError("a compiled step trains on a loader's batch through its stage: step.on(stage, images, labels)")
