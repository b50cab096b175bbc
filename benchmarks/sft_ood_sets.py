"""Two OOD sets made from validation images, for measuring SFT beside the shapes and the textures.

    python -m fastanchor.benchmarks.sft_ood_sets DATA_ROOT OUT [--split val] [--images 300] [--size 32] [--seed 0]

writes pipeline/shifts/pseudo_ood_sets.py's two ImageFolders under OUT (one class folder each, lossless PNG):
OUT/pseudo_ood/ (the project's pseudo-OOD generator: what SFT trains on) and OUT/jigsaw4/ (a 4 x 4 jigsaw, a grid
SFT never trains on). Evaluate them with `--set "eval.ood_sets=[pseudo_ood=OUT/pseudo_ood,jigsaw4=OUT/jigsaw4]"`.
OUT must not exist; it holds both sets or nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fastanchor.pipeline.shifts.pseudo_ood_sets import SETS, make_sets, validation_images, write_sets  # noqa: F401


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_root", type=Path, help="dataset root holding the validation split folder")
    parser.add_argument("out", type=Path, help="where the two set folders are written")
    parser.add_argument("--split", default="val", help="validation split folder under DATA_ROOT (default: val)")
    parser.add_argument("--images", type=int, default=300, help="images per set (default: 300)")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels (default: 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the subset and the shuffles (default: 0)")
    args = parser.parse_args(argv)
    for folder in write_sets(args.data_root, args.out, args.split, args.images, args.size, args.seed):
        print(folder)


if __name__ == "__main__":
    main()
