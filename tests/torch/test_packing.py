"""pack and extract_member equal the dense masked model: fixed models, randomly built ones, dtypes, modes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import masksembles_torch as mt

N = 4


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def randomize_norms(model: nn.Module, generator: torch.Generator) -> nn.Module:
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            c = module.num_features
            module.running_mean.copy_(torch.randn(c, generator=generator))
            module.running_var.copy_(torch.rand(c, generator=generator) + 0.5)
            if module.affine:
                module.weight.data.copy_(torch.randn(c, generator=generator))
                module.bias.data.copy_(torch.randn(c, generator=generator))
    return model.eval()


class ResidualBlock(nn.Module):
    def __init__(self, channels: int, scale: float, seed: int, masks_on_skip: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.masks = mt.Masksembles2D(channels, N, scale, seed=seed)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels)
        self.skip = mt.Masksembles2D(channels, N, scale, seed=seed + 100) if masks_on_skip else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.masks(F.relu(self.bn1(self.conv1(x))))
        return torch.relu(self.bn2(self.conv2(y)) + self.skip(x))


class ResNetLike(nn.Module):
    def __init__(self, scale: float, seed: int, masks_on_skip: bool) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.block1 = ResidualBlock(16, scale, seed, masks_on_skip)
        self.block2 = ResidualBlock(16, scale, seed + 1, False)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head_masks = mt.Masksembles1D(16, N, scale, seed=seed + 2)
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(self.block2(self.block1(self.stem(x)))).flatten(1)
        return self.fc(self.head_masks(y))


def mlp(scale: float, seed: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(12, 48), nn.GELU(), mt.Masksembles1D(48, N, scale, seed=seed),
        nn.Linear(48, 40), nn.Tanh(), nn.Dropout(0.3), mt.Masksembles1D(40, N, scale, seed=seed + 1),
        nn.Linear(40, 3),
    )  # fmt: skip


def cnn2d(scale: float, seed: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), mt.Masksembles2D(16, N, scale, seed=seed),
        nn.MaxPool2d(2), nn.Conv2d(16, 24, 3, padding=1), nn.ReLU(), mt.Masksembles2D(24, N, scale, seed=seed + 1),
        nn.BatchNorm2d(24), nn.Flatten(), nn.Linear(24 * 3 * 3, 32), nn.SiLU(),
        mt.Masksembles1D(32, N, scale, seed=seed + 2), nn.Linear(32, 4),
    )  # fmt: skip


def cnn1d(scale: float, seed: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(2, 12, 3), nn.ReLU(), mt.Masksembles1D(12, N, scale, seed=seed), nn.Conv1d(12, 8, 1),
        nn.AvgPool1d(2), nn.Sigmoid(), mt.Masksembles1D(8, N, scale, seed=seed + 1), nn.Flatten(), nn.Linear(8 * 3, 2),
    )  # fmt: skip


def cnn3d(scale: float, seed: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv3d(1, 8, 2), nn.BatchNorm3d(8), mt.Masksembles3D(8, N, scale, seed=seed), nn.ReLU(),
        nn.Conv3d(8, 6, 1), nn.AdaptiveMaxPool3d(1), nn.Flatten(), nn.Linear(6, 2),
    )  # fmt: skip


def sequence_model(scale: float, seed: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 32), nn.ReLU(), mt.Masksembles(32, N, scale, seed=seed, channel_axis=-1), nn.Linear(32, 5)
    )


class Branches(nn.Module):
    """Tensors read by several layers, next to an in-place activation and a +=."""

    def __init__(self, scale: float, seed: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 12, 3, padding=1)
        self.masks = mt.Masksembles2D(12, N, scale, seed=seed)
        self.conv2 = nn.Conv2d(12, 12, 1)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.masks(self.conv(x))  # read by three layers below
        c = self.relu(self.conv2(torch.relu(h) + torch.sigmoid(h)))
        c += h
        return self.fc(torch.flatten(self.pool(torch.tanh(c)), 1))


MODELS = {
    "mlp": (mlp, (12,)),
    "cnn2d": (cnn2d, (3, 8, 8)),
    "cnn1d": (cnn1d, (2, 8)),
    "cnn3d": (cnn3d, (1, 3, 3, 3)),
    "sequence": (sequence_model, (7, 6)),
    "resnet": (lambda s, seed: ResNetLike(s, seed, masks_on_skip=False), (3, 6, 6)),
    "resnet-masked-skip": (lambda s, seed: ResNetLike(s, seed, masks_on_skip=True), (3, 6, 6)),
    "branches": (Branches, (3, 5, 5)),
}


def build(name: str, scale: float, seed: int) -> tuple[nn.Module, tuple[int, ...]]:
    factory, shape = MODELS[name]
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    return randomize_norms(factory(scale, seed), generator), shape


@pytest.mark.parametrize(
    "seed,scale", list(enumerate([1.0, 1.7, 3.0, 50.0])), ids=lambda v: f"S{v}" if isinstance(v, float) else f"seed{v}"
)
@pytest.mark.parametrize("name", list(MODELS))
def test_pack_and_extract_equal_the_dense_model(name: str, seed: int, scale: float) -> None:
    model, shape = build(name, scale, seed)
    x = torch.randn(5, *shape, generator=torch.Generator().manual_seed(seed + 10))
    expected = mt.predict(model, x, N)
    packed = mt.pack(model, x, program="packed")
    assert relative_error(packed(x), expected) <= 1e-5
    other_batch = torch.randn(3, *shape)
    assert relative_error(packed(other_batch), mt.predict(model, other_batch, N)) <= 1e-5
    dense_parameters = sum(p.numel() for p in model.parameters())
    for k in range(N):
        member = mt.extract_member(model, k, x)
        assert relative_error(member(x), expected[k]) <= 1e-5
        assert sum(p.numel() for p in member.parameters()) <= dense_parameters


class Residual(nn.Module):
    """``x + branch(x)``, optionally ``+=`` in place on the branch's output."""

    def __init__(self, *layers: nn.Module, in_place: bool) -> None:
        super().__init__()
        self.branch, self.in_place = nn.Sequential(*layers), in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.branch(x)
        if self.in_place:
            y += x
            return y
        return x + y


