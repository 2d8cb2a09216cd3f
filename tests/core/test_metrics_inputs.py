"""Inputs that are not what a metric assumes: logits for probabilities and back, member layouts, masked logits."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np
import pytest

from masksembles_core import metrics
from tests.core.precision import LOW_PRECISIONS, low_precision


def member_logits(n: int, batch: int, classes: int, seed: int, scale: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
    """Member logits (n, batch, classes) that favour the label, and the labels."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, batch)
    shared = rng.normal(size=(batch, classes))
    shared[np.arange(batch), labels] += 2.0
    return scale * (shared + 0.5 * rng.normal(size=(n, batch, classes))), labels


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs: np.ndarray = shifted / shifted.sum(axis=-1, keepdims=True)
    return probs


LOGITS, LABELS = member_logits(4, 50, 5, seed=0)
PROBS = softmax(LOGITS)

# --- probabilities passed as logits, logits passed as probabilities ------------------------------

TAKES_LOGITS: dict[str, Callable[[np.ndarray], object]] = {
    "predictive_entropy": lambda m: metrics.predictive_entropy(m, logits=True),
    "mutual_information": lambda m: metrics.mutual_information(m, logits=True),
    "msp_score": lambda m: metrics.msp_score(m, logits=True),
    "member_probabilities": lambda m: metrics.member_probabilities(m, logits=True),
    "nll": lambda m: metrics.negative_log_likelihood(m, LABELS, logits=True),
    "summary": lambda m: metrics.summary(m, LABELS, logits=True),
    "fit_temperature": lambda m: metrics.fit_temperature(m, LABELS),
    "apply_temperature": lambda m: metrics.apply_temperature(m, 2.0),
    "energy_score": metrics.energy_score,
    "max_logit_score": metrics.max_logit_score,
    "ood_score": lambda m: metrics.ood_score("energy", m, logits=True),
}


@pytest.mark.parametrize("name", list(TAKES_LOGITS))
def test_probabilities_given_as_logits_are_refused(name: str) -> None:
    # a second softmax on probabilities used to give NLL 2.04 instead of 2.44 without a word
    with pytest.raises(ValueError, match=r"look like probabilities, not logits: every row lies in \[0, 1\] and sums"):
        TAKES_LOGITS[name](PROBS)
    TAKES_LOGITS[name](LOGITS)  # the logits themselves are fine


TAKES_PROBABILITIES: dict[str, tuple[Callable[[np.ndarray], object], str]] = {
    "predictive_mean": (metrics.predictive_mean, r"pass logits=True"),
    "variation_ratio": (metrics.variation_ratio, r"pass logits=True"),
    "summary": (lambda m: metrics.summary(m, LABELS), r"pass logits=True"),
    "accuracy": (lambda m: metrics.accuracy(m[0], LABELS), r"predictive_mean\(logits, logits=True\)"),
    "nll": (lambda m: metrics.negative_log_likelihood(m[0], LABELS), r"predictive_mean\(logits, logits=True\)"),
    "ece": (lambda m: metrics.expected_calibration_error(m[0], LABELS), r"predictive_mean\(logits, logits=True\)"),
}


@pytest.mark.parametrize("name", list(TAKES_PROBABILITIES))
def test_logits_given_as_probabilities_are_refused_with_what_to_do(name: str) -> None:
    call, advice = TAKES_PROBABILITIES[name]
    with pytest.raises(
        ValueError, match=r"must be probabilities in \[0, 1\]; received values from -\d.*look like logits"
    ):
        call(LOGITS)
    with pytest.raises(ValueError, match=advice):
        call(LOGITS)


