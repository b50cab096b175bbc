"""The in-memory loader for small datasets: the split decoded once, held on the device as one uint8 tensor, and
every training crop and flip made there as batch ops (as airbench does).

Decoding: each file decoded by PIL and converted to RGB, as the torchvision loader decodes it (the same pixels),
once; the decoded split is cached as `<split's parent>/memory/<split>-<key>.npy` (written atomically; `key` names the
file list, each file's size and modification time, so a changed tree is decoded again and later runs skip decoding).
Every image of the split must have one size. A split larger than half the device's free memory (the host's available
memory on the CPU) is refused before anything is decoded.

Training batches: the epoch's order and every crop and flip (and a per-image policy's seed) come from one CPU generator
seeded by (seed, epoch) and are indexed by sample, so a sample's augmentation is the same on any device, in any shard
and after resuming; the order
is the torchvision loader's (same permutation of the same index). `padded` crops (CIFAR's: zero padding, random
window, of the images at image_size: images of another size are held as their centred square resized once, as
for evaluation at crop_ratio 1) are a gather of the held pixels and come out exactly as torchvision's RandomCrop +
flip makes them at the same offsets; `random_resized` crops draw Inception boxes as torchvision does and resize them
with the antialiased bilinear filter torch and PIL define, within a grey level of the torchvision loader's PIL
resize. A per-image policy
(augment.auto_augment) is torchvision's, applied after the crop and flip to each image's uint8 tensor with torch's
generator seeded by the sample's seed (the torchvision loader applies the same policy to the PIL image). Evaluation
batches: resized (the shorter side to image_size / crop_ratio, the same filter; nothing where the images have that size
already) and centre-cropped once; the index's order.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from fastanchor.errors import ConfigError, DataError
from fastanchor.files import atomic_write_bytes
from fastanchor.pipeline.datasets.imagefolder import ImageFolderIndex, load_rgb
from fastanchor.pipeline.loaders.order import epoch_shard
from fastanchor.pipeline.loaders.transforms import AUTO_AUGMENT_POLICIES, POLICIES, epoch_generator, seeded
from fastanchor.pipeline.loaders.spec import LoaderSpec, check_image_size, checked_spec

MEMORY_SHARE = 0.5  # the decoded split may take at most this share of the device's free memory
RATIO = (3 / 4, 4 / 3)  # random_resized crops' aspect ratios, as torchvision's
ATTEMPTS = 10  # random_resized boxes drawn before the centre fallback, as torchvision's


# ----------------------------------------------------------------------------------------------
# The decoded split and its cache


def file_list_key(index: ImageFolderIndex) -> str:
    """16 hex digits naming the index's files in order, with each file's size and modification time."""
    digest = hashlib.sha256()
    for path, _ in index.samples:
        stat = os.stat(path)
        digest.update(f"{os.path.relpath(path, index.root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def cache_path(index: ImageFolderIndex, cache_dir: str | Path | None = None) -> Path:
    """Where the decoded split is cached: `cache_dir` (None: the `memory/` folder beside the split) / <split>-<key>.npy."""
    folder = Path(cache_dir) if cache_dir is not None else index.root.parent / "memory"
    return folder / f"{index.root.name}-{file_list_key(index)}.npy"


def available_bytes(device: torch.device) -> int:
    """Free memory of `device`: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(index: ImageFolderIndex, device: torch.device, limit: int | None) -> tuple[int, int]:
    """The split's image (height, width), read from its first file; ConfigError, before any decoding, where the
    decoded split would take more than `limit` bytes (None: MEMORY_SHARE of the device's free memory)."""
    first = index.samples[0][0]
    try:
        with Image.open(first) as image:
            width, height = image.size
    except (OSError, ValueError) as error:
        raise DataError(f"cannot decode image '{first}': {error}") from None
    needed = len(index) * 3 * height * width
    if limit is None:
        limit = int(MEMORY_SHARE * available_bytes(device))
    if needed > limit:
        raise ConfigError(f"data.loader = 'memory': the {len(index):,} images of '{index.root}' ({width} x {height} px) "
                          f"take {needed / 2**30:.2f} GiB decoded, more than the {limit / 2**30:.2f} GiB allowed on "
                          f"{device} (half its free memory): expected a small dataset; use data.loader=torchvision")
    return height, width


def decode_split(index: ImageFolderIndex, height: int, width: int) -> np.ndarray:
    """Every image of the index decoded (PIL, RGB): uint8 [N, height, width, 3]; DataError at an image of another size."""
    pixels = np.empty((len(index), height, width, 3), dtype=np.uint8)
    for i, (path, _) in enumerate(index.samples):
        image = np.asarray(load_rgb(path))
        if image.shape != pixels.shape[1:]:
            raise DataError(f"image '{path}' is {image.shape[1]} x {image.shape[0]} px, the split's first "
                            f"'{index.samples[0][0]}' {width} x {height} px: data.loader=memory expects images of one "
                            f"size (data.loader=torchvision reads any)")
        pixels[i] = image
    return pixels


