"""Data of the demo: the paper's two-sinusoid toy, scikit-learn's digits with held-out classes, corruptions,
a 1-D regression toy with a gap and scikit-learn's diabetes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from sklearn.datasets import load_diabetes, load_digits

FloatArray = NDArray[np.float32]
LabelArray = NDArray[np.int64]

# --- toy: red vs blue points from two noisy sinusoids on x in [-5, 5] ---------------------------

TOY_X_RANGE = (-5.0, 5.0)
TOY_GRID = ((-10.0, 10.0), (-6.0, 6.0))  # the entropy maps cover twice the data's x range
TOY_INPUT_SCALE = np.array([5.0, 2.5], dtype=np.float32)  # network input = point / scale
TOY_AMPLITUDE = 2.0
TOY_NOISE = 0.3


def toy_points(per_class: int, seed: int) -> tuple[FloatArray, LabelArray]:
    """Red (label 0) around y = 2 sin x, blue (label 1) around y = 2 cos x, with N(0, 0.3²) noise on y.

    The two curves cross, so the classes interleave along x. Returns points (2·per_class, 2) as
    (x, y), labels (2·per_class,).
    """
    rng = np.random.default_rng(seed)
    x = rng.uniform(*TOY_X_RANGE, size=(2, per_class))
    phase = np.array([[0.0], [np.pi / 2]])
    y = TOY_AMPLITUDE * np.sin(x + phase) + rng.normal(0.0, TOY_NOISE, size=x.shape)
    points = np.stack([x.ravel(), y.ravel()], axis=1).astype(np.float32)
    return points, np.repeat(np.arange(2, dtype=np.int64), per_class)


def toy_grid(resolution: int) -> tuple[FloatArray, FloatArray, FloatArray]:
    """The plane of the entropy maps: xs (R,), ys (R·12/20,) and the points (len(ys)·R, 2), row-major in y."""
    (x_low, x_high), (y_low, y_high) = TOY_GRID
    xs = np.linspace(x_low, x_high, resolution, dtype=np.float32)
    ys = np.linspace(y_low, y_high, round(resolution * (y_high - y_low) / (x_high - x_low)), dtype=np.float32)
    grid_x, grid_y = np.meshgrid(xs, ys)
    return xs, ys, np.stack([grid_x.ravel(), grid_y.ravel()], axis=1)


def distance_to_data(points: FloatArray, data: FloatArray) -> NDArray[np.float64]:
    """Euclidean distance from each of ``points`` (G, 2) to the nearest of ``data`` (P, 2): (G,)."""
    chunks = [
        np.sqrt(((chunk[:, None, :] - data[None, :, :]) ** 2).sum(-1)).min(axis=1)
        for chunk in np.array_split(points.astype(np.float64), max(1, len(points) // 2048))
    ]
    return np.concatenate(chunks)


# --- digits: in-distribution classes 0-6, held-out (OOD) classes 7-9 --------------------------

IN_CLASSES = (0, 1, 2, 3, 4, 5, 6)
OOD_CLASSES = (7, 8, 9)


@dataclass(frozen=True)
class DigitsSplit:
    """Images (B, 1, 8, 8) in [0, 1] and labels; OOD images are every sample of ``OOD_CLASSES``."""

    x_train: FloatArray
    y_train: LabelArray
    x_val: FloatArray
    y_val: LabelArray
    x_test: FloatArray
    y_test: LabelArray
    x_ood: FloatArray


def digits_split(seed: int = 0, *, val_fraction: float = 0.15, test_fraction: float = 0.55) -> DigitsSplit:
    """scikit-learn's 1797 digits: classes 0-6 split per class into train/validation/test, classes 7-9 as OOD."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]
    labels = digits.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    parts: dict[str, list[NDArray[np.int64]]] = {"train": [], "val": [], "test": []}
    for label in IN_CLASSES:
        index = rng.permutation(np.flatnonzero(labels == label))
        n_val, n_test = round(len(index) * val_fraction), round(len(index) * test_fraction)
        parts["val"].append(index[:n_val])
        parts["test"].append(index[n_val : n_val + n_test])
        parts["train"].append(index[n_val + n_test :])
    train, val, test = (np.sort(np.concatenate(parts[name])) for name in ("train", "val", "test"))
    return DigitsSplit(
        x_train=images[train],
        y_train=labels[train],
        x_val=images[val],
        y_val=labels[val],
        x_test=images[test],
        y_test=labels[test],
        x_ood=images[np.isin(labels, OOD_CLASSES)],
    )


# --- corruptions of (B, 1, H, W) images in [0, 1], severities 1..5 ------------------------------


def gaussian_noise(images: FloatArray, severity: int, rng: np.random.Generator) -> FloatArray:
    sigma = (0.08, 0.16, 0.24, 0.32, 0.40)[severity - 1]
    return np.clip(images + rng.normal(0.0, sigma, images.shape), 0.0, 1.0).astype(np.float32)


def impulse_noise(images: FloatArray, severity: int, rng: np.random.Generator) -> FloatArray:
    fraction = (0.03, 0.06, 0.10, 0.15, 0.20)[severity - 1]
    hit = rng.random(images.shape) < fraction
    return np.where(hit, rng.integers(0, 2, images.shape), images).astype(np.float32)


