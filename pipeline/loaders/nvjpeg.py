"""A GPU-decode loader for the benchmarks: files read by DataLoader workers, JPEGs decoded on the
training device by torchvision (`decode_jpeg(device="cuda")`: nvJPEG), then random-resized-crop
and flip on the device. It is the GPU decode path where DALI wheels are absent, and it keeps the
batch contract (uint8 [B, 3, s, s] channels-last images and int64 labels on the device).

Two paths give the same batches for a seed (docs/notes/nvjpeg_loader_gpu.md has the cost of each):

- per image (`pipelined=False`, the benchmarks' `nvjpeg`): every file's bytes a tensor of its own
  from the workers; one batched decode, then torchvision's `resized_crop` and `horizontal_flip` per
  image, all on the thread that trains, between its steps;
- pipelined (`pipelined=True`, `nvjpeg-pipelined`): a batch's files one buffer from the workers; the
  decode and the crops run `prefetch` batches ahead on a thread of their own and, on CUDA, on a
  stream of their own, the step's stream waiting on an event; per image only the crop's resize is
  launched (the float cast and the resize torchvision runs on CUDA), the flips, rounding and the
  channels-last layout once per batch.

On the CPU the same code decodes with libjpeg-turbo (torchvision's CPU decoder), which is how the
tests exercise it; the benchmarks list it for CUDA devices only.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import functional as F

from fastanchor.pipeline.loaders.crops import random_resized_crop_box
from fastanchor.pipeline.datasets.imagefolder import ImageFolderIndex, IndexedFiles
from fastanchor.pipeline.loaders.spec import LoaderSpec, checked_spec
from fastanchor.pipeline.references import to_device_async


class JpegBytes(IndexedFiles):
    """(uint8 1-D tensor of a file's bytes, label) per sample: reading only, no decoding."""

    def read(self, path: str) -> torch.Tensor:
        return torch.from_numpy(np.fromfile(path, dtype=np.uint8))


def _keep_bytes_apart(items):
    data, labels = zip(*items)
    return list(data), torch.tensor(labels, dtype=torch.long)


def _bytes_in_one_buffer(items):
    """A batch as (all files' bytes end to end, each file's length, labels): one shared-memory buffer crosses
    from a worker, not one per file."""
    data, labels = zip(*items)
    return torch.cat(data), torch.tensor([len(d) for d in data]), torch.tensor(labels, dtype=torch.long)


def _decode(data: list[torch.Tensor], device: torch.device, *, quiet: bool = True) -> list[torch.Tensor]:
    """`quiet` hides torchvision >= 0.29's notice of its decoders' move to torchcodec; `catch_warnings` changes the
    process's filters, so the producer threads of the pipelined path (two at once in `bench e2e --naive`) leave it
    off: the notice is a DeprecationWarning, which Python shows only for code in __main__."""
    if not quiet:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


_END = object()


class NvjpegLoader:
    """Iterates (uint8 channels-last images [B, 3, s, s], int64 labels) decoded on the spec's device: a training
    loader (shuffled; random-resized crop of area scale >= min_scale, flip unless `hflip` is off) with the spec's
    batch_size, drop_last, workers and seed; one process (no shards). `pipelined` prepares `prefetch` batches ahead
    on a thread (and CUDA stream) of its own; both paths give the same batches."""

    def __init__(self, index: ImageFolderIndex, spec: LoaderSpec, *, pipelined: bool = False, prefetch: int = 2):
        spec = checked_spec(spec)
        workers = spec.workers
        self.device = torch.device(spec.device)
        self.image_size = spec.image_size
        self.min_scale = spec.min_scale
        self.pipelined = pipelined
        self.prefetch = max(1, prefetch)
        self.rng = np.random.default_rng(spec.seed)  # crops and flips
        self.hflip = spec.hflip  # False: the coin is still drawn (the same crops as True), never heads
        self.loader = DataLoader(JpegBytes(index), batch_size=spec.batch_size, shuffle=True, drop_last=spec.drop_last,
                                 num_workers=workers, persistent_workers=workers > 0,
                                 collate_fn=_bytes_in_one_buffer if pipelined else _keep_bytes_apart,
                                 generator=torch.Generator().manual_seed(spec.seed),
                                 prefetch_factor=4 if workers > 0 else None)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        return self._pipelined() if self.pipelined else self._per_image()

    # the per-image path ------------------------------------------------------------------------

    def _per_image(self):
        size = [self.image_size, self.image_size]
        for data, labels in self.loader:
            decoded = _decode(data, self.device)
            images = torch.empty((len(decoded), 3, *size), dtype=torch.uint8, device=self.device,
                                 memory_format=torch.channels_last)
            for i, image in enumerate(decoded):
                top, left, height, width = random_resized_crop_box(image.shape[1], image.shape[2], self.min_scale, self.rng)
                crop = F.resized_crop(image, top, left, height, width, size, antialias=True)
                images[i] = F.horizontal_flip(crop) if self.rng.uniform() < 0.5 and self.hflip else crop
            yield images, labels.to(self.device, non_blocking=True)

    # the pipelined path ------------------------------------------------------------------------

    def crop_batch(self, decoded: list[torch.Tensor], *, float_resize: bool | None = None) -> torch.Tensor:
        """The decoded images random-resized-cropped and flipped as the per-image path does (the same draws of
        `self.rng`, the same pixels): uint8 channels-last [B, 3, s, s]. Where torchvision resizes uint8 in float
        (`float_resize`; on CUDA by default) the crops are resized into a float batch that is flipped, rounded and
        cast once; elsewhere torchvision's own uint8 resize runs per image."""
        s = self.image_size
        device = decoded[0].device
        if float_resize is None:
            float_resize = device.type != "cpu"
        batch = torch.empty((len(decoded), 3, s, s), dtype=torch.float32 if float_resize else torch.uint8, device=device)
        flips = np.zeros(len(decoded), dtype=bool)
        upsample = torch._C._nn._upsample_bilinear2d_aa  # what F.interpolate(size=, mode="bilinear", antialias=True) runs
        for i, image in enumerate(decoded):
            top, left, height, width = random_resized_crop_box(image.shape[1], image.shape[2], self.min_scale, self.rng)
            flips[i] = self.rng.uniform() < 0.5 and self.hflip
            crop = image[:, top:top + height, left:left + width]
            if (height, width) == (s, s):  # torchvision returns such a crop as it is
                batch[i] = crop
            elif float_resize:  # torchvision's resize of uint8 on CUDA: float, antialiased bilinear, round, cast
                batch[i] = upsample(crop.reshape(1, 3, height, width).to(torch.float32), [s, s], False, None)[0]
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
                for data, lengths, labels in self.loader:
                    if stop.is_set():
                        return
                    decoded = _decode(list(torch.split(data, lengths.tolist())), self.device, quiet=False)
                    images = self.crop_batch(decoded)
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
