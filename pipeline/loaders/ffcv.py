"""FFCV loading: iterate a `.beton` file (see pipeline/beton/) with FFCV's Loader.

`FFCVLoader` keeps the batch contract of
`TorchvisionLoader`: it iterates (uint8 [B, 3, H, W] channels-last images, int64 labels) on the
training device, `set_epoch(epoch)` fixes the sample order, `len()` is the number of batches.

What FFCV does differently from the torchvision baseline (see also FFCVLoader's docstring):

* FFCV's "workers" are threads of one numba parallel loop inside this process, not processes.
  FFCV also sets torch's intra-op thread count (process-wide) to `workers`; FFCVLoader sets it
  back after construction and once each epoch's loading thread has started.
* Decoding happens into buffers that FFCV reuses every `batches_ahead + 2` batches, so each batch
  is copied out (a clone on the CPU, a copy on a side stream on CUDA) before it is handed over:
  a batch stays valid for as long as the caller keeps it, as with a torch DataLoader.
* The sample order is reproducible per (seed, epoch); the random crops and flips are not (they
  draw from numba's per-thread generators, which FFCV does not seed).
"""

from __future__ import annotations

import atexit
import itertools
import queue
import threading
import weakref
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from fastanchor.errors import ConfigError, DataError
from fastanchor.pipeline.beton.inspect import IMAGE_FIELD, LABEL_FIELD, inspect_beton
from fastanchor.pipeline.loaders.spec import LoaderSpec, check_image_size, checked_spec

ORDERS = ("sequential", "random", "quasi_random")
POLICIES = ("none",)  # FFCV's pipeline only crops and flips


def _order_seed(seed: int) -> int:
    """A 31-bit seed for FFCV mixed from ours. FFCV's RANDOM order seeds numpy with
    `seed + epoch` (QUASI_RANDOM: `seed * 912300 + epoch`), so raw small seeds would give
    (seed 0, epoch 1) the order of (seed 1, epoch 0); mixing keeps distinct seeds apart."""
    return int(np.random.SeedSequence([int(seed), 0x46464356]).generate_state(1)[0]) >> 1