def gaussian_blur(images: FloatArray, severity: int, rng: np.random.Generator) -> FloatArray:
    sigma = (0.4, 0.6, 0.8, 1.0, 1.2)[severity - 1]
    offsets = np.arange(-3, 4)
    kernel = np.exp(-(offsets**2) / (2 * sigma**2))
    kernel /= kernel.sum()
    height, width = images.shape[-2:]
    padded = np.pad(images, [(0, 0), (0, 0), (3, 3), (3, 3)])
    rows = np.zeros(padded[..., 3 : 3 + height, :].shape)  # float64 sums, separable: along H, then along W
    for weight, offset in zip(kernel, offsets, strict=True):
        rows += weight * padded[..., 3 + offset : 3 + offset + height, :]
    blurred = np.zeros(images.shape)
    for weight, offset in zip(kernel, offsets, strict=True):
        blurred += weight * rows[..., 3 + offset : 3 + offset + width]
    return blurred.astype(np.float32)


def contrast(images: FloatArray, severity: int, rng: np.random.Generator) -> FloatArray:
    factor = (0.5, 0.35, 0.25, 0.15, 0.1)[severity - 1]
    mean = images.mean(axis=(-2, -1), keepdims=True)
    reduced: FloatArray = ((images - mean) * factor + mean).astype(np.float32)
    return reduced


def brightness(images: FloatArray, severity: int, rng: np.random.Generator) -> FloatArray:
    shift = (0.1, 0.2, 0.3, 0.4, 0.5)[severity - 1]
    brighter: FloatArray = np.clip(images + shift, 0.0, 1.0).astype(np.float32)
    return brighter


CORRUPTIONS: dict[str, Callable[[FloatArray, int, np.random.Generator], FloatArray]] = {
    "gaussian noise": gaussian_noise,
    "impulse noise": impulse_noise,
    "gaussian blur": gaussian_blur,
    "contrast": contrast,
    "brightness": brightness,
}
SEVERITIES = (1, 2, 3, 4, 5)


def corrupt(images: FloatArray, name: str, severity: int) -> FloatArray:
    """``images`` under corruption ``name`` at ``severity`` (1..5), the same draw on every call."""
    rng = np.random.default_rng([list(CORRUPTIONS).index(name), severity])
    return CORRUPTIONS[name](images, severity, rng)


# --- regression toy: y = f(x) + noise that grows with x, observed on [-4, -1] and [1, 4] ---------

REGRESSION_DATA = ((-4.0, -1.5), (1.5, 4.0))  # the gap (-1.5, 1.5) has no training data
REGRESSION_GAP = (-1.5, 1.5)
REGRESSION_PLOT = (-6.0, 6.0)
REGRESSION_INPUT_SCALE = 4.0  # network input = x / scale


def regression_mean(x: NDArray[np.floating]) -> NDArray[np.float64]:
    """The toy's true function: 1.5 sin(1.2 x) + 0.2 x."""
    values = np.asarray(x, dtype=np.float64)
    result: NDArray[np.float64] = np.sin(1.2 * values) + 0.15 * values**2 - 1.0
    return result


def regression_noise(x: NDArray[np.floating]) -> NDArray[np.float64]:
    """The toy's noise standard deviation: 0.05 at x = -4 growing linearly to 0.35 at x = 4 (heteroscedastic)."""
    result: NDArray[np.float64] = 0.05 + 0.3 * (np.asarray(x, dtype=np.float64) + 4.0) / 8.0
    return result


def regression_points(count: int, seed: int, *, gap: bool = False) -> tuple[FloatArray, FloatArray]:
    """``count`` points (x (count, 1), y (count,)): x uniform on the data's two intervals (on the gap with ``gap``)."""
    rng = np.random.default_rng(seed)
    if gap:
        x = rng.uniform(*REGRESSION_GAP, size=count)
    else:
        (low, split), (resume, high) = REGRESSION_DATA
        u = rng.uniform(0.0, (split - low) + (high - resume), size=count)
        x = np.where(u < split - low, low + u, resume + u - (split - low))
    y = regression_mean(x) + regression_noise(x) * rng.normal(size=count)
    return x[:, None].astype(np.float32), y.astype(np.float32)


# --- diabetes: scikit-learn's 442 patients, 10 features, a disease-progression target ----------


@dataclass(frozen=True)
class RegressionSplit:
    """Features and targets standardized with the training set's mean and standard deviation."""

    x_train: FloatArray
    y_train: FloatArray
    x_val: FloatArray
    y_val: FloatArray
    x_test: FloatArray
    y_test: FloatArray


def diabetes_split(seed: int, *, val_fraction: float = 0.2, test_fraction: float = 0.2) -> RegressionSplit:
    """A random train/validation/test split of scikit-learn's diabetes data from ``seed``, standardized."""
    features, target = load_diabetes(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(target))
    n_val, n_test = round(len(order) * val_fraction), round(len(order) * test_fraction)
    val, test, train = order[:n_val], order[n_val : n_val + n_test], order[n_val + n_test :]
    x_mean, x_std = features[train].mean(axis=0), features[train].std(axis=0)
    y_mean, y_std = target[train].mean(), target[train].std()

    def scaled(index: NDArray[np.int64]) -> tuple[FloatArray, FloatArray]:
        x = ((features[index] - x_mean) / x_std).astype(np.float32)
        return x, ((target[index] - y_mean) / y_std).astype(np.float32)

    (x_train, y_train), (x_val, y_val), (x_test, y_test) = scaled(train), scaled(val), scaled(test)
    return RegressionSplit(x_train, y_train, x_val, y_val, x_test, y_test)
