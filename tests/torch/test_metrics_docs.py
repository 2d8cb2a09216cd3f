"""docs/metrics.md: the torch snippet (a Masksembles regressor trained on the Gaussian NLL) runs as written; and
docs/torch.md's conformal recipe."""

from __future__ import annotations

import pytest

from tests.metrics_docs import check_conformal_recipe, check_regression_snippet


def test_torch_snippet_runs(capsys: pytest.CaptureFixture[str]) -> None:
    check_regression_snippet("torch", capsys)


def test_torch_guide_conformal_recipe_runs() -> None:
    check_conformal_recipe("torch", after="The layer")
