"""The uncertainty head's NumPy reference: names, values from metrics, and argument checks."""

from __future__ import annotations

import numpy as np
import pytest

from masksembles_core import heads, metrics


def test_classification_head_is_metrics() -> None:
    logits = np.random.default_rng(0).normal(size=(4, 6, 5))
    answer = heads.uncertainty_head(logits, logits=True)
    assert tuple(answer) == heads.CLASSIFICATION_OUTPUTS
    np.testing.assert_array_equal(answer["probabilities"], metrics.predictive_mean(logits, logits=True))
    np.testing.assert_allclose(answer["predictive_entropy"], metrics.predictive_entropy(logits, logits=True))
    np.testing.assert_allclose(answer["expected_entropy"], metrics.expected_entropy(logits, logits=True))
    np.testing.assert_allclose(answer["mutual_information"], metrics.mutual_information(logits, logits=True))
    np.testing.assert_allclose(answer["max_probability"], 1.0 - metrics.msp_score(logits, logits=True))


def test_member_axis_and_probabilities() -> None:
    probs = metrics.member_probabilities(np.random.default_rng(1).normal(size=(3, 4, 2)), logits=True)
    first = heads.uncertainty_head(probs, logits=False)
    second = heads.uncertainty_head(np.moveaxis(probs, 0, 1), logits=False, member_axis=1)
    for name in heads.CLASSIFICATION_OUTPUTS:
        np.testing.assert_array_equal(first[name], second[name])


def test_binary_logits_become_two_classes() -> None:
    answer = heads.uncertainty_head(np.zeros((2, 3, 1)))
    np.testing.assert_array_equal(answer["probabilities"], np.full((3, 2), 0.5))


def test_probabilities_refused_as_logits_and_logits_as_probabilities() -> None:
    probs = np.full((2, 3, 4), 0.25)
    with pytest.raises(ValueError, match="look like probabilities"):
        heads.uncertainty_head(probs, logits=True)
    with pytest.raises(ValueError, match="look like logits"):
        heads.uncertainty_head(probs * 8.0, logits=False)


def test_point_regression() -> None:
    outputs = np.random.default_rng(2).normal(size=(4, 5, 3))
    answer = heads.uncertainty_head(outputs, task="regression")
    assert tuple(answer) == heads.POINT_REGRESSION_OUTPUTS
    np.testing.assert_allclose(answer["mean"], outputs.mean(0))
    np.testing.assert_allclose(answer["variance"], outputs.var(0))


@pytest.mark.parametrize("head", ["log_variance", "variance"])
def test_gaussian_regression_is_the_mixture(head: str) -> None:
    rng = np.random.default_rng(3)
    means, variances = rng.normal(size=(4, 5)), rng.uniform(0.1, 2.0, size=(4, 5))
    channel = np.log(variances) if head == "log_variance" else variances
    answer = heads.uncertainty_head(np.stack([means, channel], -1), task="regression", head=head)
    assert tuple(answer) == heads.GAUSSIAN_REGRESSION_OUTPUTS
    mean, variance = metrics.gaussian_mixture(means, variances)
    np.testing.assert_allclose(answer["mean"], mean)
    np.testing.assert_allclose(answer["variance"], variance)
    np.testing.assert_allclose(answer["aleatoric"] + answer["epistemic"], variance)


def test_gaussian_variance_floor_is_the_loss_floor() -> None:
    members = np.stack([np.zeros((2, 3)), np.full((2, 3), -50.0)], -1)
    answer = heads.uncertainty_head(members, task="regression", head="log_variance", min_variance=1e-3)
    np.testing.assert_allclose(answer["aleatoric"], 1e-3)


def test_gaussian_members_need_two_channels() -> None:
    with pytest.raises(ValueError, match="last axis of 2"):
        heads.uncertainty_head(np.zeros((2, 3, 3)), task="regression", head="variance")


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"task": "segmentation"}, ValueError, "task must be one of"),
        ({"head": "variance"}, ValueError, "head is for task='regression'"),
        ({"task": "regression", "head": "std"}, ValueError, "head must be one of"),
        ({"task": "regression", "head": "variance", "min_variance": 0.0}, ValueError, "min_variance"),
        ({"logits": 1}, TypeError, "logits must be a bool"),
    ],
)
def test_bad_arguments(arguments: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        heads.check_head(**arguments)
