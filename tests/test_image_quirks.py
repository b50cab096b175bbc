"""ImageNet's own files through every loader that reads image files or their shards: a PNG named .JPEG (ImageNet-1k's
n02105855_2933.JPEG) and CMYK JPEGs (22 in ImageNet-1k's train split) give PIL's `convert("RGB")` pixels, bit for bit,
through the torchvision, DALI (CPU), webdataset and dali-webdataset loaders; each kind is counted (the index, the
shard manifest) and named in one line per tree or shard folder, once however often they are read."""

import numpy as np
import pytest
import torch
from PIL import Image

from fastanchor.pipeline.datasets.imagefolder import checked_header, scan_image_folder
from fastanchor.pipeline.datasets.shards import read_shard_set, write_shards
from fastanchor.pipeline.loaders import registry
from fastanchor.pipeline.loaders.spec import LoaderSpec

SIZE = 40  # every image is SIZE x SIZE: evaluation at crop ratio 1 neither resizes nor crops, so pixels compare exactly


@pytest.fixture
def quirks(tmp_path):
    """A tree of 2 classes: plain RGB JPEGs, CMYK JPEGs (one behind a 200 kB ICC profile, so its frame header is
    found past the first read), a grayscale JPEG and a PNG named .JPEG."""
    rng = np.random.default_rng(0)
    images = [Image.fromarray((rng.random((10, 10, 3)) * 255).astype(np.uint8)).resize((SIZE, SIZE)) for _ in range(6)]
    for name in ("a", "b"):
        (tmp_path / "tree" / name).mkdir(parents=True)
    images[0].save(tmp_path / "tree" / "a" / "plain.JPEG", quality=90)
    images[1].convert("CMYK").save(tmp_path / "tree" / "a" / "cmyk.JPEG", quality=90)
    images[2].convert("CMYK").save(tmp_path / "tree" / "b" / "cmyk_icc.JPEG", quality=90, icc_profile=bytes(200_000))
    images[3].convert("L").save(tmp_path / "tree" / "b" / "gray.JPEG", quality=90)
    images[4].save(tmp_path / "tree" / "b" / "n02105855_2933.JPEG", format="PNG")
    images[5].save(tmp_path / "tree" / "b" / "plain.JPEG", quality=90)
    return tmp_path / "tree"


def spec(**changes) -> LoaderSpec:
    return LoaderSpec(**{"batch_size": 4, "train": False, "image_size": SIZE, "workers": 0, "device": "cpu",
                         "drop_last": False, "crop_ratio": 1.0, **changes})


def pil_pixels(path) -> torch.Tensor:
    with Image.open(path) as image:
        assert image.mode in ("RGB", "CMYK", "L")
        return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)


def batches_of(loader) -> tuple[torch.Tensor, torch.Tensor]:
    batches = list(loader)
    return torch.cat([images for images, _ in batches]), torch.cat([labels for _, labels in batches])


def test_the_frame_header_says_which_jpegs_are_cmyk(quirks):
    found = {path.name: checked_header(path) for path in sorted(quirks.rglob("*.JPEG"))}
    assert found == {"plain.JPEG": (".jpeg", 3), "cmyk.JPEG": (".jpeg", 4), "cmyk_icc.JPEG": (".jpeg", 4),
                     "gray.JPEG": (".jpeg", 1), "n02105855_2933.JPEG": (".png", None)}


def loader(name: str, source):
    if name.startswith("dali"):
        pytest.importorskip("nvidia.dali", reason="NVIDIA DALI (the 'dali' extra) is not installed")
    return registry.make(name, source, spec())


def test_the_scan_counts_and_names_each_kind_once_per_tree(quirks, capsys):
    index = scan_image_folder(quirks)
    scan_image_folder(quirks)  # again: not reported twice
    assert index.cmyk == (str(quirks / "a" / "cmyk.JPEG"), str(quirks / "b" / "cmyk_icc.JPEG"))
    assert index.mislabelled == (str(quirks / "b" / "n02105855_2933.JPEG"),)
    assert capsys.readouterr().err.splitlines() == [
        f"{quirks}: 1 image file(s) hold another format than their name says (e.g. "
        f"'{quirks / 'b' / 'n02105855_2933.JPEG'}' is PNG data): decoded by their content",
        f"{quirks}: 2 CMYK JPEG(s) (e.g. '{quirks / 'a' / 'cmyk.JPEG'}'): converted to RGB as PIL converts them"]


@pytest.mark.parametrize("name", ["torchvision", "dali"])
def test_the_image_file_loaders_give_pils_pixels(quirks, name):
    """Bit for bit: DALI's CPU decoder converts CMYK (Adobe's inverted, as PIL writes and ImageNet holds) as PIL does."""
    index = scan_image_folder(quirks)
    images, labels = batches_of(loader(name, index))
    assert labels.tolist() == [label for _, label in index.samples]
    assert torch.equal(images, torch.stack([pil_pixels(path) for path, _ in index.samples]))


def test_a_shard_manifest_counts_the_cmyk_jpegs_and_names_them_once(quirks, tmp_path, capsys):
    index = scan_image_folder(quirks)
    folder = tmp_path / "wds"
    write_shards(index, folder, shard_size=4, shuffle_seed=None, progress=False)
    capsys.readouterr()
    shards = read_shard_set(folder)
    read_shard_set(folder)
    assert shards.cmyk == (0, 2)  # the keys of a/cmyk.JPEG and b/cmyk_icc.JPEG, written in the index's order
    assert capsys.readouterr().err.splitlines() == [
        f"{folder}: 2 CMYK JPEG(s) (e.g. '000000000 of '{folder / 'shard-000000.tar'}''): converted to RGB as PIL "
        f"converts them"]


@pytest.mark.parametrize("name", ["webdataset", "dali-webdataset"])
def test_the_shard_loaders_give_pils_pixels(quirks, tmp_path, name):
    index = scan_image_folder(quirks)
    write_shards(index, tmp_path / "wds", shard_size=4, shuffle_seed=None, progress=False)
    images, labels = batches_of(loader(name, read_shard_set(tmp_path / "wds")))
    assert labels.tolist() == [label for _, label in index.samples]
    assert torch.equal(images, torch.stack([pil_pixels(path) for path, _ in index.samples]))


def test_dalis_training_crops_of_cmyk_jpegs_are_those_of_pils_pixels(tmp_path):
    """DALI's training path decodes only each crop's region (`decoders.image_random_crop`): over CMYK JPEGs it gives
    the batches it gives over lossless PNGs of PIL's conversions of them, crops and flips drawn alike."""
    pytest.importorskip("nvidia.dali", reason="NVIDIA DALI (the 'dali' extra) is not installed")
    rng = np.random.default_rng(1)
    for i in range(8):
        for tree in ("cmyk", "converted"):
            (tmp_path / tree / "a").mkdir(parents=True, exist_ok=True)
        image = Image.fromarray((rng.random((12, 12, 3)) * 255).astype(np.uint8)).resize((64, 48))
        image.convert("CMYK").save(tmp_path / "cmyk" / "a" / f"{i}.jpg", quality=90)
        with Image.open(tmp_path / "cmyk" / "a" / f"{i}.jpg") as written:
            written.convert("RGB").save(tmp_path / "converted" / "a" / f"{i}.png")
    train = spec(train=True, image_size=24, seed=1)
    images, _ = batches_of(registry.make("dali", scan_image_folder(tmp_path / "cmyk"), train))
    expected, _ = batches_of(registry.make("dali", scan_image_folder(tmp_path / "converted"), train))
    assert torch.equal(images, expected) and images.float().std() > 10  # real pixels, not a black frame
