"""`fastanchor bench WHAT`: the throughput benchmarks, the ImageNet-shaped dataset, the generated README/docs blocks.

Every option of a benchmark is a field of its dataclass in `benchmarks/options.py`; the CLI (cli/__init__.py)
generates the flags and their help from those fields (options/flags.py), so `--help` always lists them all
with their meaning. Each entry is run as `function(options, command)`, `command` being the command line as
typed (the result files record it).
"""

from __future__ import annotations

from fastanchor.benchmarks import options as opts

BENCHMARKS = {
    # name: (options class, "module:function" under fastanchor.benchmarks, help)
    "loader": (opts.LoaderOptions, "loaders:run_loader_benchmark",
               "images/s of FFCV, DALI, the torchvision DataLoader (and nvJPEG on CUDA) against the decode limit"),
    "op": (opts.OpOptions, "anchor_op:run_op_benchmark",
           "GB/s of the anchoring op (Triton, torch, numba) against a same-size copy, and its share of a step"),
    "step": (opts.StepOptions, "train_step:run_step_benchmark",
             "images/s of standard vs anchored training steps on synthetic on-device batches"),
    "e2e": (opts.EndToEndOptions, "end_to_end:run_end_to_end_benchmark",
            "loader + op + step, standard vs anchored vs the naive second-loader design"),
    "fidelity": (opts.FidelityOptions, "fidelity:run_fidelity_benchmark",
                 "accuracy, calibration, corruption and OOD metrics of the trainer's arms vs a plain-torch control"),
    "data": (opts.DataOptions, "cli:run_data",
             "write the ImageNet-shaped synthetic JPEG dataset (sizes and resolutions as ImageNet's)"),
    "readme": (opts.ReadmeOptions, "cli:run_readme",
               "rewrite the generated blocks of README.md and docs/*.md from the result files"),
}


def run_data(options: opts.DataOptions, command: str) -> None:
    from fastanchor.pipeline.datasets.imagenet_shaped import ImageNetShapedSpec, generate_imagenet_shaped

    options.validate()
    spec = ImageNetShapedSpec(seed=options.seed, num_classes=options.num_classes,
                              images_per_class=options.images_per_class, mean_bytes=options.mean_bytes,
                              jpeg_quality=options.jpeg_quality)
    manifest = generate_imagenet_shaped(options.root, spec, progress=options.progress, workers=options.workers or None)
    achieved = manifest["achieved"]
    print(f"{manifest['num_images']} JPEGs in {spec.num_classes} classes under {options.root}/{manifest['split']}: "
          f"mean {achieved['bytes']['mean'] / 1000:.1f} KB, {achieved['width']['mean']:.0f} x "
          f"{achieved['height']['mean']:.0f} px (manifest.json has the spread)")


def run_readme(options: opts.ReadmeOptions, command: str) -> None:
    from fastanchor.benchmarks.readme import update_readme

    update_readme(options.readme, options.results)
    print(f"{options.readme} and docs/*.md: generated blocks rewritten from {options.results}")
