"""insert: Masksembles on the input of chosen layers of torchvision/timm-style models, every weight kept."""

from __future__ import annotations

import io
import math
from typing import cast

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import masksembles_core as mc
import masksembles_torch as mt
from masksembles_core.insertion import INSERTED, LEFT
from tests.torch import zoo

N = 4
DEPTHWISE = "depthwise convolution: each output channel reads one input channel (before=... includes it)"
INSIDE_ATTENTION = "part of MultiheadAttention, which may use its weights without calling it"
FIRST = "the network's first layer: it reads the raw input (include_first=True masks it)"
# Layers each model keeps unmasked with the default arguments (the network's first layer aside).
LEFT_ALONE = {
    "mobilenet_v3": {f"features.{i}.block.{j}.0": DEPTHWISE for i, j in ((1, 0), (2, 1), (3, 1), (4, 1))},
    "efficientnet": {f"features.{i}.block.{j}.0": DEPTHWISE for i, j in ((1, 0), (2, 1), (3, 1))},
    "efficientnet_drop_path": {f"features.{i}.block.{j}.0": DEPTHWISE for i, j in ((1, 0), (2, 1), (3, 1))},
    "convnext": {f"stages.{i}.conv_dw": DEPTHWISE for i in ("0.0", "1.1")},
    "vit_torch": {f"blocks.{i}.self_attention.out_proj": INSIDE_ATTENTION for i in (0, 1)},
}


def narrow(channels: int, n: int = N, scale: float = 2.0) -> str | None:
    """The reason insert leaves a layer with too few input channels for n distinct masks, or None."""
    ones = mc.ones_per_mask(channels, n, scale)
    distinct = math.comb(channels, ones)
    if distinct >= n:
        return None
    return (
        f"{channels} input channels: only {distinct} distinct masks of {ones} ones exist, fewer than n={n} "
        "(members would share masks)"
    )


def narrow_layers(model: nn.Module) -> dict[str, str]:
    """The convolution and linear layers of ``model`` that are too narrow for n distinct masks, with the reason."""
    found = {}
    for path, module in model.named_modules():
        channels = getattr(module, "in_channels", getattr(module, "in_features", None))
        groups = getattr(module, "groups", 1)
        if isinstance(module, (nn.Conv2d, nn.Linear)) and channels not in (None, groups) and narrow(channels):
            found[path] = cast(str, narrow(channels))
    return found


FIRST_LAYER = {
    "mobilenet_v3": "features.0.0",
    "efficientnet": "features.0.0",
    "efficientnet_drop_path": "features.0.0",
    "convnext": "stem.0",
    "vit": "patch_embed",
    "vit_fused": "patch_embed",
    "vit_torch": "patch_embed",
}


def masked_layers(model: nn.Module) -> dict[str, mt.Masked]:
    return {path: module for path, module in model.named_modules() if isinstance(module, mt.Masked)}


@pytest.mark.parametrize("name", list(zoo.BUILDERS))
def test_masks_go_before_every_conv_and_linear_layer_but_the_reported_ones(name: str) -> None:
    model = zoo.build(name)
    inserted = mt.insert(model, N, 2.0, seed=3)
    report = inserted.masksembles_report
    assert report.operation == "insert" and (report.n, report.scale) == (N, 2.0)
    layers = [path for path, m in model.named_modules() if isinstance(m, nn.Conv2d | nn.Linear)]
    assert [row.path for row in report.rows] == layers, "one row per conv/linear layer, in named_modules order"
    expected_left = {**narrow_layers(model), FIRST_LAYER.get(name, "conv1"): FIRST, **LEFT_ALONE.get(name, {})}
    assert {row.path: row.reason for row in report.unchanged} == expected_left
    assert set(masked_layers(inserted)) == {row.path for row in report.changed}
    assert not masked_layers(model), "the input model is not modified"
    for index, row in enumerate(report.changed):
        wrapper = inserted.get_submodule(row.path)
        original = model.get_submodule(row.path)
        conv = isinstance(original, nn.Conv2d)
        expected_row = (INSERTED, original.in_channels if conv else original.in_features, 1 if conv else -1)
        assert (row.action, row.channels, row.channel_axis) == expected_row
        assert row.seed == mc.derive_seed(3, index)
        expected = torch.as_tensor(mc.generate_masks(row.channels, N, 2.0, seed=row.seed), dtype=torch.float32)
        assert torch.equal(wrapper.masksembles.masks, expected)
        assert wrapper.masksembles.channel_axis == row.channel_axis
        assert type(wrapper.layer) is type(original)


