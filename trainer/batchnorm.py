"""BatchNorm running statistics that reference masking cannot corrupt, and their re-estimation.

A masked input is ``[0, x - r]``: its reference half is all zeros, so the activation statistics of a
masked sample differ from an unmasked one's. With plain BatchNorm (the paper and the authors' code),
masked samples move the running statistics that inference uses; with batch-level masking and
momentum 0.1 the statistics saved with a model then depend on whether its last few batches happened
to be masked (measured: validation top-1 swinging by up to 9 points between epochs, a checkpoint at
91.7 whose weights score 99.2 once the statistics are re-estimated on unmasked batches).

`UnmaskedRunningStats` keeps them those of unmasked anchored inputs for batch-level masking: a masked
batch is normalised with its own statistics as usual, and the running statistics are put back to
what they were before it (momentum 0 for that batch). An unmasked batch updates them exactly as
plain BatchNorm does. No device synchronisation.

Sample-level masking needs no fix and gets none: every batch holds about `alpha` masked samples,
so the statistics each batch is normalised with during training, and hence the running average,
are those of one stable mixture. Keeping masked samples out of the running average only (a
version of this module did) makes inference normalise differently from training: measured on the
demo recipe, ID top-1 26% against 98% with plain BatchNorm (docs/batchnorm.md).

`recalibrate` re-estimates the running statistics of an existing model from scratch (a cumulative
average over unmasked batches, "precise BN"): `fastanchor evaluate --recalibrate-bn N` uses it for
models trained before the fix.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["batchnorm_layers", "UnmaskedRunningStats", "recalibrate"]

_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def batchnorm_layers(model: nn.Module) -> list[_BatchNorm]:
    """The BatchNorm layers (1d/2d/3d, SyncBatchNorm) of `model` that keep running statistics."""
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


class UnmaskedRunningStats:
    """Wrap each training forward of batch-level masking: ``with policy.forward(masked): logits = model(inputs)``.

    `masked` is the batch's bool [B] mask on the device (all True or all False).
    """

    def __init__(self, model: nn.Module):
        self.layers = batchnorm_layers(model)

    def _buffers(self) -> list[list[torch.Tensor]]:
        """The layers' statistics, by kind: every running_mean and running_var, every num_batches_tracked."""
        return [[getattr(layer, name) for layer in self.layers for name in _BUFFERS[:2]],
                [layer.num_batches_tracked for layer in self.layers]]

    @contextlib.contextmanager
    def forward(self, masked: torch.Tensor) -> Iterator[None]:
        if not self.layers or not self.layers[0].training:
            yield
            return
        # A handful of kernels whatever the depth (a ResNet-50 has 53 layers, 159 buffers): each kind of
        # buffer is saved as one flat copy, and put back with one select and one multi-tensor copy.
        vectors, counts = self._buffers()
        saved = [torch.cat(vectors), torch.stack(counts)]
        yield
        with torch.no_grad():
            batch_masked = masked[:1].reshape(())  # all or none: the first sample says which, no sync
            vectors, counts = self._buffers()
            kept_vectors = torch.where(batch_masked, saved[0], torch.cat(vectors))
            kept_counts = torch.where(batch_masked, saved[1], torch.stack(counts))
            # .data: BatchNorm's backward keeps the running statistics as (unused) inputs; writing through
            # .data leaves their autograd version as the forward saw it
            torch._foreach_copy_([v.data for v in vectors], list(kept_vectors.split([v.numel() for v in vectors])))
            torch._foreach_copy_([c.data for c in counts], list(kept_counts.unbind()))


@torch.no_grad()
def recalibrate(model: nn.Module, inputs: Iterable[torch.Tensor]) -> int:
    """Re-estimate every BatchNorm layer's running statistics as the plain average over `inputs`
    (network-ready batches, e.g. unmasked anchored training batches); weights are untouched.
    Returns the number of batches used; the model is left in eval mode."""
    layers = batchnorm_layers(model)
    momenta = [layer.momentum for layer in layers]
    for layer in layers:
        layer.reset_running_stats()
        layer.momentum = None  # cumulative average over the batches
    model.train()
    seen = 0
    try:
        for batch in inputs:
            model(batch)
            seen += 1
    finally:
        for layer, momentum in zip(layers, momenta):
            layer.momentum = momentum
        model.eval()
    if layers and seen == 0:
        raise ValueError("no batches to re-estimate the BatchNorm statistics from")
    return seen
