"""The GPU-decode loader: files read by DataLoader workers, JPEGs decoded on the training device (nvJPEG, through
TorchCodec's `decode_jpeg` where it is installed, else torchvision's), then random-resized-crop and flip (training) or
resize and centre crop (evaluation) on the device. It keeps the batch contract (uint8 [B, 3, s, s] channels-last images
and int64 labels on the device) and the whole Loader protocol, so `data.loader=nvjpeg` trains (a CUDA device only: the
registry refuses it elsewhere).

Order and augmentation are a function of (seed, epoch, sample) as in the torchvision loader (its `EpochSampler`): each
sample's crop and flip are drawn from the sample's own seed, so `iter_from(batch)` resumes an epoch mid-way with the
batches an uninterrupted epoch gives, whatever the workers, and process `rank` of `world_size` reads its shard.

Two paths give the same batches for a seed (docs/notes/nvjpeg_loader_gpu.md has the cost of each):

- per image (`pipelined=False`, the benchmarks' `nvjpeg-per-image`): every file's bytes a tensor of its own
  from the workers; one batched decode, then torchvision's `resized_crop` and `horizontal_flip` per
  image, all on the thread that trains, between its steps;
- pipelined (`pipelined=True`, `nvjpeg`, what training selects): a batch's files one buffer from the workers; the
  decode and the crops run `prefetch` (2) batches ahead on a thread of their own and, on CUDA, on a
  stream of their own, the step's stream waiting on an event; per image only the crop's resize is
  launched (the float cast and the resize torchvision runs on CUDA, the resize writing into the batch), the flips,
  rounding and the channels-last layout once per batch.

On the CPU the same code decodes with libjpeg-turbo (the decoders' CPU path), which is how the
tests exercise it. Why TorchCodec: docs/loaders.md.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader
from torchvision.transforms.v2 import functional as F

from fastanchor.errors import ConfigError
from fastanchor.pipeline.loaders.crops import random_resized_crop_box
from fastanchor.pipeline.datasets.imagefolder import ImageFolderIndex, IndexedFiles
from fastanchor.pipeline.loaders.spec import LoaderSpec, check_image_size, checked_spec
from fastanchor.pipeline.loaders.order import EpochSampler
from fastanchor.pipeline.references import to_device_async

try:  # TorchCodec (torchcodec >= 0.16) supersedes torchvision's image decoders, deprecated since torchvision 0.29
    from torchcodec.decoders import decode_jpeg as _torchcodec_decode_jpeg
except ImportError:  # e.g. the GPU image's torch 2.11 / torchvision 0.26: torchvision's own nvJPEG decoder
    _torchcodec_decode_jpeg = None

DECODER = "torchcodec" if _torchcodec_decode_jpeg is not None else "torchvision"


class JpegBytes(IndexedFiles):
    """(uint8 1-D tensor of a file's bytes, label, the sample's augmentation seed) per sample: reading only, no
    decoding. A sample is asked for as (index, seed) by a shuffling `EpochSampler`, else by its index (seed 0)."""

    def __getitem__(self, item):
        index, seed = item if isinstance(item, tuple) else (item, 0)
        path, label = self.samples[index]
        return torch.from_numpy(np.fromfile(path, dtype=np.uint8)), int(label), seed

    def read(self, path: str) -> torch.Tensor:
        return torch.from_numpy(np.fromfile(path, dtype=np.uint8))


def _keep_bytes_apart(items):
    data, labels, seeds = zip(*items)
    return list(data), torch.tensor(labels, dtype=torch.long), list(seeds)


def _bytes_in_one_buffer(items):
    """A batch as (all files' bytes end to end, each file's length, labels, seeds): one shared-memory buffer crosses
    from a worker, not one per file."""
    data, labels, seeds = zip(*items)
    return torch.cat(data), torch.tensor([len(d) for d in data]), torch.tensor(labels, dtype=torch.long), list(seeds)


def decode_jpegs(data: list[torch.Tensor], device: torch.device, *, quiet: bool = True) -> list[torch.Tensor]:
    """RGB uint8 [3, H, W] of each JPEG's bytes, decoded on `device` (nvJPEG on CUDA, libjpeg-turbo on the CPU), in
    one batched call: TorchCodec's decoder where installed (`DECODER`), else torchvision's. `quiet` hides torchvision
    >= 0.29's notice of its decoders' move to TorchCodec; `catch_warnings` changes the process's filters, so the
    producer threads of the pipelined path (two at once in `bench e2e --naive`) leave it off: the notice is a
    DeprecationWarning, which Python shows only for code in __main__."""
    if _torchcodec_decode_jpeg is not None:
        return _torchcodec_decode_jpeg(data, mode="RGB", device=device)
    from torchvision.io import ImageReadMode, decode_jpeg

    if not quiet:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


def crop_draws(height: int, width: int, min_scale: float, seed: int) -> tuple[tuple[int, int, int, int], bool]:
    """A training sample's random-resized-crop box and flip coin, from its own seed alone."""
    rng = np.random.default_rng(seed)
    box = random_resized_crop_box(height, width, min_scale, rng)
    return box, bool(rng.uniform() < 0.5)


