"""The loaders, one entry each: `LOADERS[name]` says everything about loader `name` (what makes it, what it reads,
where it decodes, whether training can select it), and `make` builds one in one call.

Everything that names loaders reads this table: the config's `data.loader` choices (`TRAINING_LOADERS`), the
trainer's builder (`make`), the check of per-image policies (`check_loader_supports`) and the benchmarks
(`bench loader --loaders`, `bench e2e --loader`). It imports no torch (trainer/config.py reads it for `--help`):
an entry names its maker as "module:function" and its module is imported when a loader is made.

Every loader is made from a source (an ImageFolder index, a .beton path for FFCV, which pipeline/beton/ writes, or
a ShardSet for WebDataset shards, which pipeline/datasets/shards.py writes and reads)
and a LoaderSpec, plus its own knobs. A loader's module declares `POLICIES`, the augment.auto_augment values it can
do per image (none but "none" where it declares nothing). Adding a loader is one file in this folder and one entry
here.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from fastanchor.errors import ConfigError


@dataclass(frozen=True)
class LoaderEntry:
    name: str
    maker: str  # "module:function", the module by its full dotted name: function(source, spec, **knobs)
    description: str  # one line, in the benchmarks' results
    library: str  # what must be importable to make it (named where it is not)
    reads: str = "files"  # "files": an ImageFolder index; "beton": a .beton written from it; "wds": its tar shards
    decodes: str = "cpu"  # where JPEGs are decoded: "cpu" (worker processes or threads), "device" (the batches' device)
    #                       or "once" (the whole split once, on the CPU, cached: not per epoch)
    trains: bool = True  # data.loader may name it: it keeps the whole Loader protocol (spec.py)
    cuda_only: bool = False  # it runs on CUDA devices only
    backend_may_lack_device: bool = False  # a RuntimeError on making it: its library cannot run on this device
    policy_note: str = ""  # what a refused augment.auto_augment is told (default: the policies it offers)
    knobs: dict = field(default_factory=dict)  # keywords its maker always gets (beyond the spec and the caller's)
    reshards_mid_epoch: bool = False  # batch k of all processes together holds the same samples whatever their number

    def module(self):
        return importlib.import_module(self.maker.partition(":")[0])

    def make(self, source, spec, **knobs):
        device = str(getattr(spec.device, "type", spec.device)).partition(":")[0]
        if self.cuda_only and device != "cuda":
            raise ConfigError(f"data.loader = {self.name!r} decodes JPEGs on a CUDA device (nvJPEG); this run's device "
                              f"is {device}: use torchvision, ffcv or dali")
        return getattr(self.module(), self.maker.partition(":")[2])(source, spec, **{**self.knobs, **knobs})

    def policies(self) -> tuple[str, ...]:
        return getattr(self.module(), "POLICIES", ("none",))


HERE = "fastanchor.pipeline.loaders."
LOADERS: dict[str, LoaderEntry] = {entry.name: entry for entry in (
    LoaderEntry("torchvision", HERE + "torchvision:from_spec",
                "torch DataLoader over the ImageFolder, PIL decode in worker processes", "torchvision",
                reshards_mid_epoch=True),
    LoaderEntry("ffcv", HERE + "ffcv:from_spec", "FFCV Loader over a .beton (numba threads decode)", "FFCV",
                reads="beton", policy_note="FFCV's pipeline only crops and flips; use data.loader=torchvision or dali"),
    LoaderEntry("dali", HERE + "dali:DALILoader", "DALI readers.file + decoders.image (mixed on CUDA, CPU otherwise)",
                "DALI", decodes="device", backend_may_lack_device=True),
    LoaderEntry("webdataset", HERE + "wds:ShardLoader",
                "torch DataLoader over WebDataset tar shards (a folder or fsspec URL), PIL decode in worker processes",
                "webdataset", reads="wds"),
    LoaderEntry("dali-webdataset", HERE + "dali:DALILoader",
                "DALI readers.webdataset + decoders.image over tar shards (a URL's copied once to a local cache; mixed on CUDA)", "DALI",
                reads="wds", decodes="device", backend_may_lack_device=True),
    LoaderEntry("memory", HERE + "memory:MemoryLoader",
                "the split decoded once into one uint8 tensor on the device; crops and flips as batch ops there, "
                "policies per image", "torch",
                decodes="once"),
    LoaderEntry("nvjpeg", HERE + "nvjpeg:NvjpegLoader",
                "DataLoader workers read files; nvJPEG decode and crops 2 batches ahead on a thread and CUDA stream of "
                "their own", "TorchCodec or torchvision", decodes="device", cuda_only=True,
                policy_note="the nvJPEG loader only crops and flips; use data.loader=torchvision or dali",
                knobs={"pipelined": True}),
    LoaderEntry("nvjpeg-pinned", HERE + "nvjpeg:NvjpegLoader",
                "nvjpeg with each batch's files in page-locked memory (the DataLoader's pin_memory) before the decode",
                "TorchCodec or torchvision", decodes="device", trains=False, cuda_only=True,
                knobs={"pipelined": True, "pinned": True}),
    LoaderEntry("nvjpeg-per-image", HERE + "nvjpeg:NvjpegLoader",
                "DataLoader workers read files; nvJPEG decode, then crops per image between the steps",
                "TorchCodec or torchvision", decodes="device", trains=False, cuda_only=True),
)}


class TrainingLoaders(Sequence):
    """The names data.loader may take, read from LOADERS whenever asked (an entry added later is among them)."""

    def _names(self) -> list[str]:
        return [name for name, entry in LOADERS.items() if entry.trains]

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return repr(tuple(self._names()))


TRAINING_LOADERS = TrainingLoaders()


def entry(name: str) -> LoaderEntry:
    if name not in LOADERS:
        raise ConfigError(f"loader {name!r}: expected one of {', '.join(LOADERS)}")
    return LOADERS[name]


def reads_shards(name: str) -> bool:
    """Whether loader `name` (data.loader) reads WebDataset shard folders (a ShardSet) rather than image files."""
    return entry(name).reads == "wds"


def shard_loaders() -> str:
    """The data.loader values that read shard folders, as a reader is told them: "webdataset or dali-webdataset"."""
    return " or ".join(f"data.loader={name}" for name in TRAINING_LOADERS if LOADERS[name].reads == "wds")


def make(name: str, source, spec, **knobs):
    """The loader `name` (data.loader) over `source` with `spec` (a LoaderSpec); `knobs`: that loader's own keywords."""
    return entry(name).make(source, spec, **knobs)


def check_loader_supports(loader: str, policy: str) -> None:
    """Refuse, with one line, a per-image augmentation `policy` (augment.auto_augment) that `loader`
    (data.loader) cannot do."""
    found = entry(loader)
    offered = found.policies()
    if policy not in offered:
        raise ConfigError(f"augment.auto_augment = {policy!r} is not supported by data.loader = {loader!r}: "
                          f"{found.policy_note or 'expected one of ' + ', '.join(offered)}")
