"""FFCV loading: write an ImageFolder into a `.beton` file and iterate it with FFCV's Loader.

`write_beton(index, path)` stores every image of an ImageFolder index (decoded with PIL and
converted to RGB, then JPEG-compressed by FFCV, or kept raw) with its integer label, and checks
the written file before renaming it into place. `FFCVLoader` keeps the batch contract of
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
import multiprocessing
import queue
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from fastanchor.errors import ConfigError, DataError
from fastanchor.files import atomic_path
from fastanchor.pipeline.imagefolder import ImageFolderIndex
from fastanchor.pipeline.torchvision_loader import load_rgb

IMAGE_FIELD = "image"
LABEL_FIELD = "label"
ORDERS = ("sequential", "random", "quasi_random")
JPEG_MODE, RAW_MODE = 0, 1  # ffcv.fields.rgb_image.IMAGE_MODES
_RGB_IMAGE_TYPE_ID, _INT_TYPE_ID = 2, 1  # ffcv.types.TYPE_ID_HANDLER
_MAX_SIDE = 65535  # FFCV stores width and height as uint16


# --------------------------------------------------------------------------------------------
# Checking a .beton file
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BetonInfo:
    """What `inspect_beton` found in a structurally sound .beton file."""

    path: Path
    num_samples: int
    labels: np.ndarray  # int64 [num_samples], in file order
    jpeg_images: int
    raw_images: int
    max_width: int
    max_height: int
    page_size: int
    bytes: int

    def label_histogram(self) -> dict[int, int]:
        return {int(k): int(v) for k, v in sorted(Counter(self.labels.tolist()).items())}


def inspect_beton(path: str | Path, *, all_markers: bool = False) -> BetonInfo:
    """Check that `path` is a complete fastanchor .beton (header, fields, sample table, allocation
    table, image records) without decoding images; raise DataError naming the file otherwise.

    Catches missing, empty, truncated and foreign files (random bytes, another format version,
    a .beton with other fields), which FFCV itself would turn into IndexErrors, numpy errors,
    bad memory reads or a silent hang. The JPEG start/end markers are checked for every image
    with `all_markers` (two reads per image: done after writing), else for 64 spread over the
    file. Damage inside a JPEG's data is not detected: FFCV then decodes a black image."""
    from ffcv.types import ALLOC_TABLE_TYPE, CURRENT_VERSION, FieldDescType, HeaderType
    from ffcv.utils import decode_null_terminated_string

    path = Path(path)
    expected = "expected an FFCV .beton written by fastanchor (fields 'image' and 'label')"

    def bad(what: str) -> DataError:
        return DataError(f"FFCV dataset file '{path}' {what}: {expected}")

    if not path.exists():
        raise bad("does not exist")
    if not path.is_file():
        raise bad("is not a regular file")
    size = path.stat().st_size
    if size == 0:
        raise bad("is empty (0 bytes)")
    if size < HeaderType.itemsize:
        raise bad(f"is truncated ({size} bytes, shorter than the {HeaderType.itemsize}-byte header)")
    try:
        with open(path, "rb") as handle:
            head = handle.read(HeaderType.itemsize + 2 * FieldDescType.itemsize)
    except OSError as error:
        raise bad(f"cannot be read ({error.strerror or error})") from None
    header = np.frombuffer(head, dtype=HeaderType, count=1)[0]
    version, num_fields = int(header["version"]), int(header["num_fields"])
    num_samples, page_size = int(header["num_samples"]), int(header["page_size"])
    table_at = int(header["alloc_table_ptr"])
    if version != CURRENT_VERSION:
        raise bad(f"is not an FFCV .beton of format version {CURRENT_VERSION} (header says version {version})")
    if num_fields != 2:
        raise bad(f"has {num_fields} fields")
    if len(head) < HeaderType.itemsize + 2 * FieldDescType.itemsize:
        raise bad(f"is truncated ({size} bytes, shorter than its header and field descriptions)")
    descriptors = np.frombuffer(head, dtype=FieldDescType, count=2, offset=HeaderType.itemsize)
    fields = [(decode_null_terminated_string(d["name"]), int(d["type_id"])) for d in descriptors]
    if fields != [(IMAGE_FIELD, _RGB_IMAGE_TYPE_ID), (LABEL_FIELD, _INT_TYPE_ID)]:
        raise bad(f"has fields {', '.join(f'{n!r} (type {t})' for n, t in fields)}")
    if page_size < (1 << 21) or page_size & (page_size - 1) or page_size >= (1 << 32):
        raise bad(f"has an invalid page size {page_size}")
    if num_samples == 0:
        raise bad("holds no samples")

    from ffcv.fields import IntField, RGBImageField
    from ffcv.types import get_metadata_type

    metadata_type = get_metadata_type([RGBImageField(), IntField()])
    metadata_at = HeaderType.itemsize + 2 * FieldDescType.itemsize
    data_at = metadata_at + num_samples * metadata_type.itemsize
    if table_at > size or data_at > size:
        raise bad(f"is truncated ({size} bytes; its header places the allocation table at byte {table_at})")
    if table_at < data_at:
        raise bad(f"has an inconsistent header (allocation table at byte {table_at}, inside the sample table)")
    table_bytes = size - table_at
    if table_bytes != num_samples * ALLOC_TABLE_TYPE.itemsize:
        raise bad(f"is truncated or has trailing bytes (its allocation table has {table_bytes} bytes, "
                  f"expected {num_samples * ALLOC_TABLE_TYPE.itemsize} for {num_samples} samples)")

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    metadata = np.frombuffer(mapped[metadata_at:data_at], dtype=metadata_type)
    table = np.frombuffer(mapped[table_at:size], dtype=ALLOC_TABLE_TYPE)
    images, labels = metadata["f0"], metadata["f1"].astype(np.int64)
    order = np.argsort(table["sample_id"], kind="stable")
    table = table[order]
    ptr, nbytes = table["ptr"].astype(np.int64), table["size"].astype(np.int64)
    mode = images["mode"]
    width, height = images["width"].astype(np.int64), images["height"].astype(np.int64)
    if not np.array_equal(table["sample_id"], np.arange(num_samples, dtype=table["sample_id"].dtype)):
        raise bad("has an allocation table that does not list every sample once")
    if not np.array_equal(images["data_ptr"].astype(np.int64), ptr):
        raise bad("has image records that do not match its allocation table")
    if np.any(ptr < data_at) or np.any(nbytes <= 0) or np.any(ptr + nbytes > table_at):
        raise bad("has image data outside its data region")
    if np.any((mode != JPEG_MODE) & (mode != RAW_MODE)) or np.any(width == 0) or np.any(height == 0):
        raise bad("has invalid image records (mode, width or height)")
    raw = mode == RAW_MODE
    if np.any(nbytes[raw] != 3 * width[raw] * height[raw]):
        raise bad("has raw images whose size does not match width x height x 3")
    jpeg = ~raw
    starts, ends = ptr[jpeg], ptr[jpeg] + nbytes[jpeg]
    if not all_markers and len(starts) > 64:
        spread = np.linspace(0, len(starts) - 1, 64).round().astype(np.int64)
        starts, ends = starts[spread], ends[spread]
    if np.any(mapped[starts] != 0xFF) or np.any(mapped[starts + 1] != 0xD8) or \
            np.any(mapped[ends - 2] != 0xFF) or np.any(mapped[ends - 1] != 0xD9):
        raise bad("has JPEG records without JPEG start/end markers")
    info = BetonInfo(
        path=path, num_samples=num_samples, labels=labels.copy(), jpeg_images=int(jpeg.sum()),
        raw_images=int(raw.sum()), max_width=int(width.max()), max_height=int(height.max()),
        page_size=page_size, bytes=size,
    )
    del mapped
    return info


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