@pytest.mark.parametrize("name", list(zoo.BUILDERS))
def test_weights_are_kept_and_scale_1_gives_the_original_outputs(name: str) -> None:
    model = zoo.build(name)
    x = zoo.images(6)
    single = mt.insert(model, N, 1.0, seed=0)  # all-ones masks: exactly the original network
    assert torch.equal(single(x), model(x))
    original = model.state_dict()
    for key, value in single.state_dict().items():
        if not key.endswith(".masksembles.masks"):
            assert torch.equal(value, original[key.replace(".layer.", ".")]), key
    inserted = mt.insert(model, N, 2.0, seed=0)
    members = mt.predict(inserted, x, N)
    assert members.shape == (N, 6, zoo.CLASSES)
    assert not torch.allclose(members[0], members[1]), "members differ"
    assert inserted(x).shape == (6, zoo.CLASSES)


@pytest.mark.parametrize("name", list(zoo.BUILDERS))
def test_fx_symbolic_trace(name: str) -> None:
    inserted = mt.insert(zoo.build(name), N, 2.0, seed=0)
    traced = fx.symbolic_trace(inserted)
    for batch in (8, 6):
        x = zoo.images(batch, seed=batch)
        torch.testing.assert_close(traced(x), inserted(x), rtol=0, atol=0)
    assert any(node.target is mt._layers.masksembles for node in traced.graph.nodes), "one node per Masksembles"


def test_start_include_first_and_resnext_grouped_convolutions() -> None:
    model = zoo.build("resnext")
    report = mt.insert(model, N, 2.0, seed=0, start="layer3").masksembles_report
    assert [row.path for row in report.changed] == [
        "layer3.0.conv1", "layer3.0.conv2", "layer3.0.conv3", "layer3.0.downsample.0",
        "layer4.0.conv1", "layer4.0.conv2", "layer4.0.conv3", "layer4.0.downsample.0", "fc",
    ]  # fmt: skip
    assert {row.reason for row in report.unchanged if row.path != "conv1"} == {"before start='layer3'"}
    grouped = report.changed[1]
    assert model.get_submodule(grouped.path).groups == 2
    assert grouped.channels == model.get_submodule(grouped.path).in_channels, "masks over all input channels"
    report = mt.insert(model, N, 2.0, seed=0, include_first=True).masksembles_report
    assert (report.rows[0].path, report.rows[0].reason) == ("conv1", narrow(3)), "RGB: 3 distinct masks at most"
    report = mt.insert(model, 3, 2.0, seed=0, include_first=True).masksembles_report
    assert (report.rows[0].path, report.rows[0].action, report.rows[0].channels) == ("conv1", INSERTED, 3)
    with pytest.raises(ValueError, match="start='layer9' names no layer of the model; its top-level layers are"):
        mt.insert(model, N, 2.0, start="layer9")


def test_before_chooses_by_type_or_by_predicate() -> None:
    vit = zoo.build("vit")
    report = mt.insert(vit, N, 2.0, seed=0, before=(nn.Linear,)).masksembles_report
    assert all(row.layer == "Linear" and row.action == INSERTED for row in report.rows), "patch_embed is no Linear"
    assert len(report.rows) == 9
    mobilenet = zoo.build("mobilenet_v3")
    report = mt.insert(mobilenet, N, 2.0, seed=0, before=nn.Conv2d).masksembles_report
    expected = {**narrow_layers(mobilenet), "features.0.0": FIRST}
    assert {row.path: row.reason for row in report.unchanged} == expected, "explicit types include depthwise convs"
    depthwise = mobilenet.get_submodule("features.2.block.1.0")
    assert {row.path: row.channels for row in report.changed}["features.2.block.1.0"] == depthwise.in_channels
    resnet = zoo.build("resnet_basic")
    in_layer4 = lambda path, m: path.startswith("layer4") and hasattr(m, "in_channels")  # noqa: E731
    inserted = mt.insert(resnet, N, 2.0, seed=0, before=in_layer4)
    assert set(masked_layers(inserted)) == {"layer4.0.conv1", "layer4.0.conv2", "layer4.0.downsample.0"}
    only_head = mt.insert(resnet, N, 2.0, seed=0, before=lambda path, m: path == "fc")
    assert [row.path for row in only_head.masksembles_report.changed] == ["fc"], "the head reads no raw input"
    language = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 50))
    report = mt.insert(language, N, 2.0, seed=0).masksembles_report
    assert [row.path for row in report.changed] == ["1", "3"], "the embedding reads the raw input, not the Linear"
    containers = mt.insert(resnet, N, 2.0, seed=0, before=lambda path, m: path in ("layer1", "fc"))
    assert containers.masksembles_report.unchanged[0].reason == (
        "no in_channels or in_features to read its input channels from"
    )
    with pytest.raises(TypeError, match="before must be module types or a predicate"):
        mt.insert(resnet, N, 2.0, before=("Conv2d",))


