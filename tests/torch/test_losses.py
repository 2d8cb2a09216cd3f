"""gaussian_nll_loss: torch's own Gaussian NLL and the core metric agree with it; Masksembles members train on it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import masksembles_torch as mt
from masksembles_core import metrics


def head_output(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    output = torch.randn(batch, 2, generator=generator, dtype=torch.float64)
    return output, torch.randn(batch, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_torch_gaussian_nll_and_the_core_metric(reduction: str) -> None:
    output, target = head_output(64, seed=0)
    loss = mt.gaussian_nll_loss(output, target, reduction=reduction)
    variance = output[:, 1].exp()
    expected = F.gaussian_nll_loss(output[:, 0], target, variance, full=True, eps=1e-6, reduction=reduction)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    softplus = F.softplus(output[:, 1])
    positive = torch.stack([output[:, 0], softplus], dim=-1)
    torch.testing.assert_close(
        mt.gaussian_nll_loss(positive, target, head="variance", reduction=reduction),
        F.gaussian_nll_loss(output[:, 0], target, softplus, full=True, eps=1e-6, reduction=reduction),
        rtol=1e-12,
        atol=1e-12,
    )
    core = metrics.gaussian_nll(output[:, 0].numpy(), variance.numpy(), target.numpy())
    assert mt.gaussian_nll_loss(output, target).item() == pytest.approx(core, rel=1e-12)


def test_a_trailing_target_axis_and_vector_outputs() -> None:
    output, target = head_output(10, seed=1)
    same = mt.gaussian_nll_loss(output, target[:, None])
    torch.testing.assert_close(same, mt.gaussian_nll_loss(output, target))
    vector = torch.randn(5, 3, 2, dtype=torch.float64)
    y = torch.randn(5, 3, dtype=torch.float64)
    core = metrics.gaussian_nll(vector[..., 0].numpy(), vector[..., 1].exp().numpy(), y.numpy())
    assert mt.gaussian_nll_loss(vector, y).item() == pytest.approx(core, rel=1e-12)


def test_the_variance_floor_bounds_the_loss_and_its_gradient() -> None:
    output = torch.tensor([[0.0, -80.0], [0.0, 1e-30]], requires_grad=True)
    for head, channel in (("log_variance", 0), ("variance", 1)):
        loss = mt.gaussian_nll_loss(output[channel : channel + 1], torch.tensor([0.5]), head=head, min_variance=1e-3)
        expected = 0.5 * (math.log(2 * math.pi * 1e-3) + 0.25 / 1e-3)
        assert loss.item() == pytest.approx(expected, rel=1e-5)
        (gradient,) = torch.autograd.grad(loss, output)
        assert torch.isfinite(gradient).all()
        assert gradient[channel, 1] == 0.0  # below the floor the variance channel gets no gradient


class SoftplusVariance(nn.Module):
    """(B, 2) -> (B, 2) with channel 1 made positive by a softplus: a variance head."""

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        return torch.stack([output[:, 0], F.softplus(output[:, 1]) + 1e-6], dim=-1)


@pytest.mark.parametrize("head", ["log_variance", "variance"])
def test_masksembles_members_train_on_it_and_predict_returns_their_gaussians(head: str) -> None:
    torch.manual_seed(0)
    x = torch.linspace(-2.0, 2.0, 128)[:, None]
    y = (x[:, 0] * 2.0 + (0.1 + 0.3 * x[:, 0].abs()) * torch.randn(128)).detach()
    model = nn.Sequential(
        nn.Linear(1, 32),
        nn.ReLU(),
        mt.Masksembles1D(32, n=4, scale=2.0, seed=0),
        nn.Linear(32, 2),
        *([SoftplusVariance()] if head == "variance" else []),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(150):
        loss = mt.gaussian_nll_loss(model(x), y, head=head)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0
    members = mt.predict(model, x, n=4)
    assert members.shape == (4, 128, 2)
    means = members[..., 0].numpy()
    variances = members[..., 1].numpy() if head == "variance" else members[..., 1].exp().numpy()
    for k in range(4):  # the loss on member k's outputs is the core NLL of member k's Gaussian
        member_loss = mt.gaussian_nll_loss(members[k], y, head=head).item()
        assert member_loss == pytest.approx(metrics.gaussian_nll(means[k], variances[k], y.numpy()), rel=1e-5)
    mean, variance = metrics.gaussian_mixture(means, variances)
    assert mean.shape == variance.shape == (128,)
    assert metrics.uncertainty_split(means, variances)[1].mean() > 0.0  # the members differ
    assert np.isfinite(metrics.summary(means, y.numpy(), variances=variances)["nll"])


@pytest.mark.parametrize(
    "kwargs,shapes,error,message",
    [
        ({"head": "std"}, ((4, 2), (4,)), ValueError, r"head must be one of \('log_variance', 'variance'\)"),
        ({"min_variance": 0.0}, ((4, 2), (4,)), ValueError, r"min_variance must be a finite number > 0"),
        ({"reduction": "batchmean"}, ((4, 2), (4,)), ValueError, r"reduction must be one of \('mean', 'sum', 'none'\)"),
        ({}, ((4, 1), (4,)), ValueError, r"expects outputs of shape \(B, \.\.\., 2\)"),
        ({}, ((4, 2), (4, 2)), ValueError, r"target of a Gaussian NLL loss must have shape \(4,\) \(or \(4, 1\)\)"),
    ],
)
def test_bad_arguments(
    kwargs: dict[str, object], shapes: tuple[tuple[int, ...], ...], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        mt.gaussian_nll_loss(torch.zeros(shapes[0]), torch.zeros(shapes[1]), **kwargs)  # type: ignore[arg-type]