class RGBSamples(Dataset):
    """(uint8 [H, W, 3] array, label) per sample of an ImageFolder index, decoded with PIL.

    Every mode (grayscale, palette, CMYK, RGBA, 16-bit) is converted to RGB, as by the baseline
    loader (`load_rgb`); an undecodable file raises DataError naming it."""

    def __init__(self, index: ImageFolderIndex):
        self.samples = index.samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        image = np.asarray(load_rgb(path), dtype=np.uint8)
        if image.ndim != 3 or image.shape[2] != 3:
            raise DataError(f"image '{path}' decoded to shape {image.shape}: expected an RGB image")
        if max(image.shape[:2]) > _MAX_SIDE:
            raise DataError(f"image '{path}' is {image.shape[1]}x{image.shape[0]} pixels: FFCV stores at most "
                            f"{_MAX_SIDE} pixels a side; set max_resolution")
        return np.ascontiguousarray(image), int(label)


def _guarded_worker(errors, work_fn, *args) -> None:
    """Run one of FFCV's writer jobs; report an exception to the parent instead of dying silently
    (FFCV's own writer then waits forever for the samples the dead worker never wrote)."""
    try:
        work_fn(*args)
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which raises
        message = str(error) if isinstance(error, DataError) else f"{type(error).__name__}: {error}"
        errors.put((isinstance(error, DataError), message))
        raise SystemExit(1)


