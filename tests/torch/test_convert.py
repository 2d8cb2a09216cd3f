"""convert_dropout: channel dropouts become Masksembles on the right axis; the others are left and reported."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import masksembles_core as mc
import masksembles_torch as mt
from masksembles_core.insertion import CONVERTED, LEFT
from tests.torch import zoo

N = 4
P0 = "p=0: it does nothing"
PER_SAMPLE = "per-sample dropout (stochastic depth): it drops whole samples, not channels"
ATTN_DROP = "attention-weight dropout (named 'attn_drop'): its input is attention weights, not channels"
SOFTMAX = "attention-weight dropout: its input is a softmax output, not channels"
NOT_REACHED = "not reached by the example input"
FIRST = "the network's first layer: it reads the raw input (include_first=True masks it)"


def decisions(model: nn.Module) -> dict[str, tuple[str, int | None, int | None, str]]:
    return {row.path: (row.action, row.channels, row.channel_axis, row.reason) for row in model.masksembles_report.rows}


class Net(nn.Module):
    """Every dropout module kind, on 2-D, 3-D, 4-D and 5-D features."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Dropout2d(0.2), nn.Identity())
        self.sequence = nn.Sequential(nn.Conv1d(4, 6, 1), nn.Dropout1d(0.1))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 32), nn.Dropout(0.5), nn.Linear(32, 3))
        self.block3d = nn.Sequential(nn.Conv3d(1, 5, 1), nn.Dropout3d(0.3))

    def forward(self, x: torch.Tensor, seq: torch.Tensor, vol: torch.Tensor) -> torch.Tensor:
        y = self.head(self.features(x))
        return y + self.sequence(seq).mean() + self.block3d(vol).mean()


def example(batch: int = 4) -> tuple[torch.Tensor, ...]:
    return torch.randn(batch, 3, 6, 6), torch.randn(batch, 4, 7), torch.randn(batch, 1, 2, 2, 2)


def test_replaces_every_dropout_module_with_right_channels_and_keeps_weights() -> None:
    torch.manual_seed(0)
    model = Net()
    converted = mt.convert_dropout(model, example(), n=N, scale=2.0, seed=11)
    assert any(isinstance(m, nn.Dropout2d) for m in model.modules()), "the original is untouched by default"
    assert type(converted) is Net
    layers = {name: m for name, m in converted.named_modules() if isinstance(m, mt.Masksembles)}
    assert {name: (m.channels, m.channel_axis) for name, m in layers.items()} == {
        "features.2": (8, 1),
        "sequence.1": (6, 1),
        "head.2": (32, -1),
        "block3d.1": (5, 1),
    }
    assert [(row.path, row.action) for row in converted.masksembles_report.rows] == [
        (path, CONVERTED) for path in layers
    ]
    assert not any(isinstance(m, nn.modules.dropout._DropoutNd) for m in converted.modules())
    original_state = model.state_dict()
    for key, value in converted.state_dict().items():
        if not key.endswith("masks"):
            assert torch.equal(value, original_state[key]), key
    for index, layer in enumerate(layers.values()):
        expected = mc.generate_masks(layer.channels, N, 2.0, seed=mc.derive_seed(11, index))
        assert torch.equal(layer.masks, torch.as_tensor(expected, dtype=torch.float32))
    again = mt.convert_dropout(model, example(), n=N, scale=2.0, seed=11)
    for a, b in zip(layers.values(), (m for m in again.modules() if isinstance(m, mt.Masksembles)), strict=True):
        assert torch.equal(a.masks, b.masks), "deterministic seeds per layer"
    for batch in (8, 6):  # batches that n does and does not divide, in training and in eval
        assert converted.train()(*example(batch)).shape == (batch, 3)
        assert converted.eval()(*example(batch)).shape == (batch, 3)


