"""torch.compile(fullgraph=True), torch.export with a dynamic batch, ONNX export run in onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import masksembles_core as mc
import masksembles_torch as mt
from tests.conformance import assert_bit_identical


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        mt.Masksembles2D(8, 4, 2.0, seed=0),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 16),
        mt.Masksembles1D(16, 4, 3.0, seed=1),
        nn.Linear(16, 3),
    ).eval()


@pytest.mark.parametrize("batch", [8, 6, 1])
def test_compile_fullgraph_matches_eager(batch: int) -> None:
    model = small_cnn()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    x = torch.randn(batch, 3, 6, 6)
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)


def test_compile_dynamic_after_a_strided_convolution() -> None:
    # Compiled, the batch is never viewed as (n, B/n, ...): with symbolic spatial sizes (a strided
    # convolution under dynamic=True) Inductor cannot order the strides of that view.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), mt.Masksembles2D(8, 4, 2.0, seed=0), nn.Conv2d(8, 4, 3))
    compiled = torch.compile(model.eval(), fullgraph=True, dynamic=True)
    for batch in (8, 6):
        x = torch.randn(batch, 3, 15, 15)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_layer_is_bit_identical_with_gradients(dynamic: bool) -> None:
    layer = mt.Masksembles2D(8, 4, 2.0, seed=0)
    compiled = torch.compile(layer, fullgraph=True, dynamic=dynamic)
    for batch in (8, 5, 4, 3):
        x = torch.randn(batch, 8, 4, 4)
        x[:, :, 0, 0], x[:, :, 0, 1], x[:, :, 1, 0] = float("inf"), float("nan"), -1.0  # IEEE semantics kept
        x.requires_grad_(True)
        y = compiled(x)
        y.backward(torch.ones_like(y))
        with np.errstate(invalid="ignore"):
            expected = mc.apply_masks(x.detach().numpy(), layer.masks.numpy(), channel_axis=1)
        assert_bit_identical(y.detach().numpy(), expected)
        assert_bit_identical(
            x.grad.numpy(), mc.apply_masks_grad(np.ones(x.shape, np.float32), layer.masks.numpy(), channel_axis=1)
        )


def test_export_with_dynamic_batch() -> None:
    model = small_cnn()
    batch = torch.export.Dim("batch", min=1, max=1024)
    exported = torch.export.export(model, (torch.randn(8, 3, 6, 6),), dynamic_shapes=({0: batch},))
    program = exported.module()
    for size in (8, 6, 3, 1, 33):
        x = torch.randn(size, 3, 6, 6)
        torch.testing.assert_close(program(x), model(x), rtol=1e-5, atol=1e-6)


def test_exported_program_save_load(tmp_path) -> None:
    model = small_cnn()
    batch = torch.export.Dim("batch", min=1, max=1024)
    exported = torch.export.export(model, (torch.randn(8, 3, 6, 6),), dynamic_shapes=({0: batch},))
    path = tmp_path / "model.pt2"
    torch.export.save(exported, path)
    loaded = torch.export.load(path).module()
    x = torch.randn(5, 3, 6, 6)
    torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-6)


def test_onnx_export_runs_in_onnxruntime(tmp_path) -> None:
    import onnxruntime  # the torch nox session installs it (dependency group test-torch)

    model = small_cnn()
    path = tmp_path / "model.onnx"
    batch = torch.export.Dim("batch", min=1, max=1024)
    torch.onnx.export(model, (torch.randn(8, 3, 6, 6),), str(path), dynamo=True, dynamic_shapes=({0: batch},))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    for size in (8, 6, 1):
        x = torch.randn(size, 3, 6, 6)
        (result,) = session.run(None, {name: x.numpy()})
        np.testing.assert_allclose(result, model(x).detach().numpy(), rtol=1e-5, atol=1e-5)