class ImageAndFeatures(nn.Module):
    """Two inputs; the head is registered first, so it comes first in ``named_modules`` order."""

    def __init__(self, branch_on_data: bool = False) -> None:
        super().__init__()
        self.head = nn.Linear(16, 3)
        self.image = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.AdaptiveAvgPool2d(1))
        self.features = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8))
        self.branch_on_data = branch_on_data

    def forward(self, image: torch.Tensor, features: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        if self.branch_on_data and bool(features.sum() > 0):  # data-dependent: torch.fx cannot trace it
            features = -features
        pooled = self.image(image).flatten(1)
        return self.head(torch.cat([pooled, self.features(features * scale)], dim=1))


def test_every_layer_that_reads_a_forward_input_is_a_first_layer() -> None:
    model = ImageAndFeatures()
    report = mt.insert(model, 2, 2.0, seed=0).masksembles_report
    assert [(row.path, row.action, row.reason) for row in report.rows] == [
        ("head", INSERTED, ""),
        ("image.0", LEFT, FIRST),
        ("image.2", INSERTED, ""),
        ("features.0", LEFT, FIRST),
        ("features.2", INSERTED, ""),
    ]
    included = mt.insert(model, 2, 2.0, seed=0, include_first=True)
    assert [row.action for row in included.masksembles_report.rows] == [INSERTED] * 5
    image, features = torch.randn(4, 3, 8, 8), torch.randn(4, 5)
    for inserted in (mt.insert(model, 2, 2.0, seed=0), included):
        with torch.no_grad():
            members = mt.untile(inserted.eval()(mt.tile(image, 2), mt.tile(features, 2)), 2)
        assert members.shape == (2, 4, 3) and not torch.allclose(members[0], members[1])
    with pytest.warns(UserWarning, match=r"could not trace the model .*: pass example_input= to check the new model"):
        untraceable = mt.insert(ImageAndFeatures(branch_on_data=True), 2, 2.0, seed=0).masksembles_report
    assert [row.path for row in untraceable.unchanged] == ["head"], "torch.fx fails: the first in named_modules order"


class TokensAndMask(nn.Module):
    """``forward(input_ids, attention_mask)``, traceable: the mask joins the attention scores and the pooling, so
    ``out`` and ``head`` read it through no other layer, but always with other layers' results."""

    def __init__(self, mask_features: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.q, self.k, self.v, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.mask_features = nn.Linear(1, 8) if mask_features else None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        if self.mask_features is not None:  # a layer on the mask alone
            h = h + self.mask_features(attention_mask.unsqueeze(-1).to(h.dtype))
        scores = self.q(h) @ self.k(h).transpose(1, 2) / math.sqrt(h.size(-1))
        scores = scores + (1.0 - attention_mask[:, None, :].to(h.dtype)) * -1e4
        h = h + self.out(scores.softmax(-1) @ self.v(h))
        weights = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * weights).sum(1) / weights.sum(1))