def test_nll_of_logits_is_not_capped() -> None:
    # probabilities clipped at float64's eps capped the NLL at 36.04 nats per sample
    logits = LOGITS * 15.0
    expected = []
    for b, label in enumerate(LABELS):  # log of the mean of the members' softmax, in the log domain
        log_p = [z[label] - z.max() - math.log(math.fsum(math.exp(v - z.max()) for v in z)) for z in logits[:, b]]
        top = max(log_p)
        expected.append(-(top + math.log(math.fsum(math.exp(v - top) for v in log_p) / len(log_p))))
    assert max(expected) > 40.0  # some sample is past the old cap
    direct = math.fsum(expected) / len(expected)
    assert metrics.summary(logits, LABELS, logits=True)["nll"] == pytest.approx(direct, rel=1e-12)
    assert metrics.negative_log_likelihood(logits, LABELS, logits=True) == pytest.approx(direct, rel=1e-12)
    assert metrics.negative_log_likelihood(logits[0], LABELS, logits=True) == pytest.approx(
        -np.mean([z[y] - np.log(np.exp(z).sum()) for z, y in zip(logits[0], LABELS, strict=True)]), rel=1e-9
    )


@pytest.mark.parametrize("eps", [0.7, 0.2, 0.0, -1e-3], ids=["0.7", "1/K", "zero", "negative"])
def test_eps_must_lie_between_zero_and_one_over_k(eps: float) -> None:
    # eps=0.7 used to return -log 0.3 for every sample and eps <= 0 inf
    with pytest.raises(ValueError, match=r"eps must lie in \(0, 1/K\) = \(0, 0.2\) for K = 5 classes; received"):
        metrics.negative_log_likelihood(PROBS[0], LABELS, eps=eps)
    with pytest.raises(ValueError, match=r"eps clips probabilities"):
        metrics.negative_log_likelihood(LOGITS, LABELS, logits=True, eps=1e-7)


def test_renormalizing_more_than_rounding_explains_warns() -> None:
    off = PROBS * 0.995  # rows sum to 0.995: within PROBABILITY_TOLERANCE, far from any rounding
    with pytest.warns(metrics.RenormalizationWarning, match=r"members: a row sums to 1 ± 0.005.*float64"):
        result = metrics.predictive_mean(off)
    np.testing.assert_allclose(result, PROBS.mean(axis=0), rtol=1e-12)
    with pytest.warns(metrics.RenormalizationWarning, match=r"probs: a row sums to 1 ± 0.005"):
        metrics.accuracy(off[0], LABELS)
    with pytest.warns(metrics.RenormalizationWarning, match=r"float32"):
        metrics.predictive_mean((PROBS * 0.999).astype(np.float32))


