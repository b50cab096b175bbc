"""What the op's Triton kernel variants compile to on a GPU, counted without one.

`fastanchor bench op-sass [--variants V,W]` compiles each variant (kernels/anchor_triton.py
VARIANTS) for an sm_90 GPU (H100/H200) at the op benchmark's setting (batch 256, 176 px, bf16,
channels-last, in-batch references), through a stub driver, so it runs on a CPU-only machine with
triton's bundled ptxas and cuobjdump, and prints per variant its SASS instruction counts: global
loads and stores by width, registers, local-memory spills, shared memory and barriers, divisions
(MUFU.RCP, FCHK) and int -> float conversions. docs/notes/anchor_op_gpu.md reads these numbers. The counts are
static (every instruction once, slow paths included) and depend on the triton version installed.
"""

from __future__ import annotations

import collections
import importlib
import os
import re
import subprocess
import tempfile

import torch

from fastanchor.benchmarks.options import OpSassOptions, names_list
from fastanchor.errors import ConfigError


def compiled_variant(variant: str, batch: int = 256, size: int = 176, dtype: torch.dtype = torch.bfloat16):
    """The triton CompiledKernel `anchor_triton` would launch for `variant` (compiled, never launched)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class StubDriver:  # what JITFunction.warmup asks of a driver; no GPU needed to compile
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    module = importlib.import_module("fastanchor.kernels.anchor_triton")
    from fastanchor.kernels.anchor_torch import IMAGENET_MEAN_255, IMAGENET_STD_255

    images = torch.zeros(batch, 3, size, size, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    out = torch.empty(batch, 6, size, size, dtype=dtype).contiguous(memory_format=torch.channels_last)
    compiled = {}

    class Warmup:  # stands in for `kernel[grid](...)`: compiles for the stub target instead of launching
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def compile_only(*args, **kwargs):
                compiled["kernel"], compiled["grid"] = self.kernel.warmup(*args, grid=grid, **kwargs), grid
            return compile_only

    original_kernel = module._kernel
    driver.set_active(StubDriver())
    module._kernel = lambda *args: Warmup(original_kernel(*args))
    try:
        module.anchor_triton(images, images, torch.zeros(batch, dtype=torch.bool), IMAGENET_MEAN_255, IMAGENET_STD_255,
                             dtype, reference_index=torch.arange(batch).roll(1), out=out, variant=variant)
    finally:
        module._kernel = original_kernel
        if torch.cuda.is_available():  # without a GPU there is no real driver to go back to
            driver.reset_active()
    return compiled["kernel"], compiled["grid"], triton.tools.disasm.get_sass(compiled["kernel"].asm["cubin"])


def resource_usage(kernel) -> dict:
    """Registers per thread and stack (local memory) bytes per thread of a compiled kernel, by cuobjdump."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        text = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", text))
    return {"registers": int(found["REG"]), "stack bytes": int(found["STACK"])}


def sass_counts(sass: str) -> collections.Counter:
    counts = collections.Counter()
    for line in sass.splitlines():
        match = re.match(r"\S+\t(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if match:
            counts[match.group(2)] += 1
    return counts


def summary(counts: collections.Counter) -> dict:
    def total(*prefixes):
        return sum(n for name, n in counts.items() if name.startswith(prefixes))

    return {"instructions": sum(counts.values()),
            "loads": {k: n for k, n in sorted(counts.items()) if k.startswith("LDG")},
            "stores": {k: n for k, n in sorted(counts.items()) if k.startswith("STG")},
            "spills (LDL/STL)": total("LDL", "STL"), "shared (LDS/STS)": total("LDS", "STS"), "barriers": total("BAR"),
            "MUFU.RCP": counts["MUFU.RCP"], "FCHK": counts["FCHK"], "I2F": total("I2F")}


def run_op_sass(options: OpSassOptions, command: str) -> None:
    try:
        import triton  # noqa: F401 - its bundled ptxas and cuobjdump compile and read the kernels
    except ImportError as error:
        raise ConfigError(f"bench op-sass compiles with triton's bundled CUDA toolchain: triton is not importable "
                          f"here ({error})") from None
    interpret = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret; restored after (the command also runs in tests)
    try:
        module = importlib.import_module("fastanchor.kernels.anchor_triton")
        unknown = [v for v in names_list(options.variants) if v not in module.VARIANTS]
        if unknown:
            raise ConfigError(f"--variants: {unknown[0]!r} is not a variant of kernels/anchor_triton.py: expected names "
                              f"from {', '.join(module.VARIANTS)}")
        for variant in names_list(options.variants) or [v for v in module.VARIANTS if v != "auto"]:
            kernel, grid, sass = compiled_variant(variant)
            print(f"{variant}: grid {grid}, {kernel.metadata.num_warps} warps, {kernel.metadata.shared} B shared memory, "
                  f"per thread: {resource_usage(kernel)}, {summary(sass_counts(sass))}")

    finally:
        if interpret is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = interpret