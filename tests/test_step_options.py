"""The step's options (issue 37): the first layer padded with zero channels (model.stem_channels), the anchoring op
chosen by name (anchor.kernel), cuDNN autotuning (train.cudnn_benchmark) and the whole step under torch.compile
(train.compile = step: one graph with fullgraph=True, the SGD update inside it; step-cudagraphs refused on the CPU).
Real models, real training through the CLI, an eager step as the reference."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import run_main, tiny_overrides
from fastanchor.errors import ConfigError
from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255, anchor, anchor_torch, check_kernel
from fastanchor.kernels.anchor_triton import VARIANTS
from fastanchor.trainer.build import build_model, load_for_inference, make_optimizer, make_stage, make_step
from fastanchor.trainer.config import ANCHOR_KERNELS, load_config
from fastanchor.trainer.models import create_model, find_first_layer
from fastanchor.trainer.step import CompiledTrainStep

CPU = torch.device("cpu")


class ConvInputs(TorchFunctionMode):
    """The input channels of every convolution run under it, in order."""

    def __init__(self):
        super().__init__()
        self.channels = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.conv2d:
            self.channels.append((args[0].shape[1], args[1].shape[1]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("anchored, channels", [(True, 6), (False, 3)])
def test_a_padded_stem_convolves_eight_channels_and_computes_the_unpadded_function(anchored, channels):
    torch.manual_seed(0)
    plain = create_model("fastanchor_resnet_tiny", 5, anchored=anchored).eval()
    padded = create_model("fastanchor_resnet_tiny", 5, anchored=anchored, stem_channels=8).eval()
    assert {k: v.shape for k, v in padded.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    padded.load_state_dict(plain.state_dict())  # the same checkpoint, both ways
    x = torch.randn(3, channels, 32, 32).contiguous(memory_format=torch.channels_last)
    with torch.no_grad(), ConvInputs() as seen:
        out = padded(x)
    assert seen.channels[0] == (8, 8)  # the first convolution: input and weight padded inside the layer
    with torch.no_grad():
        assert torch.equal(out, plain(x))  # the zero channels add exactly nothing
    padded.train()
    padded(x).sum().backward()
    assert find_first_layer(padded)[1].weight.grad.shape[1] == channels  # the gradient is the layer's own weight's


def test_a_stem_narrower_than_the_input_is_refused():
    with pytest.raises(ConfigError, match="model.stem_channels = 4: an anchored first layer reads 6 channels"):
        load_config(None, ["model.stem_channels=4"])
    with pytest.raises(ConfigError, match=r"model.stem_channels = 100: expected 0 \(no padding\) or 3 to 64"):
        load_config(None, ["model.stem_channels=100"])
    assert load_config(None, ["model.stem_channels=4", "anchor.enabled=false"]).model.stem_channels == 4


@pytest.mark.parametrize("anchored", [True, False])
def test_a_padded_runs_checkpoint_evaluates_as_the_unpadded_model(tiny_dataset, tmp_path, anchored):
    """Trained through the CLI with model.stem_channels=8, the checkpoint holds the unpadded layer's weight, and
    rebuilt with and without the padding it gives the same logits, bit for bit."""
    run = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{
        "train.run_name": "padded", "model.stem_channels": 8, "anchor.enabled": str(anchored).lower(),
        "train.max_steps": 0}))
    assert run.returncode == 0, run.stderr
    checkpoint = tmp_path / "padded" / "final.pt"
    state = torch.load(checkpoint, weights_only=True)
    assert state["config"]["model"]["stem_channels"] == 8
    padded, config, _ = load_for_inference(checkpoint, CPU)
    assert state["model"][find_first_layer(padded)[0] + ".weight"].shape[1] == (6 if anchored else 3)
    plain, _, _ = load_for_inference(checkpoint, CPU, ["model.stem_channels=0"])
    assert config.model.stem_channels == 8
    x = torch.randn(4, 6 if anchored else 3, 32, 32).contiguous(memory_format=torch.channels_last)
    with torch.no_grad(), ConvInputs() as seen:
        logits = padded(x)
    assert seen.channels[0] == (8, 8)
    with torch.no_grad():
        assert torch.equal(logits, plain(x))


def test_the_kernel_names_are_the_ops_implementations():
    assert ANCHOR_KERNELS[0] == "auto"
    assert {k.partition(":")[2] for k in ANCHOR_KERNELS if k.startswith("triton:")} == set(VARIANTS)
    for kernel in ANCHOR_KERNELS:  # each is refused or accepted here with a reason, none unknown
        try:
            check_kernel(kernel, CPU, torch.float32)
        except ValueError as error:
            assert "needs triton and a CUDA device" in str(error), error
    with pytest.raises(ValueError, match="writes float32 on the CPU"):
        check_kernel("numba", CPU, torch.bfloat16)


def test_a_kernel_chosen_by_name_runs_and_one_that_cannot_run_here_is_one_line(tiny_dataset, tmp_path, monkeypatch):
    config = load_config(None, ["anchor.kernel=torch", "train.amp=off"])
    stage = make_stage(config, (), CPU)
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8, generator=generator)
    labels = torch.zeros(4, dtype=torch.long)
    calls = []
    monkeypatch.setattr("fastanchor.kernels.anchor_torch", lambda *a, **k: calls.append(1) or anchor_torch(*a, **k))
    batch = stage.process(images, labels)
    assert calls == [1]  # the torch path, not numba (which auto picks for float32 on the CPU)
    drawn = stage.draw(images, labels)
    expected = anchor_torch(drawn.images, drawn.pool, drawn.masked, IMAGENET_MEAN_255, IMAGENET_STD_255,
                            reference_index=drawn.index)
    assert torch.equal(stage.assemble(drawn).inputs, expected) and batch.inputs.shape == (4, 6, 16, 16)
    assert torch.allclose(anchor(drawn.images, drawn.pool, drawn.masked, IMAGENET_MEAN_255, IMAGENET_STD_255,
                                 reference_index=drawn.index, kernel="numba"), expected, atol=1e-5)
    if torch.cuda.is_available():
        return
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    outcome = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{"anchor.kernel": "triton:cl"}))
    assert outcome.returncode != 0
    assert outcome.stderr.strip().splitlines()[-1].endswith(
        "anchor.kernel = 'triton:cl': kernel 'triton:cl' needs triton and a CUDA device (here: cpu); use auto or torch")
    assert not list(tmp_path.glob("*/checkpoints/*.pt"))


def test_cudnn_autotuning_is_the_runs_alone_and_not_with_determinism(tiny_dataset, tmp_path):
    before = torch.backends.cudnn.benchmark
    run = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{"train.cudnn_benchmark": "true",
                                                                       "train.run_name": "tuned", "train.max_steps": 1}))
    assert run.returncode == 0, run.stderr
    assert torch.backends.cudnn.benchmark == before
    with pytest.raises(ConfigError, match="train.cudnn_benchmark = true with train.deterministic = true"):
        load_config(None, ["train.cudnn_benchmark=true", "train.deterministic=true"])


@pytest.mark.parametrize("setting, expected", [
    ("optim.name=adamw", "train.compile = 'step' updates with SGD inside the graph: optim.name = 'adamw' expected sgd"),
    ("train.amp=fp16", "train.compile = 'step' takes train.amp bf16 or off"),
    ("augment.mixup_alpha=0.2", "train.compile = 'step' takes no Mixup/CutMix"),
    ("train.nonfinite=skip", "train.compile = 'step' takes train.nonfinite = stop"),
    ("train.compile=true", "config key 'train.compile' expects str, got True"),
])
def test_what_a_compiled_step_cannot_do_is_refused_in_one_line(setting, expected):
    with pytest.raises(ConfigError) as error:
        load_config(None, ["train.compile=step", setting])
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_cuda_graphs_on_the_cpu_are_one_line(tiny_dataset, tmp_path):
    outcome = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{"train.compile": "step-cudagraphs",
                                                                              "optim.name": "sgd"}))
    assert outcome.returncode != 0
    assert "train.compile = 'step-cudagraphs' needs a CUDA device (here: cpu)" in outcome.stderr.strip().splitlines()[-1]
    with pytest.raises(ConfigError, match="train.compile = 'step-cudagraphs' replays inductor's code as CUDA graphs: "
                                          "train.compile_backend = 'eager' expected inductor"):
        load_config(None, ["train.compile=step-cudagraphs", "train.compile_backend=eager", "optim.name=sgd"])


def compiled_and_eager(model: str, size: int, *settings: str):
    """The same model, optimiser and stage built twice from one config, once with train.compile = step."""
    built = []
    for compile in ("off", "step"):
        config = load_config(None, [f"model.name={model}", f"data.image_size={size}", "data.batch_size=4",
                                    f"train.compile={compile}", "train.amp=off", *settings])
        torch.manual_seed(0)
        network = build_model(config, 5, CPU).train()
        optimizer = make_optimizer(network, config)
        built.append((make_step(config, network, optimizer, CPU), make_stage(config, (), CPU), network, optimizer))
    return built


def batches(count: int, size: int):
    generator = torch.Generator().manual_seed(1)
    for _ in range(count):
        yield (torch.randint(0, 256, (4, 3, size, size), dtype=torch.uint8, generator=generator)
               .contiguous(memory_format=torch.channels_last), torch.randint(0, 5, (4,), generator=generator))


@pytest.mark.slow  # compiling a whole training step, forward and backward, on the CPU: about a minute here
def test_the_whole_step_compiles_as_one_graph_and_trains_as_the_eager_step():
    """The demo model, anchored, with masked batches (BatchNorm keeps them out of its statistics), Nesterov SGD with
    weight decay, gradient clipping and an EMA copy: fullgraph=True (a graph break would raise), the losses, weights,
    statistics, EMA and the optimiser's state (what a checkpoint saves) those of the eager step."""
    (eager, eager_stage, eager_model, eager_optimizer), (compiled, stage, model, optimizer) = compiled_and_eager(
        "fastanchor_resnet_tiny", 32, "anchor.alpha=0.5", "train.seed=1", "optim.grad_clip=1.0", "optim.ema_decay=0.9",
        "train.compile_backend=aot_eager")  # the same one graph, forward and backward traced, no code generated
    assert isinstance(compiled, CompiledTrainStep) and not isinstance(eager, CompiledTrainStep)
    masked = []
    for images, labels in batches(3, 32):
        expected, eager_batch = eager.on(eager_stage, images, labels)
        loss, batch = compiled.on(stage, images, labels)
        assert torch.equal(batch.masked, eager_batch.masked) and batch.input_shape == eager_batch.input_shape
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
        masked.append(bool(batch.masked[0]))
    assert any(masked) and not all(masked), f"seed 1 must give masked and unmasked batches, got {masked}"
    for mine, theirs in [(model.parameters(), eager_model.parameters()), (model.buffers(), eager_model.buffers()),
                         (compiled.ema.parameters(), eager.ema.parameters())]:
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    state, eager_state = optimizer.state_dict(), eager_optimizer.state_dict()
    assert state["param_groups"] == eager_state["param_groups"] and state["state"].keys() == eager_state["state"].keys()
    for key in state["state"]:
        torch.testing.assert_close(state["state"][key]["momentum_buffer"], eager_state["state"][key]["momentum_buffer"],
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # tracing ResNet-50's step: about a minute on the 2-core machine
def test_resnet50s_whole_step_traces_as_one_graph():
    """ResNet-50 at a tiny size: torch.compile with fullgraph=True takes the whole step (Dynamo's trace, run as it
    traced it), and one step gives the eager step's loss and weights."""
    (eager, eager_stage, eager_model, _), (compiled, stage, model, _) = compiled_and_eager(
        "resnet50", 32, "train.compile_backend=eager")
    images, labels = next(batches(1, 32))
    expected, _ = eager.on(eager_stage, images, labels)
    loss, _ = compiled.on(stage, images, labels)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.fc.weight, eager_model.fc.weight, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # AOT autograd traces the step's forward and backward: half a minute less than inductor's C++
def test_a_compiled_step_trains_through_the_cli_and_records_its_settings(tiny_dataset, tmp_path):
    """train.compile=step (aot_eager: the whole step traced and functionalised as inductor takes it, without the C++
    code generation that a GPU replaces with Triton's; docs/compile.md's example runs inductor) for 2 steps of the
    demo recipe (its smallest model, the plain 5-conv net), with the padded stem and the op by name: the run's config
    records every setting, and a benchmark result records them at its top; the LR scheduler knows the compiled update
    stepped the optimizer."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=re.escape("Detected call of `lr_scheduler.step()` before"))
        run = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{
            "train.run_name": "compiled", "train.compile": "step", "train.compile_backend": "aot_eager",
            "train.max_steps": 2, "train.log_interval": 1,
            "model.name": "fastanchor_convnet5", "model.stem_channels": 8, "anchor.kernel": "torch", "optim.name": "sgd"}))
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in (tmp_path / "compiled" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if "loss" in r]) == 2 and all(torch.isfinite(torch.tensor(r["loss"]))
                                                                 for r in records if "loss" in r)
    written = (tmp_path / "compiled" / "config.yaml").read_text()
    assert "compile: step" in written and "stem_channels: 8" in written and "kernel: torch" in written


@pytest.mark.slow  # Dynamo traces the demo model's whole step: over 5 s here
def test_with_cuda_graphs_the_steps_mutated_inputs_have_fixed_addresses():
    """Inductor captures a graph as CUDA graphs only when every input the graph updates in place is static (parameters,
    or marked so): the momentum buffers SGD updates inside the step, and the rates, are marked. Traced here on the CPU
    with a backend that records what the graph is given; the window's step-cudagraphs stage shows the capture."""
    (_, _, _, _), (compiled, stage, _, optimizer) = compiled_and_eager("fastanchor_resnet_tiny", 32, "train.amp=off")
    given = []

    def recorder(graph, example_inputs):
        given.extend(example_inputs)
        return graph.forward

    compiled.cudagraphs = True  # what train.compile = step-cudagraphs builds, which the config refuses on the CPU
    compiled.compiled = torch.compile(compiled._fused, fullgraph=True, backend=recorder)
    compiled.on(stage, *next(batches(1, 32)))
    static = {t.data_ptr() for t in given if getattr(t, "_dynamo_static_input_type", None)}
    buffers = [optimizer.state[p]["momentum_buffer"] for g in optimizer.param_groups for p in g["params"]]
    assert buffers and all(b.data_ptr() in static for b in buffers + compiled.lrs)
