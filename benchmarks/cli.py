"""`fastanchor bench WHAT`: the throughput benchmarks, the ImageNet-shaped dataset, the generated README/docs blocks.

Every option of a benchmark is a field of its dataclass in `benchmarks/options.py`; the flags and
their help are generated from those fields, so `--help` always lists them all with their meaning.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import shlex
import typing

from fastanchor.benchmarks import options as opts

BENCHMARKS = {
    # name: (options class, "module:function", help)
    "loader": (opts.LoaderOptions, "loaders:run_loader_benchmark",
               "images/s of FFCV, DALI, the torchvision DataLoader (and nvJPEG on CUDA) against the decode limit"),
    "op": (opts.OpOptions, "anchor_op:run_op_benchmark",
           "GB/s of the anchoring op (Triton, torch, numba) against a same-size copy, and its share of a step"),
    "step": (opts.StepOptions, "train_step:run_step_benchmark",
             "images/s of standard vs anchored training steps on synthetic on-device batches"),
    "e2e": (opts.EndToEndOptions, "end_to_end:run_end_to_end_benchmark",
            "loader + op + step, standard vs anchored vs the naive second-loader design"),
    "fidelity": (opts.FidelityOptions, "fidelity:run_fidelity_benchmark",
                 "accuracy, calibration, corruption and OOD metrics of the trainer's arms against a plain-torch control"),
}


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if hints[f.name] is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f.metadata["help"])
        elif hints[f.name] is list:  # repeatable, e.g. --set KEY=VALUE --set KEY=VALUE
            parser.add_argument(flag, dest=f.name, action="append", default=None, metavar="KEY=VALUE",
                                help=f.metadata["help"])
        else:
            shown = f.default if f.default != "" else "''"
            parser.add_argument(flag, dest=f.name, type=hints[f.name], default=f.default, metavar=f.name.upper(),
                                choices=f.metadata.get("choices"), help=f"{f.metadata['help']} (default: {shown})")


def options_from(cls: type, args: argparse.Namespace):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    return cls(**{name: value for name, value in values.items() if value is not None})  # None: an unrepeated list


def add_bench_parser(commands) -> None:
    bench = commands.add_parser("bench", help="throughput and fidelity benchmarks (result files under benchmarks/results/)",
                                description=__doc__.split("\n\n")[0])
    which = bench.add_subparsers(dest="bench", required=True, metavar="WHAT")
    for name, (cls, _, help_text) in BENCHMARKS.items():
        add_options(which.add_parser(name, help=help_text, description=help_text), cls)
    data = which.add_parser("data", help="write the ImageNet-shaped synthetic JPEG dataset (sizes and resolutions as ImageNet's)")
    add_options(data, opts.DataOptions)
    readme = which.add_parser("readme", help="rewrite the generated blocks (README.md's demo block, docs/benchmarks.md's "
                                             "performance block, docs/fidelity.md's fidelity block) from the result files")
    readme.add_argument("--results", default="benchmarks/results", help="directory of the result files (default: %(default)s)")
    readme.add_argument("--readme", default="README.md",
                        help="the README to rewrite, with the docs/*.md beside it (default: %(default)s)")


def run_bench(args: argparse.Namespace, argv: list[str]) -> int:
    command = "fastanchor " + shlex.join(argv)
    if args.bench in BENCHMARKS:
        cls, target, _ = BENCHMARKS[args.bench]
        module, function = target.split(":")
        run = getattr(importlib.import_module(f"fastanchor.benchmarks.{module}"), function)
        run(options_from(cls, args), command)
    elif args.bench == "data":
        from fastanchor.pipeline.imagenet_shaped import ImageNetShapedSpec, generate_imagenet_shaped

        options = options_from(opts.DataOptions, args)
        options.validate()
        spec = ImageNetShapedSpec(seed=options.seed, num_classes=options.num_classes,
                                  images_per_class=options.images_per_class, mean_bytes=options.mean_bytes,
                                  jpeg_quality=options.jpeg_quality)
        manifest = generate_imagenet_shaped(options.root, spec, progress=options.progress, workers=options.workers or None)
        achieved = manifest["achieved"]
        print(f"{manifest['num_images']} JPEGs in {spec.num_classes} classes under {options.root}/{manifest['split']}: "
              f"mean {achieved['bytes']['mean'] / 1000:.1f} KB, {achieved['width']['mean']:.0f} x "
              f"{achieved['height']['mean']:.0f} px (manifest.json has the spread)")
    elif args.bench == "readme":
        from fastanchor.benchmarks.readme import update_readme

        update_readme(args.readme, args.results)
        print(f"{args.readme} and docs/*.md: generated blocks rewritten from {args.results}")
    return 0
