"""One config -> model map for training and inference (issue 16): a checkpoint is evaluated on the network
it was trained as, BlurPool included (timm's BlurPool filter is a non-persistent buffer, so a model rebuilt
without it loads the state dict strictly and silently computes something else)."""

import json

import torch
from conftest import run_main, tiny_overrides
from fastanchor.trainer import build as build_module
from fastanchor.trainer.build import eval_loader, load_for_inference, split_index
from fastanchor.trainer.predict import predict


def module_tree(model: torch.nn.Module) -> dict:
    return {"modules": [(name, type(module).__name__) for name, module in model.named_modules()],
            "buffers": [name for name, _ in model.named_buffers()],  # persistent or not
            "text": str(model)}


def test_blurpool_model_is_evaluated_as_trained(tiny_dataset, tmp_path, monkeypatch):
    built = []
    build = build_module.build_model

    def spy(*args, **kwargs):
        built.append(build(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(build_module, "build_model", spy)  # keeps the trained model to compare with
    # one epoch at lr 0.01 (deterministic on the CPU): 29.2% validation top-1 on 24 images, where the same weights
    # without BlurPool score 25.0% (at the default lr both sit at chance and the top-1 check alone would not tell)
    result = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{
        "train.run_name": "blur", "anchor.enabled": "false", "model.name": "resnet18", "model.blurpool": "true",
        "optim.lr": 0.01, "eval.corruptions": "[]"}))
    assert result.returncode == 0, result.stderr
    trained, = built
    run_dir = tmp_path / "blur"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val_top1 = [r["val_top1"] for r in records if "val_top1" in r]
    assert len(val_top1) == 1

    # the rebuilt model is the trained network: same modules, same buffers (BlurPool's filter is not persistent)
    model, config, state = load_for_inference(run_dir / "final.pt", torch.device("cpu"))
    assert any(type(m).__name__ == "BlurPool2d" for m in trained.modules())
    assert module_tree(model) == module_tree(trained)
    assert state["metrics"]["val_top1"] == val_top1[0]

    # and computes the trained network's logits on the validation split (trained without EMA: same weights)
    trained.eval()
    val_index = split_index(config.data, config.data.val_split, tuple(state["classes"]))
    with torch.no_grad():
        for images, _ in eval_loader(config.data, val_index, torch.device("cpu"), progress=False):
            expected = predict(trained, images, anchored=False, references=None).logits
            assert torch.equal(predict(model, images, anchored=False, references=None).logits, expected)

    # `fastanchor evaluate`'s ID top-1 is validation's: a standard model, the same loader (eval_loader over the whole
    # validation split, eval_batch_size), full precision on the CPU in both
    result = run_main("evaluate", "--checkpoint", run_dir / "final.pt", "--json")
    assert result.returncode == 0, result.stderr
    evaluated = json.loads(result.stdout)
    assert evaluated["id"]["images"] == len(val_index)
    assert evaluated["id"]["top1"] == val_top1[0]


def test_loading_a_checkpoint_never_asks_for_pretrained_weights(tiny_dataset, tmp_path, monkeypatch):
    from fastanchor.trainer import build

    result = run_main("train", *tiny_overrides(tiny_dataset, tmp_path, **{"train.run_name": "tiny"}))
    assert result.returncode == 0, result.stderr
    asked = []
    create = build.create_model
    monkeypatch.setattr(build, "create_model", lambda *args, **kwargs: asked.append(kwargs["pretrained"]) or create(*args, **kwargs))
    model, config, _ = load_for_inference(tmp_path / "tiny" / "final.pt", torch.device("cpu"), ["model.pretrained=true"])
    assert config.model.pretrained and asked == [False]
