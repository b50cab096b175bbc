"""Linear probes on a frozen backbone: standard, and anchored as in the paper (section 4.2,
"Robustness to Task Adaptation": the probe of an anchored backbone is trained with anchored
training, alpha = 0.4).

- Features: timm models give ``forward_head(forward_features(x), pre_logits=True)`` (the pooled,
  pre-classifier vector); torchvision models the input of their last Linear layer.
- Standard probe (standard backbone): multinomial logistic regression on the features of x.
- Anchored probe (anchored backbone): the backbone sees ``[r, x - r]`` with r drawn from the
  probe's reference pool (the checkpoint's inference reference set when the probe trains on the
  checkpoint's own training split, else a sample of the probe's training images); with probability
  alpha the reference is masked (``[0, x - r]``) and
  the target is uniform. With the backbone frozen, features are computed once for `views`
  reference draws per training image (each unmasked and masked), and the probe minimises the
  expectation of the anchored loss over those draws and the masking coin exactly:
  ``(1 - alpha) * CE(W f(r, x - r), y) + alpha * CE(W f(0, x - r), uniform)``, averaged over views.
  Test images get one random reference (the paper's default protocol). Each batch draws its references
  from its own generator (`batch_generator(seed, number)`), whichever process reads it.
  For an anchored backbone the same features also give the unmasked probe (alpha = 0).
- The objective (mean loss + l2 / 2 * ||W||^2, bias not penalised) is convex; it is solved to
  convergence by full-batch L-BFGS in float64 on standardised features, so the probe is the
  optimum that sklearn's LogisticRegression(C = 1 / l2) finds with the same rows and weights
  (masked rows repeated once per class with weight / C: a uniform target; tested). The features
  of all views are held in memory (N * views * 2 * D float64 values).

Under torchrun the processes share every set by whole batches, as `evaluate` does, and rank 0 gathers the
features in the set's order, fits the probes and writes `<run>/linear_probe.json`: the numbers are one process's.
"""

from __future__ import annotations

import copy
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fastanchor.errors import ConfigError
from fastanchor.files import atomic_write_bytes
from torch.utils.data import Subset

from fastanchor.kernels import IMAGENET_MEAN_255, IMAGENET_STD_255, anchor, normalize
from fastanchor.pipeline.datasets.imagefolder import ImageFolderIndex, scan_image_folder
from fastanchor.progress import progress_bar
from fastanchor.pipeline.loaders.torchvision import Corruption, DecodedImages, eval_transform
from fastanchor.trainer.build import eval_loader, loader_for, reference_images
from fastanchor.trainer.distributed import Processes, gather_to_main, start_processes, stop_processes
from fastanchor.evaluation.evaluate import batch_generator, batch_share, checkpoint_references, reference_set_record
from fastanchor.trainer.build import load_for_inference, resolve_device
from fastanchor.trainer.checkpoint.run_folder import RunFolder
from fastanchor.evaluation.specs import ProbeSpec


# ----------------------------------------------------------------------------------------------
# Features


def feature_extractor(model: torch.nn.Module) -> tuple[torch.nn.Module | callable, str]:
    """A function from network input to the frozen pre-classifier feature vector, and its description."""
    if hasattr(model, "forward_features") and hasattr(model, "forward_head"):
        return (lambda x: model.forward_head(model.forward_features(x), pre_logits=True),
                "timm forward_features + forward_head(pre_logits=True)")
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    if not linears:
        raise ConfigError(f"{type(model).__name__} has no Linear classifier: cannot take its penultimate features")
    headless = copy.deepcopy(model)
    headless.set_submodule(linears[-1], torch.nn.Identity())
    return headless, f"torchvision penultimate features (input of {linears[-1]})"