@pytest.mark.parametrize(
    "producer,x,expected",
    [
        (nn.Conv1d(4, 6, 3), torch.randn(2, 4, 9), (6, 1)),  # (B, C, L): the channels, not the length
        (nn.Conv2d(3, 10, 1), torch.randn(2, 3, 7, 5), (10, 1)),
        (nn.Conv3d(2, 5, 1), torch.randn(2, 2, 3, 3, 3), (5, 1)),
        (nn.Linear(5, 12), torch.randn(3, 9, 5), (12, -1)),  # (B, L, C) sequence
        (nn.Linear(5, 12), torch.randn(3, 5), (12, -1)),
        (nn.Embedding(20, 7), torch.randint(0, 20, (2, 9)), (7, -1)),
        (nn.BatchNorm1d(6), torch.randn(2, 6, 9), (6, 1)),
    ],
    ids=["conv1d", "conv2d", "conv3d", "linear-sequence", "linear", "embedding", "batchnorm1d"],
)
def test_the_channel_axis_of_nn_dropout_comes_from_the_producing_layer(
    producer: nn.Module, x: torch.Tensor, expected: tuple[int, int]
) -> None:
    model = nn.Sequential(producer, nn.GELU(), nn.Dropout(0.2))  # found through the elementwise GELU
    # after a BatchNorm of the raw input the dropout reads that input: include_first converts it
    converted = mt.convert_dropout(model, x, N, 2.0, seed=0, include_first=isinstance(producer, nn.BatchNorm1d))
    assert (converted[2].channels, converted[2].channel_axis) == expected
    assert decisions(converted)["2"] == (CONVERTED, *expected, "")
    assert "channel_axis=" + str(expected[1]) in repr(converted[2])


