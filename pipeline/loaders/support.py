"""What the trainer asks of any loader (see `Loader` in spec.py): resuming mid-epoch, sharded evaluation."""

from __future__ import annotations

from fastanchor.pipeline.loaders.spec import Loader


def evaluation_is_sharded(loader: Loader) -> bool:
    """Whether an eval loader built with world_size > 1 reads a disjoint shard (else every process reads all)."""
    return loader.shards_evaluation


def iterate_from(loader: Loader, first_batch: int):
    """Iterate the loader's current epoch from batch `first_batch` on (resuming mid-epoch)."""
    return iter(loader) if first_batch == 0 else loader.iter_from(first_batch)
