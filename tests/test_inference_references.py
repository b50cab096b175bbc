"""The inference reference set comes from the training reference set R: with anchor.references = fixed it is R
itself (the very images training paired with, bitwise and by training index) up to the anchor.inference_references
cap, then a seeded sample of R; every command that evaluates (evaluate with one reference, K references and BLT,
robustness, linear-probe, finetune-ood) anchors with it."""

import hashlib
import json

import numpy as np
import pytest
import torch
from conftest import run_main, tiny_overrides
from fastanchor.pipeline.shifts.eval_sets import subset
from fastanchor.pipeline.datasets.imagefolder import scan_image_folder
from fastanchor.pipeline.references import FixedReferenceSet
from fastanchor.pipeline.loaders.torchvision import DecodedImages, eval_transform
from fastanchor.pipeline.datasets.imagefolder import load_rgb
from fastanchor.trainer.build import build_training, inference_references, load_for_inference, resolve_device
from fastanchor.trainer.checkpoint.file import load_checkpoint
from fastanchor.trainer.config import DataConfig, config_from_dict
from fastanchor.trainer.distributed import Processes
from fastanchor.evaluation.inference import BilinearTransduction
from fastanchor.trainer.predict import predict

EVAL = {"eval.max_images": 12, "eval.num_references": 3, "eval.blt_candidates": 4, "eval.blt_residuals": 40,
        "eval.corruptions": "[contrast]", "eval.corruptions_bar": "[]", "eval.plots": "false"}


