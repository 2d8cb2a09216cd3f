"""docs/metrics.md: the keras snippet (a Masksembles regressor trained on the Gaussian NLL) runs as written; and
docs/keras.md's conformal recipe."""

from __future__ import annotations

import pytest

from tests.metrics_docs import check_conformal_recipe, check_regression_snippet


def test_keras_snippet_runs(capsys: pytest.CaptureFixture[str]) -> None:
    check_regression_snippet("keras", capsys)


def test_keras_guide_conformal_recipe_runs() -> None:
    check_conformal_recipe("keras")
