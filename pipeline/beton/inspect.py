"""The .beton format: its field names and image modes, and `inspect_beton`, which checks a file's
structure (header, fields, metadata, page table) without FFCV and says what it holds.

The whole .beton lifecycle lives in this package: write.py writes one from an ImageFolder index,
manifest.py records which tree it was written from, audit.py checks a tree before it is written,
and the FFCV loader (pipeline/loaders/ffcv.py) reads it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastanchor.errors import DataError

IMAGE_FIELD = "image"
LABEL_FIELD = "label"
JPEG_MODE, RAW_MODE = 0, 1  # ffcv.fields.rgb_image.IMAGE_MODES
_RGB_IMAGE_TYPE_ID, _INT_TYPE_ID = 2, 1  # ffcv.types.TYPE_ID_HANDLER
MAX_SIDE = 65535  # FFCV stores width and height as uint16



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
