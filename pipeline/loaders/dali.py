"""NVIDIA DALI loading: `readers.file` over an ImageFolder index, or `readers.webdataset` over a shard folder
(pipeline/datasets/shards.py; at a URL, its local copy: pipeline/datasets/shard_cache.py), decoded by DALI on the
CPU or, on CUDA, by nvJPEG (`device="mixed"`), with TorchvisionLoader's batch contract.

`DALILoader` iterates (uint8 [B, 3, s, s] channels-last images, int64 [B] labels) on the training
device. The file list and the labels are the ImageFolder index's (pipeline/datasets/imagefolder.py), passed
to DALI explicitly, so DALI's labels are the index's class numbers by construction. The batches are
DALI's own output buffers, viewed by torch through DLPack (no copy): DALI's default executor
(`exec_dynamic`) hands each output over for good, so a batch stays valid for as long as the caller
keeps it. The HWC batch is viewed as NCHW by a permute, which is channels-last without a copy.

What differs from the other loaders (see also DALILoader's docstring):

* Each iteration (epoch) builds a fresh DALI pipeline (about 10 ms on the CPU) over that epoch's
  file list, so an epoch's order and its random crops and flips are functions of
  (seed, epoch, shard) alone, and an abandoned iteration leaves nothing behind.
* Eval decoding reproduces torchvision's `eval_transform` geometry exactly (shorter side resized to
  round(s / crop_ratio) with the longer side truncated as torchvision does, centre crop rounded
  half-to-even as Python's `round`); DALI decodes JPEGs bit-identically to PIL on the CPU, and its
  antialiased linear resize differs from PIL's by at most 1 (tests/test_dali_loader.py measures it).
* EXIF orientation is ignored (`adjust_orientation=False`), as by PIL's `Image.open` in the other
  two loaders, so that the three loaders see the same pixels.
* Over a shard folder, an epoch is the webdataset loader's stream of sample keys (pipeline/loaders/order.py:
  shards and the samples within each permuted, process `rank` reading shards rank, rank + world_size, ...), handed to
  DALI as index files of that order (pipeline/datasets/shard_index.py); a sample's label is the manifest's, by the
  key DALI reports having read. DALI's reader reads local files only: from a URL, each shard an epoch needs is
  downloaded once into a local cache (`shard_cache`), checked against the manifest and indexed there, before the
  epoch's pipeline is built.
"""

from __future__ import annotations

import contextlib
import itertools
import tempfile
from pathlib import Path

import numpy as np
import torch

from fastanchor.errors import ConfigError, DataError
from fastanchor.pipeline.datasets.imagefolder import ImageFolderIndex, load_rgb, scan_image_folder
from fastanchor.pipeline.datasets.shard_cache import default_cache, fetch, local_copy
from fastanchor.pipeline.datasets.shard_index import IMAGE_EXTENSIONS, ensure_indexes, epoch_listing, index_path
from fastanchor.pipeline.datasets.shards import ShardSet, is_url, shard_images
from fastanchor.pipeline.loaders.order import epoch_stream
from fastanchor.pipeline.loaders.spec import LoaderSpec, check_image_size, checked_spec

_ORDER_TAG, _AUGMENT_TAG = 0x44414C49, 0x41554745  # keep the order and augmentation streams apart


def shard_bounds(num_samples: int, shard_id: int, num_shards: int) -> tuple[int, int]:
    """[start, stop) of shard `shard_id` in a list of `num_samples` files, as DALI's readers split it
    (shard k starts at floor(num_samples * k / num_shards))."""
    return num_samples * shard_id // num_shards, num_samples * (shard_id + 1) // num_shards


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The training order of `epoch`: a permutation of range(num_samples), the same on every shard."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch), _ORDER_TAG]))
    return rng.permutation(num_samples)


def augmentation_seed(seed: int, epoch: int, shard_id: int) -> int:
    """DALI's pipeline seed for the crops and flips of (seed, epoch, shard): each shard draws its own."""
    state = np.random.SeedSequence([int(seed), int(epoch), int(shard_id), _AUGMENT_TAG]).generate_state(1)
    return int(state[0]) >> 1