@torch.no_grad()
def features_of(extract, loader, *, anchored: bool, pool: torch.Tensor | None, views: int, masked_too: bool,
                seed: int, desc: str, progress: bool, numbers=None) -> dict:
    """Features of every image for `views` reference draws: {"plain": [V, N, D], "masked": [V, N, D] | None, "labels": [N]}.

    Standard backbones ignore the references (one view of x). Anchored backbones see [r, x - r]
    (and, with `masked_too`, [0, x - r] with the same r), the references of batch `number` of the set drawn from
    `batch_generator(seed, number)` (`numbers`: the set's number of each batch the loader yields; 0, 1, ... by default).
    """
    plain, masked, labels = [], [], []
    numbers = iter(numbers if numbers is not None else itertools.count())
    bar = progress_bar(loader, desc=desc, leave=False, enabled=progress, unit="batch")
    started, seen = time.perf_counter(), 0
    for images, batch_labels in bar:
        generator = batch_generator(seed, next(numbers))
        labels.append(batch_labels.cpu())
        seen += batch_labels.numel()
        bar.set_postfix(img_s=f"{seen / (time.perf_counter() - started):.0f}")
        if not anchored:
            plain.append(extract(normalize(images, IMAGENET_MEAN_255, IMAGENET_STD_255)).float().cpu()[None])
            continue
        per_view, per_view_masked = [], []
        for _ in range(views):
            index = torch.randint(len(pool), (images.shape[0],), generator=generator).to(pool.device)
            refs = pool[index]
            off = torch.zeros(images.shape[0], dtype=torch.bool, device=images.device)
            per_view.append(extract(anchor(images, refs, off, IMAGENET_MEAN_255, IMAGENET_STD_255)).float().cpu())
            if masked_too:
                on = torch.ones_like(off)
                per_view_masked.append(extract(anchor(images, refs, on, IMAGENET_MEAN_255, IMAGENET_STD_255)).float().cpu())
        plain.append(torch.stack(per_view))
        if masked_too:
            masked.append(torch.stack(per_view_masked))
    return {"plain": torch.cat(plain, dim=1), "masked": torch.cat(masked, dim=1) if masked else None,
            "labels": torch.cat(labels)}


def shared_features(extract, index: ImageFolderIndex, corruption: Corruption | None, data, device: torch.device,
                    processes: Processes, **options) -> dict | None:
    """`features_of` over a set: read whole by one process (the configured loader), or shared out between the
    processes by whole batches (the torchvision path) and gathered on rank 0 in the set's order (None elsewhere)."""
    if not processes.several:
        return features_of(extract, eval_loader(data, index, device, corruption), **options)
    dataset = DecodedImages(index, eval_transform(data.image_size, data.crop_ratio), corruption)
    numbers, samples = batch_share(len(dataset), data.eval_batch_size, processes)
    mine = features_of(extract, loader_for(Subset(dataset, samples), data, device), numbers=numbers,
                       **options) if samples else None
    parts = gather_to_main(processes, (samples, mine))
    if parts is None:
        return None
    parts = [(positions, features) for positions, features in parts if features is not None]
    order = torch.tensor([i for positions, _ in parts for i in positions]).argsort()
    joined = lambda key, dim: torch.cat([f[key] for _, f in parts], dim).index_select(dim, order)  # noqa: E731
    return {"plain": joined("plain", 1), "masked": joined("masked", 1) if parts[0][1]["masked"] is not None else None,
            "labels": joined("labels", 0)}


# ----------------------------------------------------------------------------------------------
# The probe (pure: tensors in, tensors out)


@dataclass
class LinearProbe:
    weight: torch.Tensor  # [C, D] on standardised features
    bias: torch.Tensor  # [C]
    mean: torch.Tensor  # [D] feature standardisation (training features)
    scale: torch.Tensor  # [D]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return standardise(features.double(), self.mean, self.scale) @ self.weight.T + self.bias


