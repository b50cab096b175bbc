"""One training step, as `fastanchor train` runs it and `fastanchor bench step` measures it.

The anchoring stage's batch goes through Mixup/CutMix (masked samples stay masked), the forward
pass under autocast (BatchNorm keeps masked batches out of its running statistics when asked), the
anchored cross-entropy, the scaled backward, gradient clipping, the optimiser, the EMA copy. With
`skip_nonfinite` a nan/inf loss (on any process) leaves the weights alone and BatchNorm forgets
the batch.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from fastanchor.pipeline.anchoring import AnchoredBatch
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

    def wrap(self, *, ddp: bool, compile: bool, device: torch.device) -> None:
        """Call the model through DistributedDataParallel (several processes) and/or torch.compile."""
        if ddp:
            self.forward = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type == "cuda" else None)
        if compile:
            self.forward = torch.compile(self.forward)

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