ACTIVATIONS = (
    lambda: nn.ReLU(inplace=True), nn.GELU, nn.Tanh, nn.Sigmoid, lambda: nn.LeakyReLU(0.1), nn.SiLU, nn.Softplus,
)  # fmt: skip


def random_model(seed: int) -> tuple[nn.Module, tuple[int, ...]]:
    """A random CNN: conv blocks, residual blocks, masks and pools in random order, then a masked MLP head."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    scale = float(rng.choice([1.0, 1.5, 2.0, 4.0]))
    seeds = iter(range(100 * seed, 100 * seed + 100))

    def activation() -> nn.Module:
        return ACTIVATIONS[int(rng.integers(len(ACTIVATIONS)))]()

    def masks(channels: int, layer: type[mt.Masksembles] = mt.Masksembles2D) -> nn.Module:
        return layer(channels, N, scale, seed=next(seeds))

    spatial, channels = int(rng.integers(3, 7)), int(rng.integers(2, 5))
    shape = (channels, spatial, spatial)
    layers: list[nn.Module] = []
    for _ in range(int(rng.integers(2, 5))):
        choice = int(rng.integers(5))
        if choice == 0:
            out, stride = int(rng.integers(4, 13)), int(rng.integers(1, 3))
            after = [nn.BatchNorm2d(out), activation(), masks(out)]  # after the conv, in random order
            layers += [nn.Conv2d(channels, out, 3, stride, padding=1), *(after[i] for i in rng.permutation(3))]
            channels, spatial = out, -(-spatial // stride)
        elif choice == 1:
            branch = [nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), activation()]
            branch += [masks(channels), nn.Conv2d(channels, channels, 1)]
            layers.append(Residual(*branch, in_place=bool(rng.integers(2))))
        elif choice == 2:
            layers += [masks(channels), activation()]
        elif choice == 3:
            layers += [nn.BatchNorm2d(channels), nn.Dropout2d(0.5)]
        else:
            layers.append([nn.MaxPool2d, nn.AvgPool2d][int(rng.integers(2))](2, 2, ceil_mode=True))
            spatial = -(-spatial // 2)
    hidden = int(rng.integers(4, 17))
    features = spatial * spatial * channels
    head = [masks(features, mt.Masksembles1D)] if rng.random() < 0.5 else []
    layers += [nn.Flatten(), *head, nn.Linear(features, hidden), activation(), masks(hidden, mt.Masksembles1D)]
    layers.append(nn.Linear(hidden, 3))
    return randomize_norms(nn.Sequential(*layers), torch.Generator().manual_seed(seed)), shape


@pytest.mark.parametrize("seed", range(12), ids=lambda seed: f"seed{seed}")
def test_randomly_built_models(seed: int) -> None:
    model, shape = random_model(seed)
    x = torch.randn(4, *shape, generator=torch.Generator().manual_seed(seed))
    expected = mt.predict(model, x, N)
    assert relative_error(mt.pack(model, x, program="packed")(x), expected) <= 1e-5
    for k in range(N):
        assert relative_error(mt.extract_member(model, k, x)(x), expected[k]) <= 1e-5


@pytest.mark.parametrize(
    "dtype,tolerance", [(torch.float64, 1e-12), (torch.float16, 5e-3), (torch.bfloat16, 2e-2)], ids=str
)
def test_pack_in_other_dtypes(dtype: torch.dtype, tolerance: float) -> None:
    model, shape = build("resnet", 2.0, 0)
    model = model.to(dtype)
    x = torch.randn(5, *shape, dtype=dtype)
    packed = mt.pack(model, x, program="packed")(x)
    assert packed.dtype == dtype
    assert relative_error(packed.double(), mt.predict(model, x, N).double()) <= tolerance


def test_a_shared_layer_narrower_than_its_input() -> None:
    """Member 0 needs only the first two input channels before its mask; the pooled input is cut to them."""
    masks = torch.tensor([[1.0, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 1]])
    model = nn.Sequential(
        nn.MaxPool2d(2), nn.BatchNorm2d(3), mt.Masksembles2D(masks=masks), nn.Conv2d(3, 4, 1), nn.Flatten(),
        nn.Linear(16, 2),
    )  # fmt: skip
    model = randomize_norms(model, torch.Generator().manual_seed(0))
    x = torch.randn(5, 3, 4, 4)
    expected = mt.predict(model, x, N)
    for k in range(N):
        assert relative_error(mt.extract_member(model, k, x)(x), expected[k]) <= 1e-5


def test_extracted_member_is_physically_smaller() -> None:
    model, _ = build("mlp", 2.0, 0)
    member = mt.extract_member(model, 0, torch.randn(2, 12))
    linears = [m for m in member.modules() if isinstance(m, nn.Linear)]
    ones = [int(layer.masks[0].sum()) for layer in model if isinstance(layer, mt.Masksembles)]
    assert [(lin.in_features, lin.out_features) for lin in linears] == [(12, ones[0]), (ones[0], ones[1]), (ones[1], 3)]


def test_packed_module_compiles() -> None:
    model, shape = build("resnet", 2.0, 0)
    x = torch.randn(4, *shape)
    packed = mt.pack(model, x, program="packed")
    compiled = torch.compile(packed, fullgraph=True)
    assert relative_error(compiled(x), mt.predict(model, x, N)) <= 1e-5


def test_packed_forward_leaves_its_input_alone_and_repeats() -> None:
    for model, shape in (
        build("branches", 2.0, 0),
        (
            nn.Sequential(nn.ReLU(inplace=True), nn.Linear(12, 16), mt.Masksembles1D(16, N, 2.0), nn.Linear(16, 2)),
            (12,),
        ),
    ):
        x = torch.randn(6, *shape)
        before = x.clone()
        packed = mt.pack(model.eval(), x, program="packed")
        first = packed(x).clone()
        assert torch.equal(x, before)
        assert torch.equal(packed(x), first)
        assert relative_error(first, mt.predict(model, x, N)) <= 1e-5


def test_packing_a_model_in_training_mode_gives_eval_semantics() -> None:
    model, shape = build("mlp", 2.0, 0)
    model.train()
    x = torch.randn(6, *shape)
    packed = mt.pack(model, x, program="packed")
    assert torch.equal(packed(x), packed(x)), "Dropout must be off in the packed model"
    assert relative_error(packed(x), mt.predict(model, x, N)) <= 1e-5


def test_pack_keeps_the_model_mode_and_weights() -> None:
    model, shape = build("cnn2d", 2.0, 0)
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    mt.pack(model, torch.randn(4, *shape))
    assert model.training
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), "packing must not touch BatchNorm statistics"


@pytest.mark.parametrize(
    "model,message",
    [
        (nn.Sequential(nn.Linear(4, 8), nn.ReLU()), "no Masksembles layer"),
        (
            nn.Sequential(nn.Linear(4, 8), mt.Masksembles1D(8, 2, 2.0), nn.Linear(8, 8), mt.Masksembles1D(8, 3, 2.0)),
            r"the same n; found \[2, 3\]",
        ),
    ],
    ids=["no-masks", "mixed-n"],
)
def test_models_that_cannot_pack(model: nn.Module, message: str) -> None:
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match=message):
        mt.pack(model, x)
    with pytest.raises(ValueError, match=message):
        mt.extract_member(model, 0, x)


def test_member_out_of_range() -> None:
    model, _ = build("mlp", 2.0, 0)
    with pytest.raises(ValueError, match=r"member must be an integer in \[0, 4\); received 4"):
        mt.extract_member(model, 4, torch.randn(2, 12))