def centre_box(height: int, width: int, size: int, crop_ratio: float) -> tuple[int, int, int, int]:
    """Evaluation's geometry, torchvision's Resize(round(size / crop_ratio)) of the shorter side then CenterCrop(size):
    (resized height, resized width, top, left of the crop)."""
    short = round(size / crop_ratio)
    if height <= width:
        new_h, new_w = short, int(short * width / height)
    else:
        new_h, new_w = int(short * height / width), short
    return new_h, new_w, int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))


_END = object()


class NvjpegLoader:
    """Iterates (uint8 channels-last images [B, 3, s, s], int64 labels) decoded on the spec's device. Training
    (`spec.train`): the epoch's order and each sample's random-resized crop (area scale >= min_scale) and flip (unless
    `hflip` is off) a function of (seed, epoch, sample); evaluation: every sample in order, resized and centre-cropped
    by `crop_ratio`. The spec's batch_size, drop_last, workers and shard (rank, world_size). `pipelined` prepares
    `prefetch` batches ahead on a thread (and CUDA stream) of its own; both paths give the same batches. `pinned`
    (CUDA only; the benchmarks' `nvjpeg-pinned`) has the DataLoader copy each batch's files into page-locked memory,
    so that the decoder's copies of them to the device need not stage through pageable memory (the profile of the
    second GPU window counted 256 pageable host-to-device copies a batch)."""

    def __init__(self, index: ImageFolderIndex, spec: LoaderSpec, *, pipelined: bool = False, prefetch: int = 2,
                 pinned: bool = False):
        spec = checked_spec(spec)
        spec.require_policy(("none",), "the nvJPEG loader only crops and flips; use data.loader=torchvision or dali")
        if spec.train and spec.crop != "random_resized":
            raise ConfigError(f"crop = {spec.crop!r}: the nvJPEG loader crops random_resized only; "
                              f"use data.loader=torchvision for CIFAR's padded crop")
        workers = spec.workers
        self.device = torch.device(spec.device)
        self.image_size = spec.image_size
        self.train, self.min_scale, self.crop_ratio = spec.train, spec.min_scale, spec.crop_ratio
        self.pipelined = pipelined
        self.prefetch = max(1, prefetch)
        self.hflip = spec.hflip  # False: the coin is still drawn (the same crops as True), never heads
        self.batch_size = spec.batch_size
        self.sampler = EpochSampler(len(index), shuffle=spec.train, seed=spec.seed, rank=spec.rank,
                                    world_size=spec.world_size)
        self.loader = DataLoader(JpegBytes(index), batch_size=spec.batch_size, sampler=self.sampler,
                                 drop_last=spec.drop_last, num_workers=workers, persistent_workers=workers > 0,
                                 collate_fn=_bytes_in_one_buffer if pipelined else _keep_bytes_apart,
                                 generator=torch.Generator().manual_seed(spec.seed),
                                 prefetch_factor=4 if workers > 0 else None,
                                 pin_memory=pinned and self.device.type == "cuda")

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        return self._pipelined() if self.pipelined else self._per_image()

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def set_image_size(self, image_size: int) -> None:
        """Output image_size x image_size images from the next batch prepared on (progressive resizing)."""
        check_image_size(image_size)
        self.image_size = image_size

    def iter_from(self, first_batch: int):
        """The current epoch from batch `first_batch` on; the files of the batches before it are not read."""
        self.sampler.start_at(first_batch * self.batch_size)
        return iter(self)

    @property
    def shards_evaluation(self) -> bool:
        """Sharded evaluation reads every image exactly once over all processes (the torchvision loader's shards)."""
        return self.sampler.world_size > 1

    def box(self, image: torch.Tensor, seed: int) -> tuple[tuple[int, int, int, int], bool]:
        """Where a training sample is cropped (top, left, height, width) and whether it is flipped."""
        box, heads = crop_draws(image.shape[1], image.shape[2], self.min_scale, seed)
        return box, heads and self.hflip

    # the per-image path ------------------------------------------------------------------------

    def _per_image(self):
        size = [self.image_size, self.image_size]
        for data, labels, seeds in self.loader:
            decoded = decode_jpegs(data, self.device)
            if not self.train:
                yield self.centre_batch(decoded), labels.to(self.device, non_blocking=True)
                continue
            images = torch.empty((len(decoded), 3, *size), dtype=torch.uint8, device=self.device,
                                 memory_format=torch.channels_last)
            for i, (image, seed) in enumerate(zip(decoded, seeds)):
                (top, left, height, width), flip = self.box(image, seed)
                crop = F.resized_crop(image, top, left, height, width, size, antialias=True)
                images[i] = F.horizontal_flip(crop) if flip else crop
            yield images, labels.to(self.device, non_blocking=True)

    def centre_batch(self, decoded: list[torch.Tensor]) -> torch.Tensor:
        """Evaluation: each image resized (shorter side round(s / crop_ratio), antialiased) and centre-cropped to s,
        as torchvision's eval transform does on a tensor: uint8 channels-last [B, 3, s, s]."""
        s = self.image_size
        images = torch.empty((len(decoded), 3, s, s), dtype=torch.uint8, device=decoded[0].device,
                             memory_format=torch.channels_last)
        for i, image in enumerate(decoded):
            new_h, new_w, top, left = centre_box(image.shape[1], image.shape[2], s, self.crop_ratio)
            images[i] = F.resize(image, [new_h, new_w], antialias=True)[:, top:top + s, left:left + s]
        return images

    # the pipelined path ------------------------------------------------------------------------

    def crop_batch(self, decoded: list[torch.Tensor], seeds: list[int], *, float_resize: bool | None = None) -> torch.Tensor:
        """The decoded images random-resized-cropped and flipped as the per-image path does (the same draws from
        each sample's seed, the same pixels): uint8 channels-last [B, 3, s, s]. Where torchvision resizes uint8 in
        float (`float_resize`; on CUDA by default) the crops are resized into a float batch that is flipped, rounded
        and cast once; elsewhere torchvision's own uint8 resize runs per image."""
        s = self.image_size
        device = decoded[0].device
        if float_resize is None:
            float_resize = device.type != "cpu"
        batch = torch.empty((len(decoded), 3, s, s), dtype=torch.float32 if float_resize else torch.uint8, device=device)
        flips = np.zeros(len(decoded), dtype=bool)
        upsample = torch._C._nn._upsample_bilinear2d_aa  # what F.interpolate(size=, mode="bilinear", antialias=True) runs
        for i, (image, seed) in enumerate(zip(decoded, seeds)):
            (top, left, height, width), flips[i] = self.box(image, seed)
            crop = image[:, top:top + height, left:left + width]
            if (height, width) == (s, s):  # torchvision returns such a crop as it is
                batch[i] = crop
            elif float_resize:  # torchvision's resize of uint8 on CUDA: float, antialiased bilinear (written in place
                #                   into the batch: no copy launched per image), round, cast
                upsample(crop.reshape(1, 3, height, width).to(torch.float32), [s, s], False, None, out=batch[i:i + 1])
            else:
                batch[i] = F.resize(crop, [s, s], antialias=True)
        if flips.any():
            flipped = to_device_async(torch.from_numpy(np.flatnonzero(flips)), device)  # no wait for the crops
            batch[flipped] = batch[flipped].flip(-1)
        if float_resize:
            batch.round_()
        images = torch.empty((len(decoded), 3, s, s), dtype=torch.uint8, device=device, memory_format=torch.channels_last)
        return images.copy_(batch)

    def _prepare(self, out: queue.Queue, stop: threading.Event) -> None:
        """The producer: every batch of one epoch decoded and cropped, then handed over with the event that marks
        its work done on this thread's stream (None on the CPU); an exception is handed over in its place."""

        def hand_over(item) -> bool:
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        cuda = self.device.type == "cuda"
        try:
            stream = torch.cuda.Stream(self.device) if cuda else None
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                for data, lengths, labels, seeds in self.loader:
                    if stop.is_set():
                        return
                    decoded = decode_jpegs(list(torch.split(data, lengths.tolist())), self.device, quiet=False)
                    images = self.crop_batch(decoded, seeds) if self.train else self.centre_batch(decoded)
                    labels = labels.to(self.device, non_blocking=True)
                    event = torch.cuda.Event() if cuda else None
                    if event is not None:
                        event.record(stream)
                    if not hand_over((images, labels, event)):
                        return
            hand_over(_END)
        except BaseException as error:  # noqa: BLE001 - raised again on the consumer's thread
            hand_over(error)

    def _pipelined(self):
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        producer = threading.Thread(target=self._prepare, args=(ready, stop), name="nvjpeg-prefetch", daemon=True)
        producer.start()
        try:
            while True:
                item = ready.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                images, labels, event = item
                if event is not None:  # the step's stream waits for the producer's work, and keeps the memory until used
                    current = torch.cuda.current_stream(self.device)
                    current.wait_event(event)
                    images.record_stream(current)
                    labels.record_stream(current)
                yield images, labels
        finally:  # left early, failed or done: the producer stops at its next hand-over (within 50 ms of waiting)
            stop.set()
            with contextlib.suppress(queue.Empty):
                while True:
                    ready.get_nowait()
            producer.join()