class DALILoader:
    """DALI's `readers.file` + `decoders.image` over an ImageFolder index (or its root), or `readers.webdataset` over
    a shard folder (a ShardSet: local, or at a URL and copied shard by shard into `shard_cache`, default
    `~/.cache/fastanchor/shards`), built from a LoaderSpec (`spec`: the settings every loader shares, named below
    by their field names) and DALI's `prefetch` depth.

    Iterating yields (uint8 [B, 3, s, s] channels-last images, int64 [B] labels) on `device`.
    Decoding runs on the CPU (`workers` DALI threads; 0 means 1) for a CPU device, and with
    `device="mixed"` (nvJPEG, on the GPU) for a CUDA device, where the batch is born on the GPU.

    Train: random-resized-crop fused into the decoder (`decoders.image_random_crop`: only the
    crop's region is decoded where the format allows) with area scale in [min_scale, 1] and aspect
    ratio in [3/4, 4/3] (torchvision's defaults, 10 attempts), resized to s x s (antialiased
    linear), horizontal flip with probability 1/2 (never with `hflip=False`, in either crop; the
    coin is still drawn, so the crops, shifts and policies are those of `hflip=True`, minus the
    flip). `crop="padded"` (CIFAR's) instead decodes the
    whole image, resizes its centred square to s x s and, after the flip, shifts it by up to `padding` pixels each
    way inside a black frame. `policy` (autoaugment, randaugment, trivialaugment_wide) then applies
    DALI's `auto_aug` per sample (see `apply_policy`); DALI has no AugMix. Eval: shorter side resized to
    round(s / crop_ratio), centre crop s x s, exactly torchvision's `eval_transform` geometry.

    Order: train shuffles with a permutation of (seed, epoch), the same on every shard; eval reads
    the index in order. `set_epoch(epoch)` picks the epoch of the next iteration (without it, each
    iteration takes the next epoch). The crops and flips are drawn by DALI from a pipeline seed of
    (seed, epoch, rank): an epoch is reproducible image for image on the same decoding backend
    (CPU or mixed) whatever the `workers`. The CPU path is tested; the mixed path needs a GPU.

    Over a shard folder the order and sharding are instead the webdataset loader's (`epoch_stream`: shards and their
    samples permuted per (seed, epoch); process `rank` reads shards rank, rank + world_size, ..., in training cut or
    repeated to ceil(N / world_size) samples), each process's stream handed to DALI whole (its reader then reads one
    shard of one). The crops and flips are DALI's draws, as over the files.

    Sharding of the files (process `rank` of `world_size`): DALI's reader splits the
    epoch's list into contiguous shards. Train: as torch's DistributedSampler, the permutation is
    padded with its first samples to a multiple of `world_size`, so every shard has
    ceil(N / world_size) samples and the same number of batches. Eval: no padding, every sample
    is read exactly once over all shards (shard sizes may then differ by one).

    The last batch: DALI's reader pads it by repeating the shard's last sample; the loader drops
    the padding, so a last partial batch is yielded short, or not at all with `drop_last`.

    `set_image_size(s)` changes the output size from the next iteration on (progressive resizing).
    A file DALI cannot decode raises DataError naming it (the batch's files are checked with PIL
    to find it); the pipeline is rebuilt at the next iteration.
    """

    def __init__(self, index: ImageFolderIndex | ShardSet | str | Path, spec: LoaderSpec, *, prefetch: int = 2,
                 shard_cache: str | Path | None = None):
        self.spec = spec = checked_spec(spec)
        spec.require_policy(POLICIES, f"DALI's auto_aug offers {', '.join(POLICIES)}")
        if not _positive_int(prefetch):
            raise ConfigError(f"prefetch = {prefetch!r}: expected a positive integer")
        self.shards, self.index_files, self.remote = None, [], None
        if isinstance(index, ShardSet):
            if spec.train and len(index.shards) < spec.world_size:
                raise ConfigError(f"shard folder '{index.root}' has {len(index.shards)} shard(s) for {spec.world_size} "
                                  f"training processes: write smaller shards (fastanchor prepare --shard-size)")
            if is_url(index.root):  # DALI reads local files: each shard an epoch needs is fetched once, before it
                self.remote, self.shards = index, local_copy(index, shard_cache or default_cache())
                self.index_files = [index_path(self.shards, p) for p in range(len(index.shards))]
            else:
                self.shards, self.index_files = index, ensure_indexes(index)
            self.files, self.labels = [], index.labels
        else:
            if not isinstance(index, ImageFolderIndex):
                index = scan_image_folder(index)
            self.files = [path for path, _ in index.samples]
            self.labels = np.array([label for _, label in index.samples], dtype=np.int64)
        self.index = index
        self.batch_size, self.train, self.image_size = spec.batch_size, spec.train, spec.image_size
        self.crop_ratio, self.min_scale = spec.crop_ratio, spec.min_scale
        self.crop, self.padding, self.policy, self.hflip = spec.crop, spec.padding, spec.policy, spec.hflip
        self.threads = max(1, spec.workers)
        self.device = torch.device(spec.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.seed, self.drop_last = spec.seed, spec.drop_last
        self.rank, self.world_size = spec.rank, spec.world_size
        self.prefetch = prefetch
        self._epoch = 0

    # --- the public knobs -----------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """The next iteration loads `epoch` (its order and augmentations are functions of (seed, epoch))."""
        self._epoch = int(epoch)

    def set_image_size(self, image_size: int) -> None:
        """Output s x s images from the next iteration on (an epoch in progress keeps its size)."""
        check_image_size(image_size)
        self.image_size = image_size

    @property
    def num_samples(self) -> int:
        """Samples this shard reads per epoch, including the train padding, before drop_last."""
        if self.train:
            return -(-len(self.labels) // self.world_size)
        if self.shards is not None:
            return sum(shard.count for shard in self.shards.shards[self.rank::self.world_size])
        start, stop = shard_bounds(len(self.files), self.rank, self.world_size)
        return stop - start

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def iter_from(self, first_batch: int):
        """The current epoch from batch `first_batch` on: the first batches are decoded and dropped (an epoch's
        order is a function of (seed, epoch), so the rest are the batches of an uninterrupted epoch)."""
        return itertools.islice(iter(self), first_batch, None)

    @property
    def shards_evaluation(self) -> bool:
        """Sharded evaluation reads every sample exactly once over all processes."""
        return self.world_size > 1

    def epoch_files(self, epoch: int) -> np.ndarray:
        """Positions (in the index) of the file list handed to DALI for `epoch`, all shards."""
        if not self.train:
            return np.arange(len(self.files))
        order = epoch_permutation(len(self.files), self.seed, epoch)
        padding = self.num_samples * self.world_size - len(order)
        return np.concatenate([order, order[:padding]])

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Positions (in the index; in a shard folder, sample keys) of the samples this shard loads in `epoch`, in
        order, before drop_last."""
        if self.shards is not None:
            return epoch_stream(self.shards, seed=self.seed, epoch=epoch, shuffle=self.train, rank=self.rank,
                                world_size=self.world_size)
        listed = self.epoch_files(epoch)
        start, stop = shard_bounds(len(listed), self.rank, self.world_size)
        return listed[start:stop]

    # --- iterating --------------------------------------------------------------------------------

    def __iter__(self):
        epoch = self._epoch
        self._epoch += 1
        batches = len(self)
        if batches == 0:
            return
        order = self.epoch_order(epoch)  # what DALI's reader reads for this shard
        with self._listing(epoch, order) as listing:
            pipe = self._build(listing, epoch)
            try:
                for batch in range(batches):
                    try:
                        images, labels = pipe.run()
                    except RuntimeError as error:
                        raise self._decode_error(order, batch, error) from None
                    count = min(self.batch_size, len(order) - batch * self.batch_size)
                    yield self._to_torch(images, labels, count)
            finally:
                del pipe

    @contextlib.contextmanager
    def _listing(self, epoch: int, order: np.ndarray):
        """What DALI's reader reads in `epoch`: the files and labels of all shards (DALI splits them), or this
        process's stream `order` of a shard folder as tars and index files of that order (in a folder of its own
        while the epoch runs)."""
        if self.shards is None:
            listed = self.epoch_files(epoch)
            yield {"files": [self.files[i] for i in listed], "labels": self.labels[listed].tolist()}
            return
        if self.remote is not None:
            fetch(self.remote, self.shards, self.shards.shard_of()[order])
        with tempfile.TemporaryDirectory(prefix="fastanchor-dali-") as folder:
            paths, index_paths = epoch_listing(self.shards, self.index_files, order, Path(folder))
            yield {"paths": paths, "index_paths": index_paths}

    def _to_torch(self, images, labels, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """DALI's HWC batch as a channels-last NCHW tensor, and the labels, both without a copy (over shards: the
        manifest's labels of the keys DALI says it read, named in its samples' source info)."""
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            images = torch.from_dlpack(images.as_tensor())  # on CUDA: DLPack's stream handshake with torch's stream
            if self.shards is None:
                labels = torch.from_dlpack(labels.as_tensor()).reshape(-1)[:count]
        if self.shards is not None:
            keys = [int(bytes(np.asarray(labels[i])).decode().rpartition(":")[2].partition(".")[0]) for i in range(count)]
            labels = torch.from_numpy(self.labels[keys]).to(self.device)
        return images[:count].permute(0, 3, 1, 2), labels  # [B, H, W, 3] -> [B, 3, H, W] view, channels-last

    def _build(self, listing: dict, epoch: int):
        from nvidia.dali import pipeline_def

        cuda = self.device.type == "cuda"
        graph = self._train_graph if self.train else self._eval_graph
        build = pipeline_def(graph, enable_conditionals=self.train and self.policy != "none")  # auto_aug branches per sample
        pipe = build(
            listing, "mixed" if cuda else "cpu", self.image_size,
            batch_size=self.batch_size, num_threads=self.threads, device_id=self.device.index if cuda else None,
            seed=augmentation_seed(self.seed, epoch, self.rank), prefetch_queue_depth=self.prefetch,
        )
        try:
            pipe.build()
        except RuntimeError as error:
            raise DataError(f"DALI cannot read the images under '{self.index.root}': {_first_line(error)}") from None
        return pipe

    def _reader(self, listing: dict):
        """The encoded images and what gives their labels: the labels (files), or the images themselves, whose
        source info `_labels` reads at the graph's end (shards; made last, it shifts no random operator's seed)."""
        from nvidia.dali import fn, types

        if self.shards is not None:
            encoded = fn.readers.webdataset(
                paths=listing["paths"], index_paths=listing["index_paths"], ext=[";".join(IMAGE_EXTENSIONS)],
                missing_component_behavior="error", random_shuffle=False, pad_last_batch=True, name="Reader")
            return encoded, encoded
        encoded, labels = fn.readers.file(
            files=listing["files"], labels=listing["labels"], shard_id=self.rank, num_shards=self.world_size,
            random_shuffle=False, pad_last_batch=True, name="Reader")
        return encoded, fn.cast(labels, dtype=types.INT64)

    def _labels(self, labels, decoder: str):
        from nvidia.dali import fn

        if self.shards is not None:
            return fn.get_property(labels, key="source_info")  # "<tar>:<offset>:<key>.<ext>", on the CPU
        return labels.gpu() if decoder == "mixed" else labels

    def _train_graph(self, listing, decoder: str, size: int):
        from nvidia.dali import fn, types
        from nvidia.dali import math as dali_math

        encoded, labels = self._reader(listing)
        if self.crop == "padded":  # CIFAR's: the image's centred square (as FFCV's decoder takes it) at size x size,
            # then shifted in a black frame below
            images = fn.decoders.image(encoded, device=decoder, output_type=types.RGB, adjust_orientation=False,
                                       jpeg_fancy_upsampling=True)
            shape = fn.shapes(images, dtype=types.FLOAT)  # (height, width, channels)
            side = dali_math.min(shape[0], shape[1])
            images = fn.crop(images, crop_h=side, crop_w=side)
        else:
            images = fn.decoders.image_random_crop(
                encoded, device=decoder, output_type=types.RGB, random_area=[self.min_scale, 1.0],
                random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10, adjust_orientation=False, jpeg_fancy_upsampling=True)
        images = fn.resize(images, resize_x=size, resize_y=size, interp_type=types.INTERP_LINEAR, antialias=True)
        # With hflip=False the coin stays, never heads: DALI seeds each random operator from the pipeline
        # seed in the order they are built, so removing it would change the shifts and policies after it.
        images = fn.flip(images, horizontal=fn.random.coin_flip(probability=0.5 if self.hflip else 0.0))
        if self.policy != "none":
            images = apply_policy(images, self.policy, size)
        if self.crop == "padded" and self.padding:
            shifts = [float(v) for v in range(-self.padding, self.padding + 1)]
            start = fn.cast(fn.random.uniform(values=shifts, shape=2), dtype=types.INT32)  # (dy, dx)
            images = fn.slice(images, start=start, shape=[size, size], axis_names="HW", out_of_bounds_policy="pad",
                              fill_values=0)
        return images, self._labels(labels, decoder)

    def _eval_graph(self, listing, decoder: str, size: int):
        import nvidia.dali.math as dmath
        from nvidia.dali import fn, types

        encoded, labels = self._reader(listing)
        # torchvision's Resize(round(size / crop_ratio)): the shorter side gets the target, the longer
        # side int(target * long / short); computed per sample from the encoded image's header.
        shape = fn.peek_image_shape(encoded, adjust_orientation=False)
        height, width = shape[0], shape[1]
        target, shorter = round(size / self.crop_ratio), dmath.min(height, width)
        new_height, new_width = target * height // shorter, target * width // shorter
        images = fn.decoders.image(encoded, device=decoder, output_type=types.RGB, adjust_orientation=False,
                                   jpeg_fancy_upsampling=True)
        images = fn.resize(images, resize_x=_as_float(new_width), resize_y=_as_float(new_height),
                           interp_type=types.INTERP_LINEAR, antialias=True)
        images = fn.crop(images, crop=(size, size), crop_pos_x=_centre_crop_position(new_width, size),
                         crop_pos_y=_centre_crop_position(new_height, size), rounding="round")
        return images, self._labels(labels, decoder)

    def _decode_error(self, order: np.ndarray, batch: int, error: RuntimeError) -> DataError:
        """A DataError naming the file DALI failed on: the files of this batch and the ones DALI
        may have been preparing ahead of it are decoded with PIL, the first failure is named."""
        start = batch * self.batch_size
        candidates = order[start: start + (1 + self.prefetch) * self.batch_size]
        try:
            if self.shards is not None:  # each shard read whole and checked against its manifest
                shard_images(self.shards, candidates)
            else:
                for position in candidates:
                    load_rgb(self.files[position])
        except DataError as found:
            return DataError(f"DALI: {found}")
        stop = min(len(order), start + self.batch_size)
        return DataError(f"DALI failed on batch {batch} (samples {start} to {stop - 1} of shard {self.rank}) "
                         f"under '{self.index.root}': {_first_line(error)}")


POLICIES = ("none", "autoaugment", "randaugment", "trivialaugment_wide")


def apply_policy(images, policy: str, size: int):
    """DALI's auto_aug version of torchvision's policy (per sample, on the decoding device): the same
    operations and magnitudes, translations up to 150/331 of the side (AutoAugment, RandAugment with
    2 operations at magnitude 9 of 31 bins) or 32 pixels (TrivialAugment-wide), black fill as torchvision."""
    from nvidia.dali.auto_aug import auto_augment, rand_augment, trivial_augment

    if policy == "autoaugment":
        return auto_augment.auto_augment_image_net(images, shape=(size, size), fill_value=0, max_translate_rel=150 / 331)
    if policy == "randaugment":
        return rand_augment.rand_augment(images, n=2, m=9, shape=(size, size), fill_value=0, max_translate_rel=150 / 331)
    return trivial_augment.trivial_augment_wide(images, fill_value=0, max_translate_abs=32)


def _as_float(node):
    from nvidia.dali import fn, types

    return fn.cast(node, dtype=types.FLOAT)


def _centre_crop_position(extent, size: int):
    """DALI's normalised crop position whose window starts where torchvision's CenterCrop starts:
    at round((extent - size) / 2) with Python's round (half to even)."""
    import nvidia.dali.math as dmath

    slack = extent - size
    half = slack // 2
    start = half + (slack % 2) * (half % 2)  # an odd slack's .5 rounds to the even neighbour
    return _as_float(start) / _as_float(dmath.max(slack, 1))


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(("Critical error", "Error in", "which was used", "File ",
                                                             "encountered", "Current pipeline"))]
    return (useful or lines or [type(error).__name__])[0]


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