def read_cache(path: Path, shape: tuple[int, ...]) -> np.ndarray | None:
    """The cached split at `path` if it is there, whole and of `shape`; None otherwise (it is then decoded again)."""
    try:
        pixels = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    return pixels if pixels.shape == shape and pixels.dtype == np.uint8 else None


def decoded_split(index: ImageFolderIndex, device: torch.device, *, cache_dir: str | Path | None = None,
                  limit: int | None = None) -> np.ndarray:
    """The split's pixels, uint8 [N, H, W, 3]: from its cache, or decoded and then cached (an unwritable cache folder
    is said in one line and decoding happens again next time)."""
    if len(index) == 0:
        raise DataError(f"'{index.root}' holds no images: nothing for data.loader=memory to hold")
    height, width = check_fits(index, device, limit)
    path = cache_path(index, cache_dir)
    pixels = read_cache(path, (len(index), height, width, 3))
    if pixels is not None:
        return pixels
    pixels = decode_split(index, height, width)
    try:
        atomic_write_bytes(path, lambda handle: np.save(handle, pixels, allow_pickle=False))
    except OSError as error:
        print(f"data.loader=memory: cannot cache the decoded split at '{path}' ({error.strerror or error}); "
              f"decoding it again next run", file=sys.stderr, flush=True)
    return pixels


# ----------------------------------------------------------------------------------------------
# Batch ops on the device


def padded_crops(images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor, size: int,
                 padding: int) -> torch.Tensor:
    """size x size windows at (`top`, `left`) of `images` (uint8 [B, H, W, C]) framed by `padding` zero pixels, each
    mirrored left-right where `flip`: uint8 [B, size, size, C]. A flip is the window's columns read backwards."""
    framed = F.pad(images, (0, 0, padding, padding, padding, padding))
    steps = torch.arange(size, device=images.device)
    rows = top[:, None] + steps
    columns = left[:, None] + torch.where(flip[:, None], size - 1 - steps, steps)
    batch = torch.arange(len(images), device=images.device)[:, None, None]
    return framed[batch, rows[:, :, None], columns[:, None, :]]


def resized_crops(images: torch.Tensor, boxes: torch.Tensor, flip: torch.Tensor, size: int) -> torch.Tensor:
    """Each box (top, left, height, width) of `images` (uint8 [B, H, W, C]) resized to size x size with the
    antialiased bilinear filter of torch's `interpolate(antialias=True)` (separable: a row and a column weight
    matrix per image, the pixels outside the box weighted 0), mirrored where `flip`: uint8 [B, size, size, C]."""
    top, left, height, width = boxes.to(images.device).unbind(1)
    rows = resampling_weights(top, height, size, images.shape[1])  # [B, size, H]
    columns = resampling_weights(left, width, size, images.shape[2])  # [B, size, W]
    columns = torch.where(flip[:, None, None], columns.flip(1), columns)
    return resample(images, rows, columns)