class FFCVLoader:
    """FFCV's Loader over a .beton with TorchvisionLoader's contract, built from a LoaderSpec (`spec`: the
    settings every loader shares, named below by their field names) and FFCV's own knobs.

    Iterating yields (uint8 [B, 3, s, s] channels-last images, int64 [B] labels) on `device`.
    Train: RandomResizedCrop to s x s with area scale in [min_scale, 1] and aspect ratio in
    [3/4, 4/3] (torchvision's defaults), horizontal flip with probability 1/2 (none with
    `hflip=False`, in either crop). Eval: the central
    square of side `crop_ratio * shorter side`, resized to s x s (torchvision: resize the shorter
    side to s / crop_ratio, crop s x s). FFCV resizes with OpenCV's INTER_AREA.

    `crop="padded"` (train only) is CIFAR's augmentation instead: the whole image resized to s x s
    (unchanged when the images are s x s already), flipped, then shifted by up to `padding` pixels
    in each direction inside a black frame (FFCV's RandomTranslate: torchvision's RandomCrop with
    `padding`).

    Order: "sequential" (default for eval), "random", "quasi_random" (default for train; FFCV's
    page-aware shuffle, useful when os_cache=False and the file does not fit in RAM; it works with
    os_cache=True too). FFCV has no QUASI_RANDOM in distributed mode, where "random" is used
    instead (`order_note` says so). The order of an epoch is a function of (seed, epoch) alone:
    `set_epoch(epoch)` before iterating (without it, each iteration takes the next epoch, as in
    FFCV). Crops and flips are not reproducible: FFCV draws them from numba's per-thread
    generators, which it does not seed.

    `workers` is the number of numba threads that decode (FFCV has no worker processes); 0 means 1
    (decode in FFCV's one loading thread), and it is capped at numba's thread count. FFCV also sets
    torch's intra-op thread count (process-wide) to this number; it is restored after construction
    and after the first batch of each epoch.

    `world_size` > 1 shards the order with torch's DistributedSampler (FFCV's distributed mode: needs an
    initialized torch.distributed process group, whose rank is `rank`; like the sampler, pads the last shard by
    repeating samples, so an evaluation shard cannot be summed: `shards_evaluation` is False and `from_spec`
    builds evaluation loaders unsharded).

    `set_image_size(s)` changes the output size from the next epoch on (progressive resizing, as
    ffcv-imagenet does by setting the decoder's `output_size`; the compiled pipeline is reused).

    `labels` (int64 [num_samples], by sample in file order) replaces the labels stored in the .beton
    (data.label_noise: the file stays the clean dataset's): each batch's sample ids are read off the
    epoch's order, and the stored labels of the batch are checked against them before they are swapped.
    """

    def __init__(self, path: str | Path, spec: LoaderSpec, *, order: str | None = None, os_cache: bool = True,
                 batches_ahead: int = 3, labels: np.ndarray | None = None):
        import numba
        from ffcv.fields.basics import IntDecoder
        from ffcv.fields.rgb_image import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder
        from ffcv.loader import Loader, OrderOption
        from ffcv.transforms import RandomHorizontalFlip, RandomTranslate, Squeeze, ToTensor

        self.spec = spec = checked_spec(spec)
        spec.require_policy(POLICIES, "FFCV's pipeline only crops and flips")
        train, image_size = spec.train, spec.image_size
        distributed = spec.world_size > 1
        order = order if order is not None else ("quasi_random" if train else "sequential")
        if order not in ORDERS:
            raise ConfigError(f"order = {order!r}: expected one of {', '.join(ORDERS)}")
        self.order_note = ""
        if order == "quasi_random" and distributed:
            order = "random"
            self.order_note = "FFCV has no quasi_random order in distributed mode: using random"
        if distributed and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise ConfigError(f"world_size = {spec.world_size}: FFCV's distributed mode needs an initialized "
                              "torch.distributed process group")

        self.path = Path(path)
        self.info = inspect_beton(self.path)
        if labels is not None:
            labels = np.asarray(labels, dtype=np.int64)
            if labels.shape != (self.info.num_samples,):
                raise ConfigError(f"labels of shape {labels.shape} for the {self.info.num_samples} samples of "
                                  f"'{self.path}': expected one label per sample")
        self.labels = labels
        self.device = torch.device(spec.device)
        self.train = train
        self.order = order
        self.seed = spec.seed
        self.threads = max(1, min(spec.workers, numba.config.NUMBA_NUM_THREADS))
        flip = [RandomHorizontalFlip()] if spec.hflip else []  # FFCV's flips are not seeded: nothing to keep in step
        if train and spec.crop == "padded":  # CIFAR's: the whole image at image_size, flipped, shifted in a black frame
            self.decoder = CenterCropRGBImageDecoder((image_size, image_size), ratio=1.0)
            image_pipeline = [self.decoder, *flip, RandomTranslate(padding=spec.padding), ToTensor()]
        elif train:
            self.decoder = RandomResizedCropRGBImageDecoder((image_size, image_size), scale=(spec.min_scale, 1.0),
                                                            ratio=(3 / 4, 4 / 3))
            image_pipeline = [self.decoder, *flip, ToTensor()]
        else:
            self.decoder = CenterCropRGBImageDecoder((image_size, image_size), ratio=spec.crop_ratio)
            image_pipeline = [self.decoder, ToTensor()]
        # Squeeze(1), not Squeeze(): a last batch of one sample must keep its batch dimension.
        label_pipeline = [IntDecoder(), ToTensor(), Squeeze(1)]
        torch_threads = torch.get_num_threads()
        try:
            self.loader = Loader(
                str(self.path), batch_size=spec.batch_size, num_workers=self.threads, os_cache=os_cache,
                order=OrderOption[order.upper()], distributed=distributed, seed=_order_seed(spec.seed),
                pipelines={IMAGE_FIELD: image_pipeline, LABEL_FIELD: label_pipeline}, drop_last=spec.drop_last,
                batches_ahead=batches_ahead,
            )
        except (AssertionError, IndexError, KeyError, OSError, ValueError, MemoryError) as error:
            raise DataError(f"FFCV dataset file '{self.path}' cannot be opened by FFCV "
                            f"({type(error).__name__}: {error}): expected a readable .beton") from None
        finally:
            _restore_torch_threads(torch_threads)
        self._pristine_pages = None
        traversal = self.loader.traversal_order
        if hasattr(traversal, "page_to_samples_array"):
            # FFCV's QUASI_RANDOM shuffles its page table in place, so an epoch's order would depend
            # on the epochs drawn before it (the Loader already drew epoch 0): rebuild the table and
            # restore it before every epoch.
            traversal.prepare_data_structures()
            self._pristine_pages = traversal.page_to_samples_array.copy()
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.set_epoch(0)

    @property
    def image_size(self) -> int:
        return int(self.decoder.output_size[0])

    @property
    def num_samples(self) -> int:
        return self.info.num_samples

    def set_epoch(self, epoch: int) -> None:
        """The next iteration uses the order of `epoch` (a function of (seed, epoch) only)."""
        self.loader.next_epoch = int(epoch)

    def set_image_size(self, image_size: int) -> None:
        """Output s x s images from the next iteration on (an epoch in progress keeps its size)."""
        check_image_size(image_size)
        self.decoder.output_size = (image_size, image_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample indices of `epoch` in the order they are loaded (before drop_last)."""
        self._restore_pages()
        return np.asarray(self.loader.traversal_order.sample_order(int(epoch)))

    def __len__(self) -> int:
        return len(self.loader)

    def iter_from(self, first_batch: int):
        """The current epoch from batch `first_batch` on: the first batches are decoded and dropped (the order of
        an epoch is a function of (seed, epoch), so the rest are the batches of an uninterrupted epoch)."""
        return itertools.islice(iter(self), first_batch, None)

    @property
    def shards_evaluation(self) -> bool:
        """False: FFCV pads its shards with repeats, so for evaluation every process reads every sample."""
        return False

    def _restore_pages(self) -> None:
        if self._pristine_pages is not None:
            np.copyto(self.loader.traversal_order.page_to_samples_array, self._pristine_pages)

    def __iter__(self):
        order = self.epoch_order(self.loader.next_epoch) if self.labels is not None else None
        self._restore_pages()
        torch_threads = torch.get_num_threads()
        epoch = iter(self.loader)  # FFCV's EpochIterator: a thread that fills a queue of batches
        _track(epoch)
        _restore_torch_threads(torch_threads)
        pending = None  # CUDA event of the last copy out of FFCV's buffers
        first = True
        batch_number = 0
        try:
            while True:
                if pending is not None:
                    # FFCV overwrites the buffers of batch k once batch k + 1 is taken: the copy of
                    # batch k must be done by then (it runs on a side stream, so this waits for the
                    # copy only, not for the training step queued before it).
                    pending.synchronize()
                batch = _next_batch(epoch, self.path)
                if first:
                    # FFCV's loading thread set torch's (process-wide) thread count to `workers`
                    # before producing its first batch: give the training its own back.
                    _restore_torch_threads(torch_threads)
                    first = False
                if batch is None:
                    return
                images, labels = batch
                images = images.permute(0, 3, 1, 2)  # NHWC buffer -> NCHW view, no copy
                if not images.is_contiguous(memory_format=torch.channels_last):
                    raise AssertionError("FFCV images are not a channels-last view")
                labels = labels.reshape(-1)
                if order is not None:
                    labels = self._relabel(labels, order, batch_number)
                batch_number += 1
                if self._copy_stream is None:
                    images = images.to(self.device).clone(memory_format=torch.channels_last)
                    labels = labels.to(self.device, dtype=torch.long).clone()
                else:
                    images, labels, pending = self._to_cuda(images, labels)
                yield images, labels
        finally:
            epoch.close()

    def _relabel(self, stored: torch.Tensor, order: np.ndarray, batch: int) -> torch.Tensor:
        """The batch's labels from `self.labels`, by the sample ids of batch `batch` of the epoch's `order`."""
        start = batch * self.loader.batch_size
        ids = order[start: start + len(stored)]
        if len(ids) != len(stored) or not np.array_equal(stored.cpu().numpy(), self.info.labels[ids]):
            raise DataError(f"FFCV batch {batch} of '{self.path}' does not hold the samples its epoch order lists: "
                            f"cannot give it the replacement labels")
        return torch.from_numpy(self.labels[ids])

    def _to_cuda(self, images: torch.Tensor, labels: torch.Tensor):
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            images = images.to(self.device, non_blocking=True)  # keeps the channels-last strides
            labels = labels.to(self.device, dtype=torch.long, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        main.wait_stream(self._copy_stream)
        images.record_stream(main)
        labels.record_stream(main)
        return images, labels, done


_LIVE_EPOCHS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_TRACK_LOCK = threading.Lock()
_EXIT_HOOK = []


def _track(epoch: threading.Thread) -> None:
    with _TRACK_LOCK:
        _LIVE_EPOCHS.add(epoch)
        if not _EXIT_HOOK:
            atexit.register(_stop_epochs)
            _EXIT_HOOK.append(True)


def _stop_epochs() -> None:
    """At interpreter exit, stop FFCV's loading threads left running by an abandoned iteration:
    a daemon thread still inside a numba parallel region while the process tears down the
    threading layer can abort the process ("terminate called without an active exception")."""
    epochs = list(_LIVE_EPOCHS)
    for epoch in epochs:
        epoch.close()
    for epoch in epochs:
        epoch.join(timeout=2)


def _next_batch(epoch, path: Path):
    """EpochIterator.__next__, but raising instead of waiting forever when FFCV's loading thread
    died (an exception there is only printed by the thread)."""
    while True:
        try:
            item = epoch.output_queue.get(timeout=1.0)
            break
        except queue.Empty:
            if not epoch.is_alive():
                try:
                    item = epoch.output_queue.get_nowait()
                    break
                except queue.Empty:
                    raise DataError(f"FFCV's loading thread for '{path}' stopped before the end of the epoch "
                                    "(its error is printed above)") from None
    if item is None:
        epoch.close()
        return None
    slot, result = item
    if getattr(epoch, "current_stream", None) is not None:
        epoch.current_stream.wait_stream(epoch.cuda_streams[slot])
    return result


def _restore_torch_threads(threads: int) -> None:
    """Undo FFCV's `Compiler.set_num_threads`, which also sets torch's intra-op thread count."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def from_spec(path: str | Path, spec: LoaderSpec, **knobs) -> FFCVLoader:
    """FFCV's loader over the .beton at `path` with `spec`'s settings, an evaluation loader reading every sample in
    every process (FFCV pads its shards with repeats); `knobs`: FFCVLoader's own (order, os_cache, batches_ahead,
    labels)."""
    return FFCVLoader(path, spec if spec.train else replace(spec, rank=0, world_size=1), **knobs)
