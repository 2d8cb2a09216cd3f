"""with_uncertainty: the head's dict equals masksembles_core.heads.uncertainty_head on predict's members (float32
rounding), eager and under torch.compile, over a packed and a Masksembles model; and its refusals."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import masksembles_torch as mt
from masksembles_core import heads
from tests.torch.heads import CASES, FEATURES, N, assert_head_matches, masksembles_model, packed_model

# "dense": pack's dense program (what `auto` may keep) holds the Masksembles layers and outputs the members as a packed
# program does: the head must read its output, not tile its input
KINDS = ("packed", "dense", "inserted")


def wrapped(case: str, kind: str) -> mt.UncertaintyHead:
    model = masksembles_model(case) if kind == "inserted" else packed_model(case, kind)
    return mt.with_uncertainty(model, **CASES[case][2])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(CASES))
def test_head_equals_the_core_on_predict(case: str, kind: str) -> None:
    head = wrapped(case, kind)
    assert head.outputs == heads.check_head(**CASES[case][2]).outputs
    for batch in (5, 1):
        x = torch.randn(batch, FEATURES)
        assert_head_matches(head(x), masksembles_model(case), x, CASES[case][2])


@pytest.mark.parametrize(
    ("case", "kind"), [("logits", "packed"), pytest.param("gaussian log_variance", "inserted", marks=pytest.mark.slow)]
)
def test_compiled_head_equals_the_core(case: str, kind: str) -> None:
    compiled = torch.compile(wrapped(case, kind), fullgraph=True, dynamic=True)
    for batch in (5, 1):
        x = torch.randn(batch, FEATURES)
        assert_head_matches(compiled(x), masksembles_model(case), x, CASES[case][2])


class MembersSecond(nn.Module):
    """A packed model's output (n, B, K) as (B, n, K), torch-uncertainty's layout."""

    def __init__(self, packed: nn.Module) -> None:
        super().__init__()
        self.packed = packed

    def forward(self, x: Tensor) -> Tensor:
        return self.packed(x).transpose(0, 1)


def test_member_axis_of_a_module_around_a_packed_model() -> None:
    head = mt.with_uncertainty(MembersSecond(packed_model("logits")).eval(), member_axis=1, n=N)
    x = torch.randn(5, FEATURES)
    assert_head_matches(head(x), masksembles_model("logits"), x, {})


class Saturated(nn.Module):
    """Members whose probabilities hold exact zeros (a huge softmax temperature) or logits with a masked class."""

    def __init__(self, probabilities: bool) -> None:
        super().__init__()
        self.model = masksembles_model("logits")
        self.probabilities = probabilities

    def forward(self, x: Tensor) -> Tensor:
        logits = self.model(x)
        if self.probabilities:
            return torch.softmax(logits * 1e4, dim=-1)
        return logits + torch.tensor([0.0, 0.0, -torch.inf])


@pytest.mark.parametrize("probabilities", [True, False], ids=["one-hot probabilities", "a -inf logit"])
def test_zero_probabilities_give_finite_entropies(probabilities: bool) -> None:
    model = Saturated(probabilities).eval()
    arguments = {"logits": not probabilities}
    x = torch.randn(6, FEATURES)
    answer = mt.with_uncertainty(model, **arguments)(x)
    assert all(torch.isfinite(value).all() for value in answer.values())
    assert (answer["mutual_information"] >= 0).all()
    assert_head_matches(answer, model, x, arguments)


def test_the_head_is_in_eval_mode_and_says_what_it_wraps() -> None:
    model = masksembles_model("logits")
    head = mt.with_uncertainty(model)
    assert not head.training and not any(module.training for module in model.modules())
    assert "task='classification'" in repr(head) and f"tiled n={N}" in repr(head)


@pytest.mark.parametrize("when", ["wrapped", "model.train() after", "head.train() after"])
def test_training_mode_is_refused(when: str) -> None:
    model = masksembles_model("logits")
    if when == "wrapped":
        with pytest.raises(
            ValueError, match=r"8 module\(s\) are in training mode \(Sequential, 0, 1, \.\.\.\): call model.eval"
        ):
            mt.with_uncertainty(model.train())
        return
    head = mt.with_uncertainty(model)
    (model if when.startswith("model") else head).train()
    with pytest.raises(ValueError, match="module\\(s\\) are in training mode"):
        head(torch.randn(2, FEATURES))


@pytest.mark.parametrize("kind", KINDS)
def test_outputs_that_are_not_what_logits_says_are_refused(kind: str) -> None:
    x = torch.randn(3, FEATURES)
    as_probabilities = mt.with_uncertainty(
        masksembles_model("logits") if kind == "inserted" else packed_model("logits", kind), logits=False
    )
    with pytest.raises(ValueError, match=r"members must be probabilities in \[0, 1\].*look like logits"):
        as_probabilities(x)
    model = masksembles_model("probabilities") if kind == "inserted" else packed_model("probabilities", kind)
    with pytest.raises(ValueError, match="members look like probabilities, not logits"):
        mt.with_uncertainty(model)(x)


def test_a_model_without_members_is_refused() -> None:
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"needs a model with members.*Linear has no Masksembles layer"):
        mt.with_uncertainty(nn.Linear(FEATURES, 1).eval(), task="regression")
    member = mt.extract_member(masksembles_model("point regression"), 0, torch.randn(4, FEATURES))
    with pytest.raises(ValueError, match="extract_member's output is one member"):
        mt.with_uncertainty(member, task="regression")


def test_a_packed_model_beside_masksembles_layers_is_refused() -> None:
    mixed = nn.Sequential(packed_model("logits"), mt.Masksembles1D(16, N, 2.0, seed=0)).eval()
    with pytest.raises(ValueError, match="holds a packed model and Masksembles layers outside it"):
        mt.with_uncertainty(mixed)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"task": "segmentation"}, ValueError, "task must be one of"),
        ({"head": "variance"}, ValueError, "head is for task='regression'"),
        ({"task": "regression", "head": "std"}, ValueError, "head must be one of"),
        ({"logits": 1}, TypeError, "logits must be a bool"),
        ({"member_axis": 1.0}, TypeError, "member_axis must be an integer"),
        ({"member_axis": 1}, ValueError, "member_axis must be 0 for a Masksembles model"),
        ({"n": 3}, ValueError, "n=3 does not match the model's Masksembles layers"),
    ],
)
def test_bad_arguments(arguments: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        mt.with_uncertainty(masksembles_model("logits"), **arguments)


def test_packed_members_other_than_n_and_outputs_the_head_cannot_read_are_refused() -> None:
    with pytest.raises(ValueError, match=f"n=3 does not match the packed model's members: \\[{N}\\]"):
        mt.with_uncertainty(packed_model("logits"), n=3)
    gaussian = mt.with_uncertainty(packed_model("logits"), task="regression", head="variance")
    with pytest.raises(ValueError, match=r"need a last axis of 2 .* received shape \(4, 2, 3\)"):
        gaussian(torch.randn(2, FEATURES))

    class Pair(nn.Module):
        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            return x, x

    model = nn.Sequential(mt.Masksembles1D(FEATURES, N, 2.0, seed=0), Pair()).eval()
    with pytest.raises(TypeError, match=r"needs the model to return one tensor .* returned tuple"):
        mt.with_uncertainty(model)(torch.randn(2, FEATURES))


def test_a_binary_logit_is_two_classes() -> None:
    answer = wrapped("binary logit", "packed")(torch.randn(3, FEATURES))
    assert answer["probabilities"].shape == (3, 2)
    np.testing.assert_allclose(answer["probabilities"].sum(-1).numpy(), 1.0, rtol=1e-6)


class TwoInputs(nn.Module):
    """A Masksembles model called with two batch-first tensors and a flag, as ``predict`` calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.model = masksembles_model("logits")

    def forward(self, x: Tensor, shift: Tensor, *, double: bool = False) -> Tensor:
        return self.model(x + shift) * (2.0 if double else 1.0)


@pytest.mark.parametrize("dict_inputs", [False, True], ids=["tuple", "dict"])
def test_inputs_as_predict_takes_them(dict_inputs: bool) -> None:
    model = TwoInputs().eval()
    x, shift = torch.randn(5, FEATURES), torch.randn(5, FEATURES)
    inputs: Any = {"x": x, "shift": shift, "double": True} if dict_inputs else (x, shift)
    assert_head_matches(mt.with_uncertainty(model)(inputs), model, inputs, {})