def resample(images: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """uint8 [B, H, W, C] images resampled by row weights [B, h, H] and column weights [B, w, W]: uint8 [B, h, w, C]."""
    planar = images.permute(0, 3, 1, 2).float()  # [B, C, H, W]
    resized = rows[:, None] @ planar @ columns[:, None].transpose(2, 3)
    return resized.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def resampling_weights(start: torch.Tensor, length: torch.Tensor, size: int, extent: int) -> torch.Tensor:
    """[B, size, extent] weights that resample pixels start..start + length - 1 of a line of `extent` pixels to
    `size` pixels: the triangle filter of antialiased bilinear resizing, as wide as the scale where it shrinks,
    centred on each output pixel's centre mapped back, normalised over the pixels it covers (torch's and PIL's
    definition)."""
    scale = (length.double() / size)[:, None, None]
    support = scale.clamp(min=1.0)
    centres = start.double()[:, None, None] + scale * (torch.arange(size, device=start.device)[None, :, None] + 0.5)
    pixels = torch.arange(extent, device=start.device, dtype=torch.float64)
    weights = (1 - ((pixels + 0.5) - centres).abs() / support).clamp(min=0)
    inside = (pixels >= start.double()[:, None]) & (pixels < (start + length).double()[:, None])
    weights = weights * inside[:, None, :]
    return (weights / weights.sum(dim=2, keepdim=True)).float()


def resized_crop_boxes(count: int, height: int, width: int, min_scale: float,
                       generator: torch.Generator) -> torch.Tensor:
    """`count` Inception boxes (top, left, height, width), int64 [count, 4], drawn as torchvision's RandomResizedCrop
    draws one (area share in [min_scale, 1], aspect log-uniform in 3/4-4/3, up to 10 tries, then the largest centred
    box within those aspects), all at once from `generator`."""
    area = height * width
    scale = torch.empty(count, ATTEMPTS, dtype=torch.float64).uniform_(min_scale, 1.0, generator=generator)
    log_ratio = torch.empty(count, ATTEMPTS, dtype=torch.float64).uniform_(math.log(RATIO[0]), math.log(RATIO[1]),
                                                                           generator=generator)
    aspect = log_ratio.exp()
    w = (area * scale * aspect).sqrt().round().long()
    h = (area * scale / aspect).sqrt().round().long()
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = fits.long().argmax(dim=1, keepdim=True)  # the first box that fits (0 where none does)
    w, h = w.gather(1, first)[:, 0], h.gather(1, first)[:, 0]
    top = (torch.rand(count, generator=generator, dtype=torch.float64) * (height - h + 1).clamp(min=1)).long()
    left = (torch.rand(count, generator=generator, dtype=torch.float64) * (width - w + 1).clamp(min=1)).long()
    fallback_h, fallback_w = centre_box(height, width)
    missed = ~fits.any(dim=1)
    h, w = torch.where(missed, fallback_h, h), torch.where(missed, fallback_w, w)
    top = torch.where(missed, (height - h) // 2, top)
    left = torch.where(missed, (width - w) // 2, left)
    return torch.stack([top, left, h, w], dim=1)


def centre_box(height: int, width: int) -> tuple[int, int]:
    """(height, width) of the largest box within RATIO's aspects (torchvision's fallback)."""
    aspect = width / height
    if aspect < RATIO[0]:
        return round(width / RATIO[0]), width
    if aspect > RATIO[1]:
        return height, round(height * RATIO[1])
    return height, width


def eval_images(images: torch.Tensor, image_size: int, crop_ratio: float) -> torch.Tensor:
    """torchvision's eval geometry on uint8 [N, H, W, C]: the shorter side resized to round(image_size / crop_ratio)
    (antialiased bilinear, skipped where it has that size already), then the centred image_size square."""
    height, width = images.shape[1:3]
    short = round(image_size / crop_ratio)
    if min(height, width) != short:
        target = (short, int(short * width / height)) if height <= width else (int(short * height / width), short)
        whole = torch.zeros(len(images), dtype=torch.long, device=images.device)
        rows = resampling_weights(whole, whole + height, target[0], height)
        columns = resampling_weights(whole, whole + width, target[1], width)
        images = resample(images, rows, columns)
        height, width = target
    if image_size > min(height, width):
        raise ConfigError(f"image_size = {image_size}: larger than the {height} x {width} px resized images "
                          f"(crop_ratio = {crop_ratio}): expected crop_ratio <= 1")
    top, left = round((height - image_size) / 2), round((width - image_size) / 2)
    return images[:, top:top + image_size, left:left + image_size].contiguous()


# ----------------------------------------------------------------------------------------------
# The loader


class MemoryLoader:
    """Iterates (uint8 channels-last [B, 3, s, s] images, int64 labels) on the spec's device from the split held there
    (`decoded_split`); a training spec shuffles, crops and flips per (seed, epoch), then applies its per-image policy
    if it has one, an evaluation spec reads the index's
    order (rank r of world_size every world_size-th image). `cache_dir`: where the decoded split is cached (None:
    beside the split); `limit`: the most bytes it may take (None: half the device's free memory)."""

    def __init__(self, index: ImageFolderIndex, spec: LoaderSpec, *, cache_dir: str | Path | None = None,
                 limit: int | None = None):
        self.spec = spec = checked_spec(spec)
        spec.require_policy(POLICIES, f"expected one of {', '.join(POLICIES)}")
        self.policy = AUTO_AUGMENT_POLICIES[spec.policy]() if spec.train and spec.policy != "none" else None
        self.device = torch.device(spec.device)
        pixels = torch.from_numpy(decoded_split(index, self.device, cache_dir=cache_dir, limit=limit))
        self.labels = torch.tensor([label for _, label in index.samples], dtype=torch.long, device=self.device)
        self.images = pixels.to(self.device)  # uint8 [N, H, W, 3]
        if not spec.train:
            self.images = eval_images(self.images, spec.image_size, spec.crop_ratio)
        elif spec.crop == "padded":  # CIFAR's crop frames the image at image_size: its centred square, resized once
            self.images = eval_images(self.images, spec.image_size, 1.0)
        self.epoch = 0
        self.image_size = spec.image_size
        self.check_crop(self.image_size)

    def check_crop(self, image_size: int) -> None:
        height, width = self.images.shape[1:3]
        if self.spec.train and self.spec.crop == "padded" and image_size > min(height, width) + 2 * self.spec.padding:
            raise ConfigError(f"image_size = {image_size}: a padded crop of the {width} x {height} px images with "
                              f"padding {self.spec.padding} is at most {min(height, width) + 2 * self.spec.padding} px")

    @property
    def num_samples(self) -> int:
        return len(self.images)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_image_size(self, image_size: int) -> None:
        """Training crops of image_size x image_size from the next iteration on (evaluation keeps the spec's size)."""
        check_image_size(image_size)
        self.check_crop(image_size)
        self.image_size = image_size

    @property
    def shards_evaluation(self) -> bool:
        """Sharded evaluation reads every image exactly once over all processes."""
        return self.spec.world_size > 1

    def shard(self) -> torch.Tensor:
        """The sample indices this process reads in the current epoch (CPU int64): shuffled for training (a permutation
        of (seed, epoch), padded with its first samples to a multiple of world_size, rank taking every world_size-th),
        or every world_size-th of the index from rank on for evaluation."""
        spec = self.spec
        return epoch_shard(self.num_samples, seed=spec.seed, epoch=self.epoch, shuffle=spec.train, rank=spec.rank,
                           world_size=spec.world_size)[0]

    def generator(self) -> torch.Generator:
        """The current epoch's generator (order.epoch_shard's: the order first), then every sample's crop and flip."""
        return epoch_generator(self.spec.seed, self.epoch)

    def augmentation(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every sample's crop (padded: [N, 2] top, left; random_resized: [N, 4] boxes), flip ([N] bool) and policy
        seed ([N] int64) of the current epoch, drawn after the order from the epoch's generator (a flip coin is drawn
        even without hflip, and a seed even without a policy, so neither changes another draw)."""
        spec, size = self.spec, self.image_size
        generator = self.generator()
        torch.randperm(self.num_samples, generator=generator)  # the order's draws, as shard() makes them
        height, width = self.images.shape[1:3]
        if spec.crop == "padded":
            top = torch.randint(0, height + 2 * spec.padding - size + 1, (self.num_samples,), generator=generator)
            left = torch.randint(0, width + 2 * spec.padding - size + 1, (self.num_samples,), generator=generator)
            crops = torch.stack([top, left], dim=1)
        else:
            crops = resized_crop_boxes(self.num_samples, height, width, spec.min_scale, generator)
        flips = torch.rand(self.num_samples, generator=generator) < 0.5
        seeds = torch.randint(0, 2**62, (self.num_samples,), generator=generator)
        return crops, flips & spec.hflip, seeds

    def __len__(self) -> int:
        spec = self.spec
        samples = -(-self.num_samples // spec.world_size) if spec.train else len(range(spec.rank, self.num_samples,
                                                                                       spec.world_size))
        whole, rest = divmod(samples, spec.batch_size)
        return whole + (rest > 0 and not spec.drop_last)

    def __iter__(self):
        return self.iter_from(0)

    def iter_from(self, first_batch: int):
        """The current epoch's batches from batch `first_batch` on (the earlier ones are not made). The epoch's order
        and draws go to the device once, so a batch is made there without a copy from the host."""
        order = self.shard()
        chosen = order.to(self.device)
        crops, flips, seeds = self.augmentation() if self.spec.train else (None, None, None)
        crops, flips = (None, None) if crops is None else (crops.to(self.device), flips.to(self.device))
        size = self.spec.batch_size
        for start in range(first_batch * size, len(self) * size, size):
            images, labels = self.batch(chosen[start:start + size], crops, flips)
            if self.policy is not None:  # per image, each from its sample's seed (kept on the CPU)
                images = self.with_policy(images, seeds[order[start:start + size]].tolist())
            yield images, labels

    def batch(self, picked: torch.Tensor, crops: torch.Tensor | None, flips: torch.Tensor | None):
        images = self.images[picked]
        if crops is not None:
            crop, flip = crops[picked], flips[picked]
            if self.spec.crop == "padded":
                images = padded_crops(images, crop[:, 0], crop[:, 1], flip, self.image_size, self.spec.padding)
            else:
                images = resized_crops(images, crop, flip, self.image_size)
        return images.permute(0, 3, 1, 2), self.labels[picked]

    def with_policy(self, images: torch.Tensor, seeds: list[int]) -> torch.Tensor:
        """The policy applied to each uint8 [3, s, s] image of the batch with torch's generator seeded by its seed."""
        def one(image: torch.Tensor, seed: int) -> torch.Tensor:
            with seeded(seed):
                return self.policy(image)
        return torch.stack([one(image, seed) for image, seed in zip(images, seeds)]).contiguous(
            memory_format=torch.channels_last)
