"""SAM and SAM-only-norm on a real model and real JPEG batches: what is perturbed, exact restore, BatchNorm statistics."""

import copy

import pytest
import timm.layers
import torch
import torchvision
from torch import nn

from fastanchor.errors import ConfigError
from fastanchor.kernels.pseudo_ood import pseudo_ood
from fastanchor.pipeline.anchoring import AnchoringSpec, AnchoringStage
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.trainer.build import split_index, train_loader
from fastanchor.trainer.config import load_config
from fastanchor.trainer.finetune_ood import finetune_mode, perturbed_parameters, sft_loss
from fastanchor.trainer.models import create_model
from fastanchor.trainer.sam import ascend, normalization_parameters, running_stats_frozen, sam_step

RHO = 0.5


class OddlyNamed(nn.Module):
    """Normalisation layers under names that name matching would miss, and a Linear called `bn`."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3)
        self.downsample = nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8))
        self.ln_1 = nn.LayerNorm(8)
        self.gn = nn.GroupNorm(2, 8)
        self.act_norm = timm.layers.BatchNormAct2d(8)
        self.ln2d = timm.layers.LayerNorm2d(8)
        self.bn = nn.Linear(8, 8)
        self.frozen = nn.BatchNorm1d(8)
        self.frozen.requires_grad_(False)


def names(model, parameters):
    ids = {id(p) for p in parameters}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def test_normalisation_layers_are_found_by_type_not_name():
    model = OddlyNamed()
    assert names(model, normalization_parameters(model)) == {
        f"{layer}.{kind}" for layer in ("downsample.1", "ln_1", "gn", "act_norm", "ln2d") for kind in ("weight", "bias")}
    resnet = torchvision.models.resnet18(num_classes=4)
    found = names(resnet, normalization_parameters(resnet))
    bn_layers = [n for n, m in resnet.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert found == {f"{n}.{k}" for n in bn_layers for k in ("weight", "bias")}
    assert "layer2.0.downsample.1.weight" in found
    with pytest.raises(ConfigError, match="no trainable normalisation layer"):
        perturbed_parameters(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(2)), "sam_norm")


@pytest.fixture(scope="module")
def batches(tiny_dataset):
    """Real ID and pseudo-OOD batches through the anchoring stage (anchored, inference references)."""
    config = load_config(None, [f"data.root={tiny_dataset}", "data.workers=0", "data.batch_size=8"])
    loader = train_loader(config.data, split_index(config.data, "train"), torch.device("cpu"), seed=0)
    images, labels = next(iter(loader))
    stage = AnchoringStage(loader, AnchoringSpec(anchored=True, alpha=0.0), references=FixedReferenceSet(images[:4].clone()))
    ood = pseudo_ood(images, 2, torch.Generator().manual_seed(0))
    return stage.process(images, labels), stage.process(ood, labels)


def fresh_model():
    torch.manual_seed(0)
    model = create_model("fastanchor_resnet_tiny", 4, anchored=True)
    for module in model.modules():  # a trained-looking model: non-zero affine parameters everywhere
        if isinstance(module, nn.BatchNorm2d):
            nn.init.uniform_(module.weight, 0.5, 1.5)
            nn.init.uniform_(module.bias, -0.1, 0.1)
    return model


def weights_at_each_forward(model):
    """Snapshots of every parameter, taken as each forward pass starts."""
    snapshots = []
    model.register_forward_pre_hook(lambda *_: snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()}))
    return snapshots


def run_one_step(batches, optimizer_kind, lr=0.0, momentum=0.0, weight_decay=0.0, batchnorm="id_batches", at_descent=None):
    """One SAM step of a fresh model; `at_descent` (a list) receives the weights the descent step starts from."""
    model = fresh_model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    snapshots = weights_at_each_forward(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    if at_descent is not None:
        optimizer.register_step_pre_hook(lambda *_: at_descent.append({n: p.detach().clone() for n, p in model.named_parameters()}))
    perturbed = perturbed_parameters(model, optimizer_kind)
    with finetune_mode(model, batchnorm):
        sam_step(model, optimizer, sft_loss(model, *batches, 1.0), perturbed, RHO)
    return model, start, buffers, snapshots, names(model, perturbed)


def gradient_at(batches, start):
    """The SFT loss gradient at `start`, computed on a separate copy of the model."""
    model = fresh_model()
    model.load_state_dict(start, strict=False)
    with finetune_mode(model, "id_batches"):
        sft_loss(model, *batches, 1.0)()["loss"].backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_sam_norm_perturbs_only_normalisation_parameters_by_rho_along_the_gradient(batches):
    model, start, _, snapshots, norm_names = run_one_step(batches, "sam_norm")
    assert len(snapshots) == 4  # ID and pseudo-OOD at w, then both at w + e
    assert all(torch.equal(snapshots[1][n], snapshots[0][n]) for n in start)
    at_w, ascended = snapshots[0], snapshots[2]
    assert all(torch.equal(snapshots[3][n], ascended[n]) for n in start)
    perturbation = {n: ascended[n] - at_w[n] for n in start}
    for name in start:
        if name not in norm_names:
            assert torch.equal(ascended[name], at_w[name]), f"{name} is not a normalisation parameter but was perturbed"
    assert norm_names and all(perturbation[n].abs().max() > 0 for n in norm_names)
    total = torch.sqrt(sum((perturbation[n].double() ** 2).sum() for n in norm_names))
    assert total.item() == pytest.approx(RHO, rel=1e-5)
    gradient = gradient_at(batches, start)
    g_norm = torch.sqrt(sum((gradient[n].double() ** 2).sum() for n in norm_names))
    for name in norm_names:
        expected = RHO * gradient[name].double() / g_norm
        torch.testing.assert_close(perturbation[name].double(), expected, rtol=1e-4, atol=1e-6)
    # the step ran with a zero learning rate, so the descent changed nothing: what is left is the restored
    # weights, which must be the pre-ascent ones bit for bit
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, start[name]), f"{name} did not come back bit-exactly"


def test_ascend_and_restore_are_exact_on_their_own():
    parameters = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(2))]
    for p in parameters[:2]:
        p.grad = torch.randn_like(p) * 1e3
    before = [p.detach().clone() for p in parameters]
    ascent = ascend(parameters, 0.05)
    assert len(ascent.parameters) == 2  # the one without a gradient is not moved
    assert torch.equal(parameters[2], before[2]) and not torch.equal(parameters[0], before[0])
    ascent.restore()
    assert all(torch.equal(p, b) for p, b in zip(parameters, before))


def test_plain_sam_perturbs_everything_and_sgd_nothing(batches):
    model, start, _, snapshots, perturbed = run_one_step(batches, "sam")
    assert perturbed == set(start)
    assert all(not torch.equal(snapshots[2][n], snapshots[0][n]) for n in start)
    total = torch.sqrt(sum(((snapshots[2][n] - snapshots[0][n]).double() ** 2).sum() for n in start))
    assert total.item() == pytest.approx(RHO, rel=1e-5)
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())  # restored exactly (zero lr)
    _, _, _, snapshots, perturbed = run_one_step(batches, "sgd")
    assert perturbed == set() and len(snapshots) == 2  # one pass: ID and pseudo-OOD at w


def test_descent_updates_every_parameter_and_running_stats_move_once_with_the_id_batch_at_w(batches):
    id_batch, _ = batches
    at_descent = []
    model, start, buffers, snapshots, _ = run_one_step(batches, "sam_norm", lr=1e-3, momentum=0.9, weight_decay=1e-5,
                                                       at_descent=at_descent)
    assert len(at_descent) == 1 and any(not torch.equal(snapshots[2][n], start[n]) for n in start)  # it did ascend
    assert all(torch.equal(at_descent[0][n], start[n]) for n in start), "the descent must start from the pre-ascent weights"
    assert [n for n, p in model.named_parameters() if torch.equal(p, start[n])] == []
    # reference: one training-mode forward of the ID batch alone, at the same starting weights
    reference = fresh_model().train()
    reference(id_batch.inputs)
    for name, buffer in model.named_buffers():
        if name.endswith("num_batches_tracked"):
            assert buffer.item() == buffers[name].item() + 1, name
        else:
            assert torch.equal(buffer, dict(reference.named_buffers())[name]), f"{name} moved in another pass"


def test_frozen_batchnorm_never_moves_running_stats(batches):
    model, _, buffers, *_ = run_one_step(batches, "sam_norm", lr=1e-3, batchnorm="frozen")
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    model = fresh_model()
    with finetune_mode(model, "frozen"):
        assert model.training and all(not m.training for m in model.modules() if isinstance(m, nn.BatchNorm2d))


def test_running_stats_frozen_keeps_batch_statistics_and_restores_the_flag():
    layer = nn.BatchNorm2d(3).train()
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    layer.double()
    before = copy.deepcopy(layer.state_dict())
    with running_stats_frozen(layer):
        with running_stats_frozen(layer):  # nesting is harmless
            y = layer(x)
    assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())
    mean, var = x.mean((0, 2, 3), keepdim=True), x.var((0, 2, 3), unbiased=False, keepdim=True)
    torch.testing.assert_close(y, (x - mean) / torch.sqrt(var + layer.eps))  # normalised with the batch's statistics
    assert layer.track_running_stats
    with pytest.raises(RuntimeError), running_stats_frozen(layer):
        raise RuntimeError("boom")
    assert layer.track_running_stats