def _writer_class():
    from ffcv.memory_allocator import MemoryAllocator
    from ffcv.writer import DatasetWriter
    import ctypes

    class SupervisedWriter(DatasetWriter):
        """FFCV's DatasetWriter with a supervised `_write_common`: a worker's exception is raised
        here (DataError), the other workers are stopped, the shared memory is always released,
        and the progress bar is optional."""

        def __init__(self, fname, fields, *, page_size, num_workers, progress, target):
            super().__init__(fname, fields, page_size=page_size, num_workers=num_workers)
            self.progress = progress
            self.target = target

        def _write_common(self, num_samples, queue_content, work_fn, extra_worker_args):
            from fastanchor.progress import progress_bar

            self.num_samples = num_samples
            self.prepare()
            processes = []
            try:
                work, allocations, errors = multiprocessing.Queue(), multiprocessing.Queue(), multiprocessing.Queue()
                for todo in queue_content:
                    work.put(todo)
                for _ in range(self.num_workers):
                    work.put(None)
                done = multiprocessing.Value(ctypes.c_uint64, 0)
                allocator = MemoryAllocator(self.fname, self.data_region_start, self.page_size)
                args = (work, self.metadata_sm, self.metadata_type, self.fields, allocator, done, allocations,
                        *extra_worker_args)
                processes = [multiprocessing.Process(target=_guarded_worker, args=(errors, work_fn, *args), daemon=True)
                             for _ in range(self.num_workers)]
                for process in processes:
                    process.start()
                allocation_list, finished, shown = [], 0, 0
                with progress_bar(total=num_samples, desc=f"writing {self.target}", unit="img",
                                  enabled=self.progress) as bar:
                    while finished < len(processes):
                        self._raise_reported(errors)
                        try:
                            allocation_list.extend(allocations.get(timeout=0.1))
                            finished += 1
                        except queue.Empty:
                            dead = [p for p in processes if p.exitcode not in (None, 0)]
                            if dead:
                                time.sleep(0.2)  # let a reported error reach the queue
                                self._raise_reported(errors)
                                raise DataError(f"writing '{self.target}' failed: a writer process exited with code "
                                                f"{dead[0].exitcode}")
                        bar.update(done.value - shown)
                        shown = done.value
                for process in processes:
                    process.join()
                self.finalize(allocation_list)
            finally:
                for process in processes:
                    if process.is_alive():
                        process.terminate()
                for process in processes:
                    process.join()
                self.metadata_sm.close()
                self.metadata_sm.unlink()

        def _raise_reported(self, errors) -> None:
            try:
                is_data_error, message = errors.get_nowait()
            except queue.Empty:
                return
            if is_data_error:
                raise DataError(message)
            raise DataError(f"writing '{self.target}' failed in a writer process: {message}")

    return SupervisedWriter


