"""masksembles_torch layers: semantics, dtypes, state, errors, random mode."""

from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import pytest
import torch
from torch import nn

import masksembles_core as mc
import masksembles_torch as mt
from tests.rounding import assert_rounding_close

LAYERS = [
    (mt.Masksembles1D, (10, 16)),
    (mt.Masksembles1D, (10, 16, 7)),
    (mt.Masksembles2D, (10, 16, 5, 4)),
    (mt.Masksembles3D, (10, 16, 3, 2, 2)),
]


@pytest.mark.parametrize("cls,shape", LAYERS, ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("batch", [8, 10, 1, 3])
def test_matches_reference(cls: type[mt.Masksembles], shape: tuple[int, ...], batch: int) -> None:
    layer = cls(16, 4, 2.0, seed=0)
    x = torch.randn(batch, *shape[1:])
    expected = mc.apply_masks(x.numpy(), mc.generate_masks(16, 4, 2.0, seed=0), channel_axis=1)
    assert np.array_equal(layer(x).numpy(), expected)


def test_original_argument_order_and_repr() -> None:
    layer = mt.Masksembles2D(16, 4, 2.0, seed=1)
    assert (layer.channels, layer.n, layer.scale) == (16, 4, 2.0)
    assert repr(layer) == "Masksembles2D(16, n=4, scale=2.0, mode='grouped', channel_axis=1)"
    assert list(layer.parameters()) == [], "masks are a buffer, not parameters"


def test_channels_last_sequence_layout() -> None:
    layer = mt.Masksembles(16, 4, 2.0, seed=0, channel_axis=-1)
    x = torch.randn(8, 11, 16)
    expected = mc.apply_masks(x.numpy(), layer.masks.numpy(), channel_axis=-1)
    assert np.array_equal(layer(x).numpy(), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_input_dtype_is_kept(dtype: torch.dtype) -> None:
    layer = mt.Masksembles2D(8, 4, 2.0, seed=0)
    for batch in (8, 6):
        assert layer(torch.randn(batch, 8, 3, 3, dtype=dtype)).dtype == dtype
    assert layer.masks.dtype == torch.float32


def test_channels_last_memory_format_is_kept() -> None:
    layer = mt.Masksembles2D(8, 4, 2.0, seed=0)
    for batch in (8, 6):
        x = torch.randn(batch, 8, 5, 5).to(memory_format=torch.channels_last)
        assert layer(x).is_contiguous(memory_format=torch.channels_last)


def test_factory_kwargs_and_to() -> None:
    layer = mt.Masksembles1D(8, 2, 2.0, seed=0, dtype=torch.float64, device="cpu")
    assert layer.masks.dtype == torch.float64 and layer.masks.device.type == "cpu"
    assert layer.half().masks.dtype == torch.float16
    with pytest.raises(TypeError, match="floating dtype"):
        mt.Masksembles1D(8, 2, 2.0, dtype=torch.int64)


@pytest.mark.parametrize(
    "cls,shape,message",
    [
        (mt.Masksembles2D, (8, 16, 4), r"Masksembles2D expects an input of rank 4; received shape \(8, 16, 4\)"),
        (mt.Masksembles1D, (8, 15), r"Masksembles1D expects 16 channels on axis 1, layout \(B, C\); received shape"),
        (mt.Masksembles3D, (2, 16, 1, 1), r"Masksembles3D expects an input of rank 5"),
    ],
)
def test_shape_errors_use_core_text(cls: type[mt.Masksembles], shape: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls(16, 4, 2.0)(torch.randn(*shape))


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"channels": 16, "n": 0, "scale": 2.0}, ValueError, "n must be an integer >= 1; received 0"),
        ({"channels": 16, "n": 4, "scale": 0.5}, ValueError, "scale must be a finite real number >= 1"),
        ({"channels": 16, "n": 4.0, "scale": 2.0}, TypeError, r"n must be an integer >= 1; received 4.0 \(float\)"),
        ({"channels": 16, "n": 4, "scale": 2.0, "mode": "per-sample"}, ValueError, "mode must be one of"),
        ({"channels": 16, "n": 4, "scale": 2.0, "channel_axis": 0}, ValueError, "axis 0 is the batch"),
        ({"masks": np.zeros((2, 4)), "n": 2}, ValueError, "all zero"),
        ({"masks": np.ones((2, 4)), "n": 3}, ValueError, "n=3 does not match the 2 masks"),
    ],
)
def test_argument_errors_use_core_text(kwargs: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        mt.Masksembles(**kwargs)


def test_user_masks_tensor_or_array() -> None:
    masks = np.array([[1, 0, 1, 1], [0, 1, 1, 0]])
    for given in (masks, torch.tensor(masks), masks.astype(bool), torch.tensor(masks, dtype=torch.bfloat16)):
        layer = mt.Masksembles(masks=given)
        assert (layer.n, layer.channels, layer.scale) == (2, 4, None)
        assert np.array_equal(layer.masks.numpy(), masks)


def test_seed_reproducible_and_none_fresh() -> None:
    assert torch.equal(mt.Masksembles1D(64, 4, 2.0, seed=3).masks, mt.Masksembles1D(64, 4, 2.0, seed=3).masks)
    assert not torch.equal(mt.Masksembles1D(64, 4, 2.0).masks, mt.Masksembles1D(64, 4, 2.0).masks)


def test_gradient_is_the_mask() -> None:
    layer = mt.Masksembles2D(8, 4, 3.0, seed=0)
    x = torch.randn(6, 8, 2, 2, dtype=torch.float64, requires_grad=True)
    (layer(x) * 3).sum().backward()
    expected = 3 * mc.apply_masks_grad(np.ones(x.shape), layer.masks.numpy(), channel_axis=1)
    assert np.array_equal(x.grad.numpy(), expected)
    assert torch.autograd.gradcheck(layer, (x,))


def _fresh_model() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 16, 3), mt.Masksembles2D(16, 4, 2.0), nn.Flatten(), nn.LazyLinear(2))


