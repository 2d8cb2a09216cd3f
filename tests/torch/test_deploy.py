"""Deploying a packed model with and without its uncertainty head, at a dynamic batch (run at two sizes, one of them
1): torch.export -> .pt2 save and load, and ONNX (torch.onnx.export(dynamo=True)) run in onnxruntime, its outputs
named as the head's dict. Every result equals predict / uncertainty_head in float32 rounding; the guide's Deploy
section runs as written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import masksembles_torch as mt
from tests.torch.guide import guide_section
from tests.torch.heads import CASES, FEATURES, N, assert_head_matches, assert_members_match, masksembles_model

SIZES = (5, 1)


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        mt.Masksembles2D(8, N, 2.0, seed=0),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 16),
        nn.ReLU(),
        mt.Masksembles1D(16, N, 2.0, seed=1),
        nn.Linear(16, 3),
    ).eval()


def image(batch: int) -> torch.Tensor:
    return torch.randn(batch, 3, 6, 6)


def deployed(kind: str) -> tuple[nn.Module, nn.Module, dict[str, Any], torch.Tensor]:
    """(the Masksembles model, what is exported, the head's arguments or None for bare members, an example)."""
    if kind == "gaussian head":
        model, arguments = masksembles_model("gaussian log_variance"), CASES["gaussian log_variance"][2]
        x = torch.randn(8, FEATURES)
        return model, mt.with_uncertainty(mt.pack(model, x, program="packed"), **arguments), arguments, x
    model, x = cnn(), image(8)
    if kind == "inserted + head":
        return model, mt.with_uncertainty(model), {}, x
    packed = mt.pack(model, x, program="packed")
    return model, (mt.with_uncertainty(packed) if kind == "packed + head" else packed), {}, x


def example(model: nn.Module, batch: int) -> torch.Tensor:
    return image(batch) if isinstance(model[0], nn.Conv2d) else torch.randn(batch, FEATURES)


def check(answer: Any, model: nn.Module, x: torch.Tensor, arguments: dict[str, Any], head: bool) -> None:
    if head:
        assert_head_matches(answer, model, x, arguments)
    else:
        assert_members_match(answer, model, x)


def batch_dim() -> torch.export.Dim:
    return torch.export.Dim("batch", min=1, max=1024)


# torch 2.13's .pt2 packager warns for every non-contiguous weight (it finds the storage bounds of contiguous ones
# only), here the packed program's channels-last convolution weights; it saves them whole, and the loaded program is
# checked against predict below.
CHANNELS_LAST_WEIGHTS = "ignore:No complete tensor found in the group:UserWarning"


@pytest.mark.filterwarnings(CHANNELS_LAST_WEIGHTS)
@pytest.mark.parametrize("kind", ["packed", "packed + head"])
def test_exported_program_saved_and_loaded(kind: str, tmp_path: Path) -> None:
    model, module, arguments, x = deployed(kind)
    program = torch.export.export(module, (x,), dynamic_shapes=({0: batch_dim()},))
    torch.export.save(program, tmp_path / "model.pt2")
    loaded = torch.export.load(tmp_path / "model.pt2").module()
    for size in SIZES:
        x = example(model, size)
        check(loaded(x), model, x, arguments, kind != "packed")


@pytest.mark.parametrize(
    "kind", ["packed", "packed + head", "gaussian head", pytest.param("inserted + head", marks=pytest.mark.slow)]
)
def test_onnx_in_onnxruntime(kind: str, tmp_path: Path) -> None:
    import onnxruntime  # the torch nox session installs it (dependency group test-torch)

    model, module, arguments, x = deployed(kind)
    names = list(module.outputs) if isinstance(module, mt.UncertaintyHead) else None
    path = str(tmp_path / "model.onnx")
    torch.onnx.export(module, (x,), path, dynamo=True, dynamic_shapes=({0: batch_dim()},), output_names=names)
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    if names:  # the head's forward(inputs) -> its dict, by name
        assert [value.name for value in session.get_inputs()] == ["inputs"]
        assert [value.name for value in session.get_outputs()] == names
    for size in SIZES:
        x = example(model, size)
        results = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        if names:
            check(dict(zip(names, results, strict=True)), model, x, arguments, True)
        else:
            check(results[0], model, x, arguments, False)


@pytest.mark.filterwarnings(CHANNELS_LAST_WEIGHTS)
def test_the_guide_deploy_section_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the recipe writes its files to the working directory
    blocks = guide_section("Deploy")
    assert blocks
    namespace: dict[str, Any] = {"__name__": "guide_deploy"}
    for index, block in enumerate(blocks):
        exec(compile(block, f"docs/torch.md Deploy block {index}", "exec"), namespace)