def standardisation(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean and std of training features [..., D] (std floored to avoid dividing by 0)."""
    flat = features.reshape(-1, features.shape[-1]).double()
    return flat.mean(0), flat.std(0, unbiased=False).clamp_min(1e-8)


def standardise(features: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (features.double() - mean) / scale


UNIFORM = -1  # the target of a masked view: the uniform distribution over the classes


def probe_problem(plain: torch.Tensor, labels: torch.Tensor, masked: torch.Tensor | None = None,
                  alpha: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The probe's training set as weighted rows: (features [M, D], targets [M] (a class or UNIFORM), weights [M]).

    Unmasked views carry their label and weight (1 - alpha) / (N V); masked views the uniform
    target and weight alpha / (N V). Weights sum to 1, so the loss is a mean over images and views.
    """
    views, n = plain.shape[0], plain.shape[1]
    x = plain.reshape(views * n, -1).double().numpy()
    targets = labels.long().repeat(views).numpy()
    weights = np.full(views * n, (1.0 - alpha) / (views * n))
    if alpha > 0:
        x = np.concatenate([x, masked.reshape(views * n, -1).double().numpy()])
        targets = np.concatenate([targets, np.full(views * n, UNIFORM)])
        weights = np.concatenate([weights, np.full(views * n, alpha / (views * n))])
    return x, targets, weights


def probe_objective(theta: np.ndarray, x: np.ndarray, targets: np.ndarray, weights: np.ndarray, num_classes: int,
                    l2: float) -> tuple[float, np.ndarray]:
    """sum_m w_m CE(softmax(W x_m + b), t_m) + l2/2 ||W||^2 and its gradient; theta = [W.ravel(), b].

    CE against a label y is logsumexp(z) - z_y; against the uniform target logsumexp(z) - mean(z).
    """
    dim = x.shape[1]
    weight, bias = theta[: num_classes * dim].reshape(num_classes, dim), theta[num_classes * dim:]
    z = x @ weight.T + bias
    z -= z.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    labelled = targets != UNIFORM
    rows = np.flatnonzero(labelled)
    cross_entropy = -log_p.mean(axis=1)
    cross_entropy[rows] = -log_p[rows, targets[rows]]
    loss = float((weights * cross_entropy).sum() + 0.5 * l2 * (weight * weight).sum())
    dz = np.exp(log_p)  # softmax minus the target distribution, weighted
    dz[~labelled] -= 1.0 / num_classes
    dz[rows, targets[rows]] -= 1.0
    dz *= weights[:, None]
    return loss, np.concatenate([(dz.T @ x + l2 * weight).ravel(), dz.sum(axis=0)])


def fit_linear_probe(plain: torch.Tensor, labels: torch.Tensor, num_classes: int, *, masked: torch.Tensor | None = None,
                     alpha: float = 0.0, l2: float = 1e-3) -> LinearProbe:
    """Minimise `probe_objective` to convergence with L-BFGS (float64; features [V, N, D] or [N, D])."""
    from scipy.optimize import minimize

    plain = plain if plain.ndim == 3 else plain[None]
    masked = None if masked is None else (masked if masked.ndim == 3 else masked[None])
    if alpha > 0 and masked is None:
        raise ValueError("an anchored probe with alpha > 0 needs the masked-view features")
    mean, scale = standardisation(plain)
    x, targets, weights = probe_problem(standardise(plain, mean, scale), labels,
                                        None if masked is None else standardise(masked, mean, scale), alpha)
    solution = minimize(probe_objective, np.zeros(num_classes * (x.shape[1] + 1)),
                        args=(x, targets, weights, num_classes, l2),
                        jac=True, method="L-BFGS-B", options={"maxiter": 20000, "maxcor": 30, "gtol": 1e-10, "ftol": 1e-16})
    weight = torch.from_numpy(solution.x[: num_classes * x.shape[1]].reshape(num_classes, x.shape[1]))
    return LinearProbe(weight, torch.from_numpy(solution.x[num_classes * x.shape[1]:]), mean, scale)


def probe_top1(probe: LinearProbe, features: torch.Tensor, labels: torch.Tensor) -> float:
    """Top-1 (%) of the probe on features [N, D] (or the first view of [V, N, D])."""
    features = features[0] if features.ndim == 3 else features
    return 100.0 * float((probe.logits(features).argmax(-1) == labels).double().mean())


# ----------------------------------------------------------------------------------------------
# The command


def probe_references(state: dict, data, train_index, spec: ProbeSpec, anchored: bool) -> tuple[torch.Tensor | None, dict | None]:
    """The anchored probe's reference pool and its record: the checkpoint's inference reference set when the probe
    trains on the checkpoint's own training split (so a fixed training R is what the probe and its test images are
    anchored against), else `spec.reference_pool` images drawn from the probe's training images (a new task)."""
    if not anchored:
        return None, None
    own = (Path(data.root) / data.train_split).resolve()
    if Path(train_index.root).resolve() == own:
        return state["reference_images"], checkpoint_references(state)
    pool = reference_images(data, train_index, spec.reference_pool, spec.seed)
    origin = {"source": f"a sample of the probe's training images ({train_index.root})", "training_images": len(train_index)}
    return pool, reference_set_record(pool, origin)



def linear_probe(checkpoint: str | Path, spec: ProbeSpec, device: str = "auto") -> dict | None:
    """Train the standard (or anchored and unmasked) probe(s) of one checkpoint; write <run>/linear_probe.json.
    Under torchrun the processes share the sets; rank 0 fits, writes and returns the result, the others None."""
    spec.check()
    processes, target = start_processes(resolve_device(device))
    try:
        return probe_in_processes(Path(checkpoint), spec, target, processes)
    finally:
        stop_processes(processes)


def probe_in_processes(checkpoint: Path, spec: ProbeSpec, target: torch.device, processes: Processes) -> dict | None:
    model, config, state = load_for_inference(checkpoint, target, spec.overrides)
    model.requires_grad_(False)
    anchored, d = config.anchor.enabled, config.data
    extract, described = feature_extractor(model)
    train_index = scan_image_folder(spec.train_root or Path(d.root) / d.train_split, allow_empty_classes=d.allow_empty_classes)
    val_index = scan_image_folder(spec.val_root or Path(d.root) / d.val_split, train_index.classes)
    if spec.shift_root:
        shift_index, corruption = scan_image_folder(spec.shift_root, train_index.classes), None
        shift_set = {"kind": "dataset", "root": str(shift_index.root), "images": len(shift_index)}
    else:
        shift_index, corruption = val_index, Corruption(spec.shift_corruption, spec.shift_severity, spec.seed)
        shift_set = {"kind": "corruption", "corruption": spec.shift_corruption, "severity": spec.shift_severity,
                     "root": str(val_index.root), "images": len(val_index)}
    pool, pool_record = probe_references(state, d, train_index, spec, anchored)
    pool = None if pool is None else pool.to(target)
    common = {"anchored": anchored, "pool": pool, "seed": spec.seed, "progress": config.train.progress and processes.main}
    train = shared_features(extract, train_index, None, d, target, processes, views=spec.views, masked_too=anchored,
                            desc="probe features: train", **common)
    val = shared_features(extract, val_index, None, d, target, processes, views=1, masked_too=False,
                          desc="probe features: val", **common)
    shift = shared_features(extract, shift_index, corruption, d, target, processes, views=1, masked_too=False,
                            desc="probe features: shift", **common)
    if not processes.main:
        return None

    settings = {"standard": 0.0} if not anchored else {"anchored": spec.alpha, "anchored_no_masking": 0.0}
    probes = {}
    for name, alpha in settings.items():
        probe = fit_linear_probe(train["plain"], train["labels"], len(train_index.classes), masked=train["masked"],
                                 alpha=alpha, l2=spec.l2)
        probes[name] = {"alpha": alpha, "train_top1": probe_top1(probe, train["plain"], train["labels"]),
                        "id_top1": probe_top1(probe, val["plain"], val["labels"]),
                        "shift_top1": probe_top1(probe, shift["plain"], shift["labels"])}
    result = {
        "checkpoint": str(checkpoint), "anchored": anchored, "model": config.model.name, "epoch": state.get("epoch"),
        "features": described, "feature_dim": int(train["plain"].shape[-1]),
        "train_set": {"root": str(train_index.root), "images": len(train_index), "classes": len(train_index.classes)},
        "id_set": {"root": str(val_index.root), "images": len(val_index)}, "shift_set": shift_set,
        "settings": {"l2": spec.l2, "views": spec.views if anchored else 1, "masked_target": "uniform",
                     "reference_pool": 0 if pool is None else len(pool), "seed": spec.seed,
                     "inference": "one random reference from the reference pool" if anchored else "plain",
                     "solver": "full-batch L-BFGS (float64) on standardised features, mean loss + l2/2 ||W||^2"},
        "probes": probes, "references": pool_record,
    }
    atomic_write_bytes(RunFolder.of_checkpoint(checkpoint).linear_probe, lambda h: h.write(json.dumps(result, indent=2).encode()))
    return result