def test_state_dict_round_trip_keeps_masks_bit_for_bit(tmp_path) -> None:
    model = _fresh_model()
    model(torch.randn(4, 3, 8, 8))
    assert "1.masks" in model.state_dict()
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    other = _fresh_model()  # seed=None: different masks until loaded
    other(torch.randn(4, 3, 8, 8))
    assert not torch.equal(other[1].masks, model[1].masks)
    other.load_state_dict(torch.load(path, weights_only=True))
    assert torch.equal(other[1].masks, model[1].masks)
    x = torch.randn(8, 3, 8, 8)
    assert torch.equal(other(x), model(x))


def test_whole_model_save_deepcopy_pickle() -> None:
    model = _fresh_model()
    x = torch.randn(4, 3, 8, 8)
    expected = model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [torch.load(buffer, weights_only=False), copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
    for clone in copies:
        assert torch.equal(clone[1].masks, model[1].masks)
        assert torch.equal(clone(x), expected)


def test_loading_masks_that_do_not_fit_is_a_clear_error() -> None:
    source = mt.Masksembles1D(16, 4, 2.0, seed=0)
    with pytest.raises(RuntimeError, match=r"masks of shape \(4, 16\), but this Masksembles1D has n=3, channels=16"):
        mt.Masksembles1D(16, 3, 2.0).load_state_dict(source.state_dict())
    with pytest.raises(RuntimeError, match="invalid masks in the checkpoint: masks must hold only 0 and 1"):
        mt.Masksembles1D(16, 4, 2.0).load_state_dict({"masks": torch.full((4, 16), 0.5)})


def test_mask_buffer_moves_with_the_module() -> None:
    layer = mt.Masksembles1D(8, 2, 2.0, seed=0).to(torch.float64)
    assert layer.masks.dtype == torch.float64
    assert layer(torch.randn(4, 8, dtype=torch.float64)).dtype == torch.float64


def test_random_mode_statistics_and_generator() -> None:
    n, batch, draws = 4, 64, 200
    masks = np.eye(n, dtype=bool).repeat(2, axis=1)  # mask k keeps channels 2k, 2k+1
    layer = mt.Masksembles1D(masks=masks, mode="random", generator=torch.Generator().manual_seed(0))
    layer.train()
    counts = np.zeros(n)
    x = torch.ones(batch, 2 * n)
    for _ in range(draws):
        chosen = layer(x).numpy().reshape(batch, n, 2)[:, :, 0].argmax(axis=1)
        counts += np.bincount(chosen, minlength=n)
    expected = batch * draws / n
    assert np.abs(counts - expected).max() < 5 * np.sqrt(expected), counts  # ~5 sigma
    first = mt.Masksembles1D(masks=masks, mode="random", generator=torch.Generator().manual_seed(7))(x)
    second = mt.Masksembles1D(masks=masks, mode="random", generator=torch.Generator().manual_seed(7))(x)
    assert torch.equal(first, second)
    layer.eval()
    assert torch.equal(layer(x), mt.Masksembles1D(masks=masks)(x)), "random mode is grouped in eval"


def test_tile_untile_predict() -> None:
    model = nn.Sequential(nn.Linear(5, 16), mt.Masksembles1D(16, 4, 2.0, seed=0), nn.Linear(16, 3))
    model.train()
    x = torch.randn(7, 5)
    assert mt.tile(x, 4).shape == (28, 5)
    assert torch.equal(mt.untile(mt.tile(x, 4), 4)[2], x)
    members = mt.predict(model, x, 4)
    assert members.shape == (4, 7, 3) and model.training, "predict restores the train/eval mode"
    hidden = model[0](x)
    for k in range(4):  # 7 rows against predict's 28: a matmul may round differently on another number of rows
        expected = model[2](hidden * model[1].masks[k])
        assert_rounding_close(members[k].detach(), expected.detach())
    assert_rounding_close(mt.predict(model, x, 4, batch_size=3), members)  # chunks of 12 rows against 28
    with pytest.raises(ValueError, match="multiple of n=4"):
        mt.untile(torch.zeros(6, 2), 4)
