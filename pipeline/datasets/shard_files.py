"""Random access to the images of a shard folder, for evaluation's map-style sets (a subset, a corruption made per
image, a set shared out between processes): `ShardFiles(shards)` reads sample `key` from its tar with one seek and one
read, at the offset and size its DALI index file gives (shard_index.py), so no shard is read whole for one image and
any sampler or worker order costs the same.

A local folder is read where it is (its index files built there once, each after its shard is checked against the
manifest); a URL's shards are first fetched whole into the local cache (shard_cache.py), checked and indexed there.
`sample(key)` returns (PIL RGB image, label), as `ImageFolderIndex.sample` does for a file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fastanchor.errors import DataError
from fastanchor.pipeline.datasets.shard_cache import default_cache, fetch, local_copy
from fastanchor.pipeline.datasets.shard_index import IMAGE_EXTENSIONS, ensure_indexes, read_index
from fastanchor.pipeline.datasets.shards import ShardSet, decode_rgb, is_url


class ShardFiles:
    """The samples of `shards` by key (see the module's docstring); `cache`: where a URL's shards are copied."""

    def __init__(self, shards: ShardSet, cache: str | Path | None = None):
        self.source = shards.root
        if is_url(shards.root):
            local = local_copy(shards, cache or default_cache())
            fetch(shards, local, range(len(shards.shards)))
            shards = local
        indexes = ensure_indexes(shards)
        self.root, self.classes, self.labels = shards.root, shards.classes, shards.labels
        self.tars = [shards.url(shard) for shard in shards.shards]
        self.places = np.zeros((len(shards), 3), dtype=np.int64)  # per key: shard position, image offset, image size
        for position, (shard, index) in enumerate(zip(shards.shards, indexes)):
            for key, line in enumerate(read_index(index, shard), start=shard.offset):
                parts = line.split(" ")
                offset, size = next((int(parts[i + 1]), int(parts[i + 2])) for i in range(0, len(parts), 4)
                                    if parts[i] in IMAGE_EXTENSIONS)
                self.places[key] = (position, offset, size)
        self._held: tuple[int, object] | None = None  # the tar open last, in this process

    def __len__(self) -> int:
        return len(self.labels)

    def sample(self, key: int):
        """(the image of sample `key`, decoded with PIL and converted to RGB, its label)."""
        position, offset, size = (int(v) for v in self.places[key])
        if self._held is None or self._held[0] != position:
            self.close()
            try:
                self._held = (position, open(self.tars[position], "rb"))
            except OSError as error:
                raise DataError(f"shard '{self.tars[position]}' cannot be read ({error.strerror or error}): write the "
                                f"shards again") from None
        handle = self._held[1]
        handle.seek(offset)
        data = handle.read(size)
        where = f"{key:09d} of '{self.tars[position]}'"
        if len(data) != size:
            raise DataError(f"shard '{self.tars[position]}' ends inside sample {key:09d}: write the shards again")
        return decode_rgb(data, where), int(self.labels[key])

    def close(self) -> None:
        if self._held is not None:
            self._held[1].close()
            self._held = None

    def __getstate__(self):  # to a DataLoader worker: without the open file
        return {**self.__dict__, "_held": None}