@pytest.mark.parametrize("kind", [*LOW_PRECISIONS, "float32"])
def test_rounding_alone_does_not_warn(kind: str) -> None:
    probs = PROBS.astype(np.float32) if kind == "float32" else low_precision(PROBS, kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metrics.predictive_mean(probs)
        metrics.predictive_mean(probs.astype(np.float64))  # cast up again: the values say how they were rounded


# --- one layout rule: (n, B, ...), member_axis, and (B, K) as one member ---------------------------

MEMBER_FUNCTIONS: dict[str, Callable[..., object]] = {
    "predictive_mean": lambda m, **k: metrics.predictive_mean(m, logits=True, **k),
    "predictive_entropy": lambda m, **k: metrics.predictive_entropy(m, logits=True, **k),
    "expected_entropy": lambda m, **k: metrics.expected_entropy(m, logits=True, **k),
    "mutual_information": lambda m, **k: metrics.mutual_information(m, logits=True, **k),
    "msp_score": lambda m, **k: metrics.msp_score(m, logits=True, **k),
    "max_logit_score": lambda m, **k: metrics.max_logit_score(m, **k),
    "energy_score": lambda m, **k: metrics.energy_score(m, **k),
    "variation_ratio": lambda m, **k: metrics.variation_ratio(m, logits=True, **k),
    "probability_variance": lambda m, **k: metrics.probability_variance(m, logits=True, **k),
    "member_probabilities": lambda m, **k: metrics.member_probabilities(m, logits=True, **k),
    "nll": lambda m, **k: metrics.negative_log_likelihood(m, LABELS, logits=True, **k),
    "fit_temperature": lambda m, **k: metrics.fit_temperature(m, LABELS, **k),
    "fit_temperature_per_member": lambda m, **k: metrics.fit_temperature(m, LABELS, per_member=True, **k),
    "pairwise_diversity": lambda m, **k: metrics.pairwise_diversity(m, LABELS, logits=True, **k).diversity,
    "summary": lambda m, **k: dict(metrics.summary(m, LABELS, logits=True, ood_members=m[..., ::-1], **k)),
}


@pytest.mark.parametrize("name", list(MEMBER_FUNCTIONS))
def test_member_axis_reads_torch_uncertainty_layout(name: str) -> None:
    # torch-uncertainty's (B, n, K) read as (n, B, K) gave a mutual information of 0.6 instead of 0.05, silently
    batch_first = np.ascontiguousarray(LOGITS.transpose(1, 0, 2))
    expected = MEMBER_FUNCTIONS[name](LOGITS)
    result = MEMBER_FUNCTIONS[name](batch_first, member_axis=1)
    if isinstance(expected, dict):
        assert result == pytest.approx(expected, rel=1e-12)
    else:
        np.testing.assert_allclose(np.asarray(result), np.asarray(expected), rtol=1e-12)
    negative = MEMBER_FUNCTIONS[name](batch_first, member_axis=-2)
    np.testing.assert_equal(negative, result)


@pytest.mark.parametrize("name", [name for name in MEMBER_FUNCTIONS if name != "pairwise_diversity"])
def test_two_dimensional_input_is_one_member(name: str) -> None:
    # energy_score and msp_score used to refuse (B, K), which fit_temperature took
    single = LOGITS[0]
    expected = MEMBER_FUNCTIONS[name](single[None])
    result = MEMBER_FUNCTIONS[name](single)
    if isinstance(expected, dict):
        assert result == expected
    else:
        np.testing.assert_array_equal(np.asarray(result), np.asarray(expected))


def test_per_member_temperature_of_one_model_applies_to_it() -> None:
    temperatures = metrics.fit_temperature(LOGITS[0], LABELS, per_member=True)
    assert temperatures.shape == (1,)
    np.testing.assert_array_equal(metrics.apply_temperature(LOGITS[0], temperatures), LOGITS[0] / temperatures[0])


def test_apply_temperature_keeps_the_layout_of_member_axis() -> None:
    per_member = np.array([1.0, 2.0, 4.0, 8.0])
    batch_first = LOGITS.transpose(1, 0, 2)
    scaled = metrics.apply_temperature(batch_first, per_member, member_axis=1)
    np.testing.assert_array_equal(scaled, metrics.apply_temperature(LOGITS, per_member).transpose(1, 0, 2))


def test_regression_members_take_member_axis() -> None:
    rng = np.random.default_rng(3)
    means, variances, y = rng.normal(size=(4, 30, 2)), rng.uniform(0.5, 2.0, (4, 30, 2)), rng.normal(size=(30, 2))
    last = (means.transpose(1, 2, 0), variances.transpose(1, 2, 0))
    np.testing.assert_array_equal(metrics.member_mean(last[0], member_axis=2), metrics.member_mean(means))
    np.testing.assert_array_equal(metrics.member_variance(last[0], member_axis=2), metrics.member_variance(means))
    np.testing.assert_array_equal(
        metrics.gaussian_mixture(*last, member_axis=2), metrics.gaussian_mixture(means, variances)
    )
    np.testing.assert_array_equal(
        metrics.uncertainty_split(*last, member_axis=2), metrics.uncertainty_split(means, variances)
    )
    assert metrics.mixture_nll(*last, y, member_axis=2) == metrics.mixture_nll(means, variances, y)
    assert metrics.crps_mixture(*last, y, member_axis=2) == pytest.approx(metrics.crps_mixture(means, variances, y))
    assert metrics.summary(last[0], y, variances=last[1], member_axis=2) == pytest.approx(
        metrics.summary(means, y, variances=variances)
    )


# --- masked logits ----------------------------------------------------------------------------------


def test_masked_logits_count_as_impossible_classes() -> None:
    masked = LOGITS.copy()
    masked[:, :, 4] = -np.inf  # class 4 masked out everywhere: the same as four classes
    labels = np.minimum(LABELS, 3)
    four = LOGITS[:, :, :4]
    for name in ("entropy", "msp", "mutual_information", "variation_ratio", "probability_variance", "energy"):
        np.testing.assert_allclose(
            metrics.ood_score(name, masked, logits=True), metrics.ood_score(name, four, logits=True), rtol=1e-12
        )
    np.testing.assert_allclose(metrics.predictive_mean(masked, logits=True)[:, 4], 0.0)
    assert metrics.fit_temperature(masked, labels) == pytest.approx(metrics.fit_temperature(four, labels), rel=1e-9)
    assert metrics.summary(masked, labels, logits=True)["nll"] == pytest.approx(
        metrics.summary(four, labels, logits=True)["nll"], rel=1e-12
    )
    np.testing.assert_array_equal(metrics.apply_temperature(masked, 2.0)[:, :, 4], -np.inf)


def test_some_members_may_mask_the_label() -> None:
    masked = LOGITS.copy()
    masked[0, np.arange(50), LABELS] = -np.inf  # member 0 rules the label out; the others do not
    nll = metrics.negative_log_likelihood(masked, LABELS, logits=True)
    assert math.isfinite(nll) and nll > metrics.negative_log_likelihood(LOGITS, LABELS, logits=True)
    assert 0.01 < metrics.fit_temperature(masked, LABELS) < 100.0


# --- temperature: speed without losing the global minimum --------------------------------------------


def test_an_ensemble_nll_with_two_minima_gives_the_global_one() -> None:
    # a cautious member wrong on a tenth of the samples and a confident one wrong on up to half of them: the ensemble
    # NLL has a minimum at a small T (the cautious member sharpened) and another at a large T
    rng = np.random.default_rng(0)
    batch = 200
    labels = rng.integers(0, 2, batch)
    sign = np.where(labels == 1, 1.0, -1.0)
    cautious = sign * rng.uniform(0.5, 2.0, batch) * (1 - 2 * (rng.random(batch) < 0.1))
    confident = sign * rng.uniform(5, 40, batch) * (1 - 2 * (rng.random(batch) < rng.uniform(0.2, 0.5)))
    logits = np.stack([cautious, confident])[:, :, None]  # sigmoid logits
    grid = np.exp(np.linspace(math.log(0.05), math.log(100.0), 600))
    nll = np.array([metrics.negative_log_likelihood(logits / t, labels, logits=True) for t in grid])
    local_minima = np.flatnonzero((nll[1:-1] < nll[:-2]) & (nll[1:-1] < nll[2:])) + 1
    assert local_minima.size == 2  # the premise: two minima
    fitted = metrics.fit_temperature(logits, labels, bounds=(0.05, 100.0))
    assert fitted == pytest.approx(grid[int(nll.argmin())], rel=0.01)
    assert metrics.negative_log_likelihood(logits / fitted, labels, logits=True) <= nll.min() + 1e-12


def test_one_model_fit_needs_few_nll_evaluations(monkeypatch: pytest.MonkeyPatch) -> None:
    # the grid and golden-section search evaluated the NLL 90 times; Newton on 1/T needs about ten
    calls = []
    evaluate = metrics._EnsembleNLL.evaluate

    def counted(self: metrics._EnsembleNLL, s: float) -> tuple[float, float, float]:
        calls.append(s)
        return evaluate(self, s)

    monkeypatch.setattr(metrics._EnsembleNLL, "evaluate", counted)
    logits, labels = member_logits(1, 2000, 10, seed=5)
    metrics.fit_temperature(logits[0], labels)
    assert len(calls) <= 12
    calls.clear()
    metrics.fit_temperature(logits, labels)  # an ensemble: a 17-point grid first
    assert len(calls) <= 17 + 12


# --- messages name the argument at fault -----------------------------------------------------------

BAD_OOD = LOGITS[:, :10].copy()
BAD_OOD[0, 0, 0] = np.nan
RNG = np.random.default_rng(1)
MEANS, VARIANCES, Y = RNG.normal(size=(4, 20)), RNG.uniform(0.5, 1.5, (4, 20)), RNG.normal(size=20)

ERRORS: dict[str, tuple[Callable[[], object], str]] = {
    "summary-ood-nan": (
        lambda: metrics.summary(LOGITS, LABELS, logits=True, ood_members=BAD_OOD),
        r"ood_members must be finite",
    ),
    "summary-ood-1d": (
        lambda: metrics.summary(PROBS, LABELS, ood_members=PROBS[0, 0]),
        r"ood_members must have shape \(n, B, K\)",
    ),
    "summary-ood-probabilities": (
        lambda: metrics.summary(PROBS, LABELS, ood_members=LOGITS),
        r"ood_members must be probabilities in \[0, 1\]",
    ),
    "regression-ood-nan": (
        lambda: metrics.summary(MEANS, Y, variances=VARIANCES, ood_members=MEANS * np.nan, ood_variances=VARIANCES),
        r"ood_members must be finite",
    ),
    "regression-ood-variances": (
        lambda: metrics.summary(MEANS, Y, variances=VARIANCES, ood_members=MEANS, ood_variances=-VARIANCES),
        r"ood_variances must be >= 0",
    ),
    "regression-ood-shapes": (
        lambda: metrics.summary(MEANS, Y, variances=VARIANCES, ood_members=MEANS, ood_variances=VARIANCES[:2]),
        r"ood_members, ood_variances must have the same shape",
    ),
    "regression-targets": (
        lambda: metrics.summary(MEANS, Y[:3], variances=VARIANCES),
        r"targets must have shape \(20,\) to match members \(4, 20\)",
    ),
    "regression-variances": (
        lambda: metrics.summary(MEANS, Y, variances=VARIANCES * np.inf),
        r"variances must be finite",
    ),
    "bounds-one": (
        lambda: metrics.fit_temperature(LOGITS, LABELS, bounds=(0.5,)),  # type: ignore[arg-type]
        r"bounds must be two temperatures",
    ),
    "bounds-text": (
        lambda: metrics.fit_temperature(LOGITS, LABELS, bounds=("a", "b")),  # type: ignore[arg-type]
        r"bounds must be two temperatures \(low, high\); received \('a', 'b'\)",
    ),
    "member-axis-range": (
        lambda: metrics.predictive_mean(PROBS, member_axis=3),
        r"member_axis 3 is out of range for members \(n, B, K\) of shape \(4, 50, 5\)",
    ),
    "masked-row": (
        lambda: metrics.energy_score(np.full((2, 3, 4), -np.inf)),
        r"members has a row whose logits are all −inf",
    ),
    "plus-inf-logits": (
        lambda: metrics.predictive_entropy(np.full((2, 3, 4), np.inf), logits=True),
        r"members must be finite \(−inf, a masked class, is allowed\)",
    ),
    "masked-probabilities": (
        lambda: metrics.predictive_mean(np.where(PROBS > 0.5, -np.inf, PROBS)),
        r"members must be finite",
    ),
    "temperature-masked-label": (
        lambda: metrics.fit_temperature(np.array([[-np.inf, 0.0], [1.0, 0.0]]), [0, 1]),
        r"labels fall on a masked class \(logit −inf in every member\) for samples \[0\]",
    ),
    "ood-score-name": (
        lambda: metrics.ood_score("entropie", LOGITS, logits=True),
        r"score must be one of \('entropy', 'msp'",
    ),
    "ood-score-energy-of-probabilities": (
        lambda: metrics.ood_score("energy", PROBS),
        r"the energy score needs logits",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_names_the_argument(case: str) -> None:
    call, message = ERRORS[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_member_axis_must_be_an_integer() -> None:
    with pytest.raises(TypeError, match=r"member_axis must be an integer; received 1.0"):
        metrics.predictive_mean(PROBS, member_axis=1.0)  # type: ignore[arg-type]
