"""`fastanchor bench WHAT`: the throughput benchmarks and the ImageNet-shaped dataset they read.

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
    "data": (opts.DataOptions, "cli:run_data",
             "write the ImageNet-shaped synthetic JPEG dataset (sizes and resolutions as ImageNet's)"),
    "first-layer": (opts.FirstLayerOptions, "first_layer:run_first_layer",
                    "ms of the first layer alone with 3, 6 and 6 + 2 zero input channels, cuDNN autotuning off and on"),
    "op-sass": (opts.OpSassOptions, "op_sass:run_op_sass",
                "SASS instruction counts of the op's Triton kernel variants compiled for sm_90 (no GPU needed)"),
    "soak": (opts.SoakOptions, "soak:run_soak",
             "resident memory over thousands of training steps through each loader: MiB per 1000 steps"),
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