def test_recurrent_and_attention_outputs_have_channels_last() -> None:
    class Sequence(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(4, 6, batch_first=True)
            self.drop = nn.Dropout(0.3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y, _ = self.lstm(x)
            return self.drop(y)

    converted = mt.convert_dropout(Sequence(), torch.randn(2, 5, 4), N, 2.0, seed=0)
    assert decisions(converted)["drop"] == (CONVERTED, 6, -1, "")
    vit = mt.convert_dropout(zoo.build("vit_torch"), zoo.images(4), N, 2.0, seed=0)
    assert decisions(vit)["blocks.0.dropout"] == (CONVERTED, 16, -1, ""), "nn.MultiheadAttention output"


def test_functional_dropout_in_a_timm_style_head_is_converted() -> None:
    model = zoo.build("efficientnet")
    x = zoo.images(8)
    converted = mt.convert_dropout(model, x, N, 2.0, seed=0)
    assert isinstance(converted, fx.GraphModule), "its own forward calls F.dropout"
    assert type(converted).__name__ == "EfficientNet"
    assert converted.features is not model.features and type(converted.features) is nn.Sequential
    assert isinstance(converted.dropout, mt.Masksembles) and converted.dropout.channels == 48
    rows = decisions(converted)
    assert rows["dropout"] == (CONVERTED, 48, -1, "")
    assert {path: row[3] for path, row in rows.items() if row[0] == LEFT} == {
        f"features.{i}.stochastic_depth": PER_SAMPLE for i in (1, 2, 3)
    }
    assert mt.predict(converted, x, N).shape == (N, 8, zoo.CLASSES)
    assert not any(node.target is F.dropout for node in converted.graph.nodes)
    unmasked = mt.convert_dropout(model, x, N, 1.0, seed=0)  # all-ones masks: the original network
    assert torch.equal(unmasked(x), model(x))


def test_functional_dropout_in_a_submodule_with_arguments() -> None:
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 3)
            self.dropout = 0.5  # the layer's attribute gets another name

        def forward(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
            x = F.dropout(x, p=self.dropout, training=self.training)
            return x if pre_logits else self.fc(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(3, 8, 3)
            self.drop = nn.Dropout(0.3)
            self.head = Head()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.drop(self.conv(x).relu()).mean(-1))

    model = Model().eval()
    converted = mt.convert_dropout(model, torch.randn(4, 3, 10), N, 2.0, seed=0)
    assert type(converted) is Model and type(converted.head).__name__ == "Head", "only the head is traced"
    assert isinstance(converted.head, fx.GraphModule) and converted.head.fc is not model.head.fc
    assert decisions(converted) == {
        "drop": (CONVERTED, 8, 1, ""),
        "head.dropout_masks": (CONVERTED, 8, -1, ""),
    }
    x = torch.randn(6, 3, 10)
    expected = model.head.fc(converted.head.dropout_masks(converted.drop(model.conv(x).relu()).mean(-1)))
    torch.testing.assert_close(converted(x), expected, rtol=0, atol=0)


def test_convnext_p0_dropouts_and_drop_path_are_left_alone() -> None:
    model = zoo.build("convnext")
    x = zoo.images(6)
    converted = mt.convert_dropout(model, x, N, 2.0, seed=0)
    rows = decisions(converted)
    assert rows.pop("head.drop") == (CONVERTED, 16, -1, "")
    assert rows == {
        "stages.0.0.mlp.drop1": (LEFT, None, None, P0),
        "stages.0.0.mlp.drop2": (LEFT, None, None, P0),
        "stages.0.0.drop_path": (LEFT, None, None, PER_SAMPLE),
        "stages.1.1.mlp.drop1": (LEFT, None, None, P0),
        "stages.1.1.mlp.drop2": (LEFT, None, None, P0),
        "stages.1.1.drop_path": (LEFT, None, None, PER_SAMPLE),
    }
    assert torch.equal(converted.forward_features(x), model.forward_features(x)), "unchanged up to the head"
    assert type(converted.stages[0][0].mlp.drop1) is nn.Dropout


@pytest.mark.parametrize("attention", ["timm", "fused"])
def test_vit_attention_weight_dropouts_are_left_alone(attention: str) -> None:
    model = zoo.build("vit" if attention == "timm" else "vit_fused")
    x = zoo.images(4)
    converted = mt.convert_dropout(model, x, N, 2.0, seed=0)
    rows = decisions(converted)
    for block in (0, 1):
        assert rows[f"blocks.{block}.attn.attn_drop"] == (LEFT, None, None, ATTN_DROP)
        assert rows[f"blocks.{block}.attn.proj_drop"] == (CONVERTED, 16, -1, "")
        assert rows[f"blocks.{block}.mlp.drop1"] == (CONVERTED, 32, -1, "")
        assert rows[f"blocks.{block}.drop_path1"] == (LEFT, None, None, PER_SAMPLE)
        assert type(converted.blocks[block].attn.attn_drop) is nn.Dropout
    assert rows["head_drop"] == (CONVERTED, 16, -1, "")
    assert rows["pos_drop"] == (
        CONVERTED, 16, -1, "axis -1 from the input's rank (3-D): the producer of its input is not recognized"
    )  # fmt: skip
    converted.train()(zoo.images(6))  # the fused path reads attn_drop.p in training
    assert mt.predict(converted, x, N).shape == (N, 4, zoo.CLASSES)


def test_dropout_after_softmax_is_attention_whatever_its_name() -> None:
    class SelfAttention(nn.Module):  # Hugging Face style: self.dropout on the attention probabilities
        def __init__(self) -> None:
            super().__init__()
            self.query, self.key, self.value = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
            self.dropout = nn.Dropout(0.1)
            self.output = nn.Dropout(0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scores = self.query(x) @ self.key(x).transpose(-1, -2)
            probabilities = self.dropout(F.softmax(scores, dim=-1) * 1.0)
            return self.output(probabilities @ self.value(x))

    converted = mt.convert_dropout(SelfAttention(), torch.randn(2, 8, 8), N, 2.0, seed=0)
    assert decisions(converted) == {"dropout": (LEFT, None, None, SOFTMAX), "output": (CONVERTED, 8, -1, "")}


def test_left_alone_unreached_unused_and_inconsistent_dropouts() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 4)
            self.used = nn.Dropout(0.5)
            self.spare = nn.Dropout(0.5)
            self.shared = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.used(self.fc(x))
            F.dropout(x, 0.2, self.training, inplace=True)  # relies on the in-place write
            return self.shared(x).sum(1) + self.shared(x[:, :2]).sum(1)

    converted = mt.convert_dropout(Model(), torch.randn(2, 3), N, 2.0, seed=0)
    rows = decisions(converted)
    assert rows == {
        "used": (CONVERTED, 4, -1, ""),
        "spare": (LEFT, None, None, NOT_REACHED),
        "shared": (LEFT, None, None, "called on inputs with different channels: [(2, 2), (2, 4)]"),
        "dropout": (LEFT, None, None, "its result is not used (an in-place call): masks would change nothing"),
    }
    assert type(converted) is Model, "no call converted, no GraphModule"


def test_untraceable_model_falls_back_to_the_rank_rule_and_says_so() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(3, 8, 3)
            self.drop = nn.Dropout(0.3)
            self.fc = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace it
                x = -x
            return self.fc(self.drop(self.conv(x)).mean(-1))

    with pytest.warns(UserWarning, match="torch.fx could not trace the model .*TraceError"):
        converted = mt.convert_dropout(Branchy(), torch.randn(2, 3, 12), N, 2.0, seed=0)
    action, channels, axis, reason = decisions(converted)["drop"]
    assert (action, channels, axis) == (CONVERTED, 10, -1)
    assert reason.startswith("axis -1 from the input's rank (3-D): torch.fx could not trace the model (TraceError")
    with pytest.warns(UserWarning, match=r"could not trace the model .*; F\.dropout calls are not converted"):
        fixed = mt.convert_dropout(Branchy(), torch.randn(2, 3, 12), N, 2.0, seed=0, channel_axis=1)
    assert decisions(fixed)["drop"] == (CONVERTED, 8, 1, "")


def test_nothing_converted_is_an_error_with_the_report() -> None:
    with pytest.raises(ValueError, match=r"convert_dropout converted no dropout \(0 looked at"):
        mt.convert_dropout(nn.Linear(2, 2), torch.randn(1, 2), N, 2.0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0), nn.Linear(4, 2))
    with pytest.raises(
        ValueError, match=r"(?s)converted no dropout \(1 looked at.*\| 1 \| Dropout \| left as is .*p=0"
    ):
        mt.convert_dropout(model, torch.randn(2, 4), N, 2.0)
    with pytest.raises(ValueError, match=r"scale must be a finite real number >= 1"):
        mt.convert_dropout(model, torch.randn(2, 4), N, 0.0)


def test_inplace_keeps_modes_and_device_dtype() -> None:
    model = nn.Sequential(nn.Linear(5, 12), nn.Dropout(0.1), nn.Linear(12, 2)).double()
    model[2].eval()  # a mixed-mode model keeps each module's own mode
    result = mt.convert_dropout(model, torch.randn(3, 9, 5, dtype=torch.float64), N, 3.0, inplace=True)
    assert result is model and isinstance(model[1], mt.Masksembles) and model[1].masks.dtype == torch.float64
    assert [m.training for m in model] == [True, True, False]
    assert model(torch.randn(6, 9, 5, dtype=torch.float64)).shape == (6, 9, 2)


def test_insert_rules_apply_too_few_channels_and_the_input_dropout() -> None:
    """The rules of insert (masksembles_core.insertion.plan_conversion), with the same words."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_drop = nn.Dropout(0.1)  # reads the raw input (through the elementwise scale)
            self.narrow = nn.Linear(6, 3)
            self.narrow_drop = nn.Dropout(0.3)  # 3 channels: only 3 distinct masks of 2 ones for n=4
            self.wide = nn.Linear(3, 8)
            self.drop = nn.Dropout(0.3)
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.narrow_drop(self.narrow(self.input_drop(x * 2.0)))
            return self.head(F.dropout(self.drop(self.wide(x)), 0.2, self.training))

    x = torch.randn(4, 6)
    converted = mt.convert_dropout(Model(), x, N, 2.0, seed=0)
    assert decisions(converted) == {
        "input_drop": (LEFT, None, None, FIRST),
        "narrow_drop": (
            LEFT, None, None,
            "3 input channels: only 3 distinct masks of 2 ones exist, fewer than n=4 (members would share masks)",
        ),
        "drop": (CONVERTED, 8, -1, ""),
        "dropout": (CONVERTED, 8, -1, ""),
    }  # fmt: skip
    assert type(converted.narrow_drop) is nn.Dropout and type(converted.input_drop) is nn.Dropout
    assert [row.seed for row in converted.masksembles_report.changed] == [mc.derive_seed(0, i) for i in (0, 1)]
    included = mt.convert_dropout(Model(), x, 3, 2.0, seed=0, include_first=True)
    assert [row.path for row in included.masksembles_report.changed] == ["input_drop", "narrow_drop", "drop", "dropout"]
    assert isinstance(included.input_drop, mt.Masksembles) and included.input_drop.channels == 6


def test_a_dropout_after_a_data_dependent_size_is_converted_unless_it_is_the_channels() -> None:
    """A head on the tokens a boolean mask picks (as ``BartForSequenceClassification`` picks its <eos> tokens): the
    size only the data decides, which torch.fx cannot trace, is unknown in the torch.export graph; the dropout before
    it is converted all the same, one on channels that such a mask picks is left."""

    class Selected(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(6, 8)
            self.drop = nn.Dropout(0.1)
            self.head = nn.Linear(8, 3)
            self.picked_channels = nn.Dropout(0.1)

        def forward(self, x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = self.drop(self.proj(x))
            picked = hidden[keep]
            torch._check(picked.shape[0] >= 1)  # data-dependent: torch.fx cannot trace it
            return self.head(self.drop(picked)), self.picked_channels(hidden[:, :, hidden[0, 0] > 0]).sum(-1)

    keep = torch.tensor([[True, False, False], [False, True, False]])
    converted = mt.convert_dropout(Selected(), {"x": torch.randn(2, 3, 6), "keep": keep}, N, 2.0, seed=0)
    assert decisions(converted) == {
        "drop": (CONVERTED, 8, -1, ""),
        "picked_channels": (LEFT, None, None, "its channel axis -1 has a size only the data decides"),
    }
