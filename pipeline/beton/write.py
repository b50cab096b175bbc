"""Writing an ImageFolder into a `.beton` file: `write_beton(index, path)` stores every image of
an ImageFolder index (decoded with PIL and converted to RGB, then JPEG-compressed by FFCV, or kept
raw) with its integer label, and checks the written file before renaming it into place.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections import Counter
from pathlib import Path

import numpy as np

from fastanchor.errors import ConfigError, DataError
from fastanchor.files import atomic_path
from fastanchor.pipeline.beton.inspect import IMAGE_FIELD, LABEL_FIELD, MAX_SIDE, BetonInfo, inspect_beton
from fastanchor.pipeline.datasets.imagefolder import ImageFolderIndex, IndexedFiles, load_rgb



class RGBSamples(IndexedFiles):
    """(uint8 [H, W, 3] array, label) per sample of an ImageFolder index, decoded with PIL.

    Every mode (grayscale, palette, CMYK, RGBA, 16-bit) is converted to RGB, as by the baseline
    loader (`load_rgb`); an undecodable file raises DataError naming it."""

    def read(self, path: str) -> np.ndarray:
        image = np.asarray(load_rgb(path), dtype=np.uint8)
        if image.ndim != 3 or image.shape[2] != 3:
            raise DataError(f"image '{path}' decoded to shape {image.shape}: expected an RGB image")
        if max(image.shape[:2]) > MAX_SIDE:
            raise DataError(f"image '{path}' is {image.shape[1]}x{image.shape[0]} pixels: FFCV stores at most "
                            f"{MAX_SIDE} pixels a side; set max_resolution")
        return np.ascontiguousarray(image)


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

    if max_resolution is not None and not (isinstance(max_resolution, int) and 1 <= max_resolution <= MAX_SIDE):
        raise ConfigError(f"max_resolution = {max_resolution!r}: expected None or an integer from 1 to {MAX_SIDE}")
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