def digest(images: torch.Tensor) -> str:
    """SHA-256 of uint8 pixels in NCHW order, computed here from the bytes."""
    return hashlib.sha256(images.contiguous().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def fixed_run(tiny_dataset, tmp_path_factory):
    """A model trained with a fixed R of 5 images, and R as the training loop's anchoring stage holds it."""
    out = tmp_path_factory.mktemp("fixed_r")
    result = run_main("train", *tiny_overrides(tiny_dataset, out, **{
        "train.run_name": "fixed5", "anchor.references": "fixed", "anchor.fixed_size": 5}))
    assert result.returncode == 0, result.stderr
    state = load_checkpoint(out / "fixed5" / "final.pt")
    config = config_from_dict(state["config"])
    training = build_training(config, Processes(), resolve_device("cpu"), None)  # what the loop paired with
    return out / "fixed5", training.stage.references.images.cpu()


def test_the_checkpoint_carries_r_itself(fixed_run, tiny_dataset):
    run, r = fixed_run
    state = load_checkpoint(run / "final.pt")
    assert r.shape == (5, 3, 32, 32)
    assert torch.equal(state["reference_images"], r)  # bitwise, in R's order
    origin = state["reference_origin"]
    assert origin["reference_set_size"] == 5 and origin["training_images"] == 48 and "fixed" in origin["source"]
    # by index: the files at those training positions, decoded again, are R
    index = scan_image_folder(tiny_dataset / "train")
    assert len(set(origin["training_indices"])) == 5
    transform = eval_transform(32, state["config"]["data"]["crop_ratio"])
    decoded = torch.stack([transform(load_rgb(index.samples[i][0])) for i in origin["training_indices"]])
    assert torch.equal(decoded, r)


def test_evaluate_uses_r_for_one_reference_k_references_and_blt(fixed_run, tiny_dataset):
    run, r = fixed_run
    result = run_main("evaluate", "--checkpoint", run / "final.pt", "--json",
                      *[a for k, v in EVAL.items() for a in ("--set", f"{k}={v}")])
    assert result.returncode == 0, result.stderr
    evaluation = json.loads(result.stdout)
    assert evaluation["references"]["images"] == 5 and evaluation["references"]["sha256"] == digest(r)
    # every protocol recomputed here with R (the 12 validation images fit one batch; the same seeded draws)
    model, config, _ = load_for_inference(run / "final.pt", torch.device("cpu"))
    images = subset(DecodedImages(scan_image_folder(tiny_dataset / "val"), eval_transform(32, config.data.crop_ratio)), 12, 0)
    batch = torch.stack([images[i][0] for i in range(len(images))])
    labels = torch.tensor([images[i][1] for i in range(len(images))])
    references = FixedReferenceSet(r)

    def top1(prediction):  # evaluate ranks by the mean logits (K references: their mean over the draws)
        return 100.0 * (prediction.logits.argmax(1) == labels).double().mean().item()

    one = predict(model, batch, anchored=True, references=references, num_references=1, generator=torch.Generator().manual_seed(0))
    k = predict(model, batch, anchored=True, references=references, num_references=3, generator=torch.Generator().manual_seed(0))
    blt = BilinearTransduction(references, num_residuals=40, num_candidates=4, generator=torch.Generator().manual_seed(0))
    chosen = blt.predict(model, batch, torch.Generator().manual_seed(0))
    by_protocol = evaluation["id"]["by_protocol"]
    assert by_protocol["one_reference"]["top1"] == pytest.approx(top1(one))
    assert by_protocol["k3"]["top1"] == pytest.approx(top1(k)) == pytest.approx(evaluation["id"]["top1_k3"])
    assert by_protocol["blt"]["top1"] == pytest.approx(top1(chosen)) == pytest.approx(evaluation["id"]["top1_blt"])
    # the anomaly scores come from one reference per sample (the paper's protocol): the ID energies are those
    with np.load(run / evaluation["ood"]["scores_file"]) as stored:
        np.testing.assert_allclose(stored["id/energy"], torch.logsumexp(one.logits.double(), 1).numpy(), rtol=1e-5)
    assert evaluation["ood"]["protocol"] == "one_reference" and evaluation["ood"]["score_protocols"]["anchored_std"] == "k3"


def test_robustness_linear_probe_and_finetune_ood_use_r(fixed_run):
    run, r = fixed_run
    result = run_main("robustness", "--run", run, "--corruption", "contrast", "--baseline", "line:1,0")
    assert result.returncode == 0, result.stderr
    robustness = json.loads((run / "robustness_over_training.json").read_text())
    assert robustness["references"]["sha256"] == digest(r) and robustness["references"]["images"] == 5

    result = run_main("linear-probe", "--checkpoint", run / "final.pt", "--views", "1")
    assert result.returncode == 0, result.stderr
    probe = json.loads((run / "linear_probe.json").read_text())
    assert probe["references"]["sha256"] == digest(r) and probe["settings"]["reference_pool"] == 5

    result = run_main("finetune-ood", "--checkpoint", run / "final.pt", "--set", "finetune_ood.steps=1",
                      "--set", "eval.num_references=2")
    assert result.returncode == 0, result.stderr
    summary = json.loads((run / "finetune_ood" / "summary.json").read_text())
    for when in ("before", "after"):
        assert summary[when]["references"]["sha256"] == digest(r)
    finetuned = load_checkpoint(run / "finetune_ood" / "finetuned.pt")
    assert torch.equal(finetuned["reference_images"], r) and finetuned["reference_origin"]["reference_set_size"] == 5


def test_a_larger_r_is_sampled_down_to_the_cap_with_its_seed(tiny_dataset):
    index = scan_image_folder(tiny_dataset / "train")
    gen = torch.Generator().manual_seed(5)
    fixed = torch.randint(0, 256, (10, 3, 4, 4), dtype=torch.uint8, generator=gen)
    positions = [40, 3, 17, 8, 25, 31, 0, 12, 44, 6]
    common = {"references": "fixed", "cap": 4, "fixed_positions": positions, "fixed_images": fixed}
    drawn = inference_references(DataConfig(), index, seed=0, **common)
    assert drawn.images.shape == (4, 3, 4, 4) and len(set(drawn.origin["training_indices"])) == 4
    for image, position in zip(drawn.images, drawn.origin["training_indices"]):
        assert torch.equal(image, fixed[positions.index(position)])  # each one a member of R, at its own index
    again = inference_references(DataConfig(), index, seed=0, **common)
    assert torch.equal(again.images, drawn.images) and again.origin == drawn.origin
    others = {tuple(inference_references(DataConfig(), index, seed=s, **common).origin["training_indices"]) for s in range(1, 6)}
    assert len(others | {tuple(drawn.origin["training_indices"])}) > 1  # the seed chooses the sample
    whole = inference_references(DataConfig(), index, seed=0, **{**common, "cap": 10})
    assert torch.equal(whole.images, fixed) and whole.origin["training_indices"] == positions  # up to the cap: all of R


def test_without_a_fixed_r_the_inference_set_is_a_seeded_sample_of_the_training_set(tiny_dataset):
    index = scan_image_folder(tiny_dataset / "train")
    data = DataConfig(image_size=32, crop_ratio=1.0)
    drawn = inference_references(data, index, references="derangement", cap=6, seed=1)
    assert drawn.images.shape == (6, 3, 32, 32) and drawn.origin["reference_set_size"] == 48
    transform = eval_transform(32, 1.0)
    for image, position in zip(drawn.images, drawn.origin["training_indices"]):
        assert torch.equal(image, transform(load_rgb(index.samples[position][0])))