def _page_size(max_resolution: int | None) -> int:
    """FFCV's default 8 MiB page, or a larger power of two when a max_resolution image stored raw
    (3 bytes a pixel) would not fit one page (FFCV refuses a sample larger than a page)."""
    page = 1 << 23
    if max_resolution is not None:
        while page < 3 * max_resolution * max_resolution:
            page <<= 1
    return page


def write_beton(
    index: ImageFolderIndex,
    path: str | Path,
    *,
    max_resolution: int | None = None,
    jpeg_quality: int = 90,
    compress_probability: float = 1.0,
    workers: int = 2,
    progress: bool = True,
) -> dict:
    """Write every sample of `index` into the FFCV dataset file `path` and return a summary.

    Images are decoded with PIL and converted to RGB, resized by FFCV (OpenCV INTER_AREA) so that
    their longer side is at most `max_resolution` (None: kept), then stored as JPEG with
    `jpeg_quality` (a second JPEG generation for JPEG sources) with probability
    `compress_probability`, else as raw pixels (FFCV's 'proportion' mode; 1.0 is its 'jpg' mode).
    Samples keep the index order (sorted by class, then path); labels are the class indices.

    The file is written to a temporary file beside `path`, checked (structure, sample count, the
    label of every sample, hence the label histogram) and only then renamed over `path`; any
    failure removes the temporary file and leaves `path` as it was. An image that PIL cannot
    decode raises DataError naming it.
    """
    from ffcv.fields import IntField, RGBImageField

    if max_resolution is not None and not (isinstance(max_resolution, int) and 1 <= max_resolution <= _MAX_SIDE):
        raise ConfigError(f"max_resolution = {max_resolution!r}: expected None or an integer from 1 to {_MAX_SIDE}")
    if not (isinstance(jpeg_quality, int) and 1 <= jpeg_quality <= 100):
        raise ConfigError(f"jpeg_quality = {jpeg_quality!r}: expected an integer from 1 to 100")
    if not 0.0 <= compress_probability <= 1.0:
        raise ConfigError(f"compress_probability = {compress_probability!r}: expected a number from 0 to 1")
    if not (isinstance(workers, int) and workers >= 1):
        raise ConfigError(f"workers = {workers!r}: expected a positive integer (writer processes)")
    if len(index) == 0:
        raise DataError(f"cannot write '{path}': the image index of '{index.root}' is empty")

    started = time.perf_counter()
    with atomic_path(path, mode=0o644) as tmp:
        mode = "jpg" if compress_probability >= 1.0 else "proportion"
        fields = {
            IMAGE_FIELD: RGBImageField(write_mode=mode, max_resolution=max_resolution, jpeg_quality=jpeg_quality,
                                       compress_probability=compress_probability),
            LABEL_FIELD: IntField(),
        }
        workers = min(workers, len(index))
        writer = _writer_class()(str(tmp), fields, page_size=_page_size(max_resolution), num_workers=workers,
                                 progress=progress, target=path)
        chunksize = max(1, min(100, -(-len(index) // (4 * workers))))
        writer.from_indexed_dataset(RGBSamples(index), chunksize=chunksize)
        info = _verify(tmp, path, index)
    histogram = info.label_histogram()
    return {
        "path": str(path),
        "count": info.num_samples,
        "label_histogram": histogram,
        "classes": list(index.classes),
        "jpeg_images": info.jpeg_images,
        "raw_images": info.raw_images,
        "max_side": max(info.max_width, info.max_height),
        "bytes": info.bytes,
        "seconds": round(time.perf_counter() - started, 3),
    }


def _verify(tmp: str | Path, path: Path, index: ImageFolderIndex) -> BetonInfo:
    """Read the written file back (structure with `inspect_beton`, then FFCV's own Reader) and
    compare the count and every label with the source index."""
    from ffcv.reader import Reader

    try:
        info = inspect_beton(tmp, all_markers=True)
    except DataError as error:
        raise DataError(f"written FFCV dataset '{path}' failed verification: {error}") from None
    try:
        reader = Reader(str(tmp))
        count, labels = int(reader.num_samples), np.asarray(reader.metadata["f1"], dtype=np.int64)
    except Exception as error:  # noqa: BLE001 - FFCV raises assorted errors for bad files
        raise DataError(f"written FFCV dataset '{path}' cannot be read back by FFCV: {error}") from None
    expected = np.array([label for _, label in index.samples], dtype=np.int64)
    if count != len(expected) or info.num_samples != len(expected):
        raise DataError(f"written FFCV dataset '{path}' holds {count} samples: expected {len(expected)} "
                        f"from '{index.root}'")
    if not np.array_equal(labels, expected) or not np.array_equal(info.labels, expected):
        got = dict(Counter(labels.tolist()))
        want = dict(Counter(expected.tolist()))
        raise DataError(f"written FFCV dataset '{path}' has labels that differ from '{index.root}' "
                        f"(histogram {got}, expected {want})")
    return info


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

def _order_seed(seed: int) -> int:
    """A 31-bit seed for FFCV mixed from ours. FFCV's RANDOM order seeds numpy with
    `seed + epoch` (QUASI_RANDOM: `seed * 912300 + epoch`), so raw small seeds would give
    (seed 0, epoch 1) the order of (seed 1, epoch 0); mixing keeps distinct seeds apart."""
    return int(np.random.SeedSequence([int(seed), 0x46464356]).generate_state(1)[0]) >> 1


class FFCVLoader:
    """FFCV's Loader over a .beton with TorchvisionLoader's contract.

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
    os_cache=True too). FFCV has no QUASI_RANDOM for distributed=True, where "random" is used
    instead (`order_note` says so). The order of an epoch is a function of (seed, epoch) alone:
    `set_epoch(epoch)` before iterating (without it, each iteration takes the next epoch, as in
    FFCV). Crops and flips are not reproducible: FFCV draws them from numba's per-thread
    generators, which it does not seed.

    `workers` is the number of numba threads that decode (FFCV has no worker processes); 0 means 1
    (decode in FFCV's one loading thread), and it is capped at numba's thread count. FFCV also sets
    torch's intra-op thread count (process-wide) to this number; it is restored after construction
    and after the first batch of each epoch.

    `distributed=True` shards the order with torch's DistributedSampler (needs an initialized
    torch.distributed process group; like the sampler, pads the last shard by repeating samples).

    `set_image_size(s)` changes the output size from the next epoch on (progressive resizing, as
    ffcv-imagenet does by setting the decoder's `output_size`; the compiled pipeline is reused).

    `labels` (int64 [num_samples], by sample in file order) replaces the labels stored in the .beton
    (data.label_noise: the file stays the clean dataset's): each batch's sample ids are read off the
    epoch's order, and the stored labels of the batch are checked against them before they are swapped.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        batch_size: int,
        train: bool,
        image_size: int,
        crop_ratio: float = 0.875,
        min_scale: float = 0.35,
        crop: str = "random_resized",
        padding: int = 4,
        hflip: bool = True,
        workers: int,
        device: torch.device | str,
        seed: int = 0,
        drop_last: bool,
        order: str | None = None,
        os_cache: bool = True,
        distributed: bool = False,
        batches_ahead: int = 3,
        labels: np.ndarray | None = None,
    ):
        import numba
        from ffcv.fields.basics import IntDecoder
        from ffcv.fields.rgb_image import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder
        from ffcv.loader import Loader, OrderOption
        from ffcv.transforms import RandomHorizontalFlip, RandomTranslate, Squeeze, ToTensor

        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ConfigError(f"batch_size = {batch_size!r}: expected a positive integer")
        _check_image_size(image_size)
        if not 0.0 < crop_ratio <= 1.0:
            raise ConfigError(f"crop_ratio = {crop_ratio!r}: expected a number in (0, 1]")
        if not 0.0 < min_scale <= 1.0:
            raise ConfigError(f"min_scale = {min_scale!r}: expected a number in (0, 1]")
        order = order if order is not None else ("quasi_random" if train else "sequential")
        if order not in ORDERS:
            raise ConfigError(f"order = {order!r}: expected one of {', '.join(ORDERS)}")
        self.order_note = ""
        if order == "quasi_random" and distributed:
            order = "random"
            self.order_note = "FFCV has no quasi_random order in distributed mode: using random"
        if distributed and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise ConfigError("distributed=True needs an initialized torch.distributed process group")

        self.path = Path(path)
        self.info = inspect_beton(self.path)
        if labels is not None:
            labels = np.asarray(labels, dtype=np.int64)
            if labels.shape != (self.info.num_samples,):
                raise ConfigError(f"labels of shape {labels.shape} for the {self.info.num_samples} samples of "
                                  f"'{self.path}': expected one label per sample")
        self.labels = labels
        self.device = torch.device(device)
        self.train = train
        self.order = order
        self.seed = seed
        self.threads = max(1, min(int(workers), numba.config.NUMBA_NUM_THREADS))
        if crop not in ("random_resized", "padded"):
            raise ConfigError(f"crop = {crop!r}: expected 'random_resized' or 'padded'")
        if not isinstance(hflip, bool):
            raise ConfigError(f"hflip = {hflip!r}: expected True or False")
        flip = [RandomHorizontalFlip()] if hflip else []  # FFCV's flips are not seeded: nothing to keep in step
        if train and crop == "padded":  # CIFAR's: the whole image at image_size, flipped, shifted in a black frame
            self.decoder = CenterCropRGBImageDecoder((image_size, image_size), ratio=1.0)
            image_pipeline = [self.decoder, *flip, RandomTranslate(padding=padding), ToTensor()]
        elif train:
            self.decoder = RandomResizedCropRGBImageDecoder((image_size, image_size), scale=(min_scale, 1.0),
                                                            ratio=(3 / 4, 4 / 3))
            image_pipeline = [self.decoder, *flip, ToTensor()]
        else:
            self.decoder = CenterCropRGBImageDecoder((image_size, image_size), ratio=crop_ratio)
            image_pipeline = [self.decoder, ToTensor()]
        # Squeeze(1), not Squeeze(): a last batch of one sample must keep its batch dimension.
        label_pipeline = [IntDecoder(), ToTensor(), Squeeze(1)]
        torch_threads = torch.get_num_threads()
        try:
            self.loader = Loader(
                str(self.path), batch_size=batch_size, num_workers=self.threads, os_cache=os_cache,
                order=OrderOption[order.upper()], distributed=distributed, seed=_order_seed(seed),
                pipelines={IMAGE_FIELD: image_pipeline, LABEL_FIELD: label_pipeline}, drop_last=drop_last,
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
        _check_image_size(image_size)
        self.decoder.output_size = (image_size, image_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample indices of `epoch` in the order they are loaded (before drop_last)."""
        self._restore_pages()
        return np.asarray(self.loader.traversal_order.sample_order(int(epoch)))

    def __len__(self) -> int:
        return len(self.loader)

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


def _check_image_size(image_size) -> None:
    if not (isinstance(image_size, int) and not isinstance(image_size, bool) and 1 <= image_size <= _MAX_SIDE):
        raise ConfigError(f"image_size = {image_size!r}: expected a positive integer (pixels)")