def test_layers_the_mask_reaches_with_other_layers_results_are_not_first_layers() -> None:
    """They were reported as the network's first layers and left alone, as if they read the raw input."""
    report = mt.insert(TokensAndMask(), N, 2.0, seed=0).masksembles_report
    assert [(row.path, row.action) for row in report.rows] == [
        ("q", INSERTED), ("k", INSERTED), ("v", INSERTED), ("out", INSERTED), ("head", INSERTED)
    ]  # fmt: skip
    with_mask_layer = mt.insert(TokensAndMask(mask_features=True), N, 2.0, seed=0).masksembles_report
    assert [(row.path, row.reason) for row in with_mask_layer.unchanged] == [("mask_features", FIRST)], (
        "a layer reading another input alone is a first layer, whatever that input holds"
    )
    assert [row.path for row in with_mask_layer.changed] == ["q", "k", "v", "out", "head"]
    model = mt.insert(TokensAndMask(), 2, 2.0, seed=0).eval()
    tokens = torch.randint(0, 20, (3, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    members = mt.predict(model, (tokens, mask), 2)
    assert members.shape == (2, 3, 3) and not torch.allclose(members[0], members[1])


def test_seeds_are_reproducible() -> None:
    model = zoo.build("resnet_basic")
    a, b = mt.insert(model, N, 2.0, seed=5), mt.insert(model, N, 2.0, seed=5)
    c = mt.insert(model, N, 2.0, seed=6)
    for path, layer in masked_layers(a).items():
        assert torch.equal(layer.masksembles.masks, b.get_submodule(path).masksembles.masks)
    assert any(
        not torch.equal(layer.masksembles.masks, c.get_submodule(path).masksembles.masks)
        for path, layer in masked_layers(a).items()
    )
    fresh = mt.insert(model, N, 2.0)  # seed=None: the report records the seeds drawn
    for row in fresh.masksembles_report.changed:
        expected = mc.generate_masks(row.channels, N, 2.0, seed=row.seed)
        assert torch.equal(fresh.get_submodule(row.path).masksembles.masks, torch.as_tensor(expected).float())


def test_state_dict_round_trip_and_checkpoint_keys() -> None:
    model = zoo.build("resnet_bottleneck")
    inserted = mt.insert(model, N, 2.0, seed=0, start="layer3")
    state = inserted.state_dict()
    assert {"layer3.0.conv1.masksembles.masks", "layer3.0.conv1.layer.weight", "fc.layer.bias"} <= set(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    rebuilt = mt.insert(zoo.build("resnet_bottleneck", seed=1), N, 2.0, seed=99, start="layer3")
    rebuilt.load_state_dict(torch.load(buffer, weights_only=True))
    x = zoo.images(8)
    assert torch.equal(mt.predict(rebuilt, x, N), mt.predict(inserted, x, N)), "masks are loaded, not regenerated"


def test_the_wrapper() -> None:
    inserted = mt.insert(zoo.build("resnet_basic"), N, 2.0, seed=0)
    fc = inserted.fc
    assert isinstance(fc, mt.Masked) and fc.layer.in_features == 64
    with pytest.raises(
        AttributeError, match=r"'Masked' object has no attribute 'in_features'; .* read \.layer\.in_features"
    ):
        fc.in_features  # noqa: B018
    with pytest.raises(AttributeError, match=r"^'Masked' object has no attribute 'nothing'$"):
        fc.nothing  # noqa: B018
    assert not hasattr(fc, "weight")
    assert "(masksembles): Masksembles(64, n=4, scale=2.0, mode='grouped', channel_axis=-1)" in repr(fc)
    assert "(layer): Linear(in_features=64, out_features=10, bias=True)" in repr(fc)
    assert "insert: Masksembles n=4, scale=2 on 14 of 15 layers" in str(inserted.masksembles_report)
    # further arguments go to the layer
    transposed = mt.Masked(mt.Masksembles(4, 2, 2.0, seed=0), nn.ConvTranspose2d(4, 3, 3, stride=2))
    assert transposed(torch.randn(2, 4, 5, 5), output_size=(12, 12)).shape == (2, 3, 12, 12)


def test_left_alone_with_reasons() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(6, 8)
            self.shared = nn.Linear(8, 8)
            self.again = self.shared
            self.lazy = nn.LazyLinear(5)
            self.narrow = nn.Linear(1, 4)
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.again(self.shared(self.stem(x)))
            return self.head(h) + self.lazy(h).sum() + self.narrow(h[:, :1]).sum()

    report = mt.insert(Net(), N, 2.0, seed=0).masksembles_report
    assert {row.path: row.reason for row in report.unchanged} == {
        "stem": FIRST,
        "shared": "one module registered at 2 paths (shared, again)",
        "lazy": "lazy module not initialized: run one forward pass first",
        "narrow": "a single input channel: every mask would keep it",
    }
    assert [row.path for row in report.changed] == ["head"]
    twice = mt.insert(mt.insert(zoo.build("resnet_basic"), 3, 2.0, seed=0), 3, 2.0, include_first=True)
    assert [row.path for row in twice.masksembles_report.changed] == ["conv1"]
    assert {row.reason for row in twice.masksembles_report.unchanged} == {
        "already masked: the layer of a Masked wrapper"
    }
    with pytest.raises(ValueError, match=r"(?s)insert found no layer to put masks before.*first layer"):
        mt.insert(nn.Sequential(nn.Linear(3, 4)), N, 2.0)
    with pytest.raises(ValueError, match=r"scale must be a finite real number >= 1; received 0\.5"):
        mt.insert(Net(), N, 0.5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_masks_follow_the_layer_dtype_and_inplace(dtype: torch.dtype) -> None:
    model = zoo.build("vit").to(dtype)
    result = mt.insert(model, N, 2.0, seed=0, inplace=True)
    assert result is model and masked_layers(model)
    assert {layer.masksembles.masks.dtype for layer in masked_layers(model).values()} == {dtype}
    assert model(zoo.images(4).to(dtype)).dtype == dtype


def test_torch_compile_fullgraph() -> None:
    inserted = mt.insert(zoo.build("resnet_basic"), N, 2.0, seed=0)
    compiled = torch.compile(inserted, fullgraph=True, dynamic=True)
    for batch in (8, 6):
        x = zoo.images(batch)
        torch.testing.assert_close(compiled(x), inserted(x), rtol=1e-5, atol=1e-5)


def test_torch_export_with_dynamic_batch() -> None:
    inserted = mt.insert(zoo.build("mobilenet_v3"), N, 2.0, seed=0)
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(inserted, (zoo.images(8),), dynamic_shapes=({0: batch},)).module()
    for size in (8, 6, 3):
        x = zoo.images(size, seed=size)
        torch.testing.assert_close(program(x), inserted(x), rtol=1e-5, atol=1e-5)


class ShiftedWindowAttention(nn.Module):
    """torchvision's Swin attention in small: it never calls ``qkv`` or ``proj``, it runs ``F.linear`` on their
    weights (torchvision's ``shifted_window_attention``), on windows folded into the batch, shifted by ``roll``, with
    a relative position bias."""

    def __init__(self, dim: int, heads: int, window: int, shift: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.heads, self.window, self.shift = heads, window, shift
        self.bias_table = nn.Parameter(0.02 * torch.randn((2 * window - 1) ** 2, heads))
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + window - 1
        self.register_buffer("bias_index", relative[..., 0] * (2 * window - 1) + relative[..., 1], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, H, W, C) -> (B, H, W, C)
        batch, height, width, dim = x.shape
        w, heads = self.window, self.heads
        x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
        x = x.view(batch, height // w, w, width // w, w, dim).permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, dim)
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias)
        q, k, v = qkv.reshape(x.size(0), w * w, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
        bias = self.bias_table[self.bias_index].permute(2, 0, 1)
        attention = (q * (dim // heads) ** -0.5) @ k.transpose(-2, -1) + bias
        x = (attention.softmax(-1) @ v).transpose(1, 2).reshape(x.size(0), w * w, dim)
        x = F.linear(x, self.proj.weight, self.proj.bias)
        x = x.view(batch, height // w, width // w, w, w, dim).permute(0, 1, 3, 2, 4, 5)
        x = x.reshape(batch, height, width, dim)
        return torch.roll(x, shifts=(self.shift, self.shift), dims=(1, 2))


class SwinBlock(nn.Module):
    def __init__(self, dim: int, shift: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = ShiftedWindowAttention(dim, heads=2, window=2, shift=shift)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinySwin(nn.Module):
    def __init__(self, branch_on_data: bool = False) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, 16, 2, stride=2)
        self.blocks = nn.Sequential(SwinBlock(16, shift=0), SwinBlock(16, shift=1))
        self.head = nn.Linear(16, zoo.CLASSES)
        self.branch_on_data = branch_on_data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.branch_on_data and bool(x.sum() > 0):  # data-dependent: torch.fx cannot trace it
            x = -x
        x = self.blocks(self.patch_embed(x).permute(0, 2, 3, 1))
        return self.head(x.mean((1, 2)))


SWIN_READS = {
    f"blocks.{block}.attn.{layer}": (
        f"its weights (weight, bias) are used by 'blocks.{block}.attn' (ShiftedWindowAttention) outside its own "
        "call: a mask on its input would not apply there"
    )
    for block in (0, 1)
    for layer in ("qkv", "proj")
}


@pytest.mark.parametrize("found_by", ["torch.fx", "example_input"])
def test_layers_whose_weights_the_model_reads_are_left_alone_and_the_model_works(found_by: str) -> None:
    """torchvision's swin_t: insert used to wrap qkv/proj, and training, predict, state_dict and pack all failed."""
    torch.manual_seed(0)
    model = TinySwin(branch_on_data=found_by == "example_input")
    x = torch.randn(6, 3, 8, 8)
    inserted = mt.insert(model, N, 2.0, seed=0, example_input=x if found_by == "example_input" else None)
    report = inserted.masksembles_report
    assert {row.path: row.reason for row in report.unchanged} == {"patch_embed": FIRST, **SWIN_READS}
    assert [row.path for row in report.changed] == [f"blocks.{i}.mlp.{j}" for i in (0, 1) for j in (0, 2)] + ["head"]
    assert [row.seed for row in report.changed] == [mc.derive_seed(0, i) for i in range(5)], "seeds as planned"
    assert type(inserted.blocks[0].attn.qkv) is nn.Linear
    optimizer = torch.optim.SGD(inserted.parameters(), lr=0.1)
    loss = F.cross_entropy(inserted.train()(x), torch.arange(6) % zoo.CLASSES)
    loss.backward()
    optimizer.step()
    assert inserted.blocks[0].attn.qkv.weight.grad is not None
    members = mt.predict(inserted, x, N)
    assert members.shape == (N, 6, zoo.CLASSES) and not torch.allclose(members[0], members[1])
    rebuilt = mt.insert(TinySwin(branch_on_data=found_by == "example_input"), N, 2.0, seed=1, example_input=x)
    rebuilt.load_state_dict(inserted.state_dict())
    assert torch.equal(mt.predict(rebuilt, x, N), members), "state_dict round trip, masks included"
    if found_by == "torch.fx":  # pack traces the model
        torch.testing.assert_close(mt.pack(inserted, x, program="packed")(x), members, rtol=1e-5, atol=1e-5)


class ReadsThroughTheWrapper(nn.Module):
    """Untraceable, and its code breaks on a wrapper in ways torch.fx cannot show: it reads the head's weights for a
    penalty and the hidden layer's width; it calls ``out`` with the input by keyword, which Masked takes."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.hidden, self.mix = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.head, self.out = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mix(self.hidden(self.stem(x))[:, : self.hidden.out_features]).relu()
        if bool(h.sum() > -1e9):  # data-dependent: torch.fx cannot trace it
            h = h + self.head.weight.norm()
        return self.out(input=self.head(h))


def test_example_input_run_leaves_alone_the_layers_the_model_cannot_keep() -> None:
    model = ReadsThroughTheWrapper()
    x = torch.randn(6, 5)
    inserted = mt.insert(model, 2, 2.0, seed=0, example_input=x)
    reasons = {row.path: row.reason for row in inserted.masksembles_report.unchanged}
    assert reasons == {
        "stem": FIRST,
        "hidden": "its attributes (out_features) are read by the model's forward, and Masked does not forward them",
        "head": (
            "its weights (weight) are used by the model's forward outside its own call: a mask on its input would "
            "not apply there"
        ),
    }
    assert [row.path for row in inserted.masksembles_report.changed] == ["mix", "out"]
    masked_out = inserted.out
    h = torch.randn(6, 8)
    with mt.recorded_call(inserted, h):  # in training, a layer called alone is refused outside the model's call
        assert torch.equal(masked_out(input=h), masked_out(h)), "the input by keyword is masked too"
    assert inserted.training and all(module.training for module in inserted.modules()), "modes restored"
    assert mt.predict(inserted, x, 2).shape == (2, 6, 2)
    with pytest.warns(UserWarning, match="could not trace the model"):
        blind = mt.insert(model, 2, 2.0, seed=0)
    with pytest.raises(AttributeError, match=r"does not forward attributes to its Linear: read \.layer\.out_features"):
        blind(x)


def test_a_model_that_fails_on_example_input_is_an_error_and_inplace_is_restored() -> None:
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"insert: the model fails on example_input without masks \(RuntimeError"):
        mt.insert(model, 2, 2.0, seed=0, example_input=torch.randn(6, 4), inplace=True)
    assert not masked_layers(model), "the model is left as it was"
    batch_norm = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    state = {key: value.clone() for key, value in batch_norm.state_dict().items()}
    inserted = mt.insert(batch_norm, 2, 2.0, seed=0, example_input=torch.randn(6, 5), inplace=True)
    assert masked_layers(inserted) and inserted[1].training, "the run is in eval mode; modes are restored"
    for key, value in state.items():
        assert torch.equal(inserted.state_dict()[key.replace("2.", "2.layer.")], value), key
