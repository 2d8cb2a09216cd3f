"""docs/metrics.md: the flax snippet (a Masksembles regressor trained on the Gaussian NLL) runs as written; and
docs/flax.md's conformal recipe."""

from __future__ import annotations

import pytest

from tests.metrics_docs import check_conformal_recipe, check_regression_snippet


def test_flax_snippet_runs(capsys: pytest.CaptureFixture[str]) -> None:
    check_regression_snippet("flax", capsys)


def test_flax_guide_conformal_recipe_runs() -> None:
    check_conformal_recipe("flax", after="Linen")
