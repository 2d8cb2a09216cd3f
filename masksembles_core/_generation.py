"""Mask generation: the paper's algorithm and the fixed-width form that layers use."""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass
from typing import cast

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._validation import check_channel_axis, check_channels, check_int, check_mode, check_n, check_scale

Seed = int | np.integer | np.random.Generator | None
BoolArray = NDArray[np.bool_]


def check_seed(seed: object) -> int | np.random.Generator | None:
    """Validate a mask seed: None (fresh entropy), an integer >= 0 or a ``numpy.random.Generator``."""
    allowed = "None, an integer >= 0 or a numpy.random.Generator"
    if seed is None or isinstance(seed, np.random.Generator):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be {allowed}; received {seed!r} ({type(seed).__name__})")
    if int(seed) < 0:
        raise ValueError(f"seed must be {allowed}; received {int(seed)}")
    return int(seed)


def make_rng(seed: Seed) -> np.random.Generator:
    """Return a ``np.random.Generator`` for ``seed``.

    ``None`` draws fresh OS entropy, an int gives the same stream on every run, and a
    Generator is used as is (and advanced).
    """
    checked = check_seed(seed)
    return checked if isinstance(checked, np.random.Generator) else np.random.default_rng(checked)


def derive_seed(seed: int | None, index: int) -> int:
    """A deterministic child seed for the ``index``-th layer built from one user ``seed``.

    With ``seed=None`` the result is drawn from fresh entropy.
    """
    root = np.random.SeedSequence(seed)
    return int(np.random.SeedSequence(root.entropy, spawn_key=(index,)).generate_state(1)[0])


class DuplicateMasksWarning(UserWarning):
    """``generate_masks`` returned repeated masks: fewer distinct masks exist than were asked for."""


def _rows_with_k_ones(keys: NDArray[np.float64], k: NDArray[np.int64]) -> BoolArray:
    """Row i is True at the ``k[i]`` positions where ``keys[i]`` is smallest."""
    ranks = np.argsort(np.argsort(keys, axis=1, kind="stable"), axis=1, kind="stable")
    return ranks < k[:, None]


def sample_masks(m: int, n: int, scale: float, *, seed: Seed = None) -> BoolArray:
    """The paper's mask generation algorithm (Section 3.2), exactly.

    ``n`` vectors of ``round(m * scale)`` zeros each get ``m`` ones at random positions;
    columns that are zero in every vector are dropped. The width of the result is random,
    ``expected_width(m, n, scale)`` on average.

    Returns:
        bool array of shape (n, width), every row with ``m`` ones.
    """
    m = check_int("m", m, minimum=1)
    n = check_n(n)
    scale = check_scale(scale)
    rng = make_rng(seed)
    width = max(m, round(m * scale))
    keys = rng.random((n, width))
    masks = _rows_with_k_ones(keys, np.full(n, m, dtype=np.int64))
    return masks[:, masks.any(axis=0)]


def ones_per_mask(channels: int, n: int, scale: float) -> int:
    """Number of ones in each of the ``n`` masks ``generate_masks`` makes for ``channels``.

    The paper's algorithm with ``M`` ones per mask keeps ``M*S*(1-(1-1/S)^n)`` channels on
    average; solving that for the given width gives ``M``. It is clipped to
    ``[ceil(channels/n), channels]`` so that every channel can be used by some mask.
    """
    channels = check_channels(channels)
    n = check_n(n)
    scale = check_scale(scale)
    kept_fraction = scale * (1.0 - (1.0 - 1.0 / scale) ** n)
    ones = round(channels / kept_fraction)
    return min(channels, max(ones, math.ceil(channels / n)))


def _distinct_subsets(channels: int, ones: int, *, at_most: int) -> int:
    """``min(comb(channels, ones), at_most)``, in O(log(at_most)) steps instead of a huge binomial."""
    count = 1
    for i in range(min(ones, channels - ones)):
        count = count * (channels - i) // (i + 1)  # comb(channels, i + 1), exact
        if count >= at_most:
            return at_most
    return min(count, at_most)


def _replace_repeats(masks: BoolArray, distinct: int, rng: np.random.Generator) -> None:
    """Replace, in place, masks that repeat an earlier one by unused masks, until ``distinct`` masks differ.

    A replaced mask's channels all stay in its earlier copy, so coverage and the number of ones are
    kept. A replacement is the first unused set among the ``ones``-subsets of a random channel order:
    the first subset is a uniform draw, and at most ``n - 1`` subsets are in use, so the walk is short.
    """
    channels = masks.shape[1]
    ones = int(masks[0].sum())
    in_use = {row.tobytes() for row in masks}
    kept: set[bytes] = set()
    for row in masks:
        if len(in_use) >= distinct:
            return
        if row.tobytes() not in kept:
            kept.add(row.tobytes())
            continue
        for subset in itertools.combinations(rng.permutation(channels), ones):
            row[:] = False
            row[list(subset)] = True
            if row.tobytes() not in in_use:
                break
        in_use.add(row.tobytes())
        kept.add(row.tobytes())


def generate_masks(channels: int, n: int, scale: float, *, seed: Seed = None) -> BoolArray:
    """Fixed-width masks for a layer with ``channels`` channels.

    Every mask has the same number of ones (``ones_per_mask(channels, n, scale)``), every
    channel is used by at least one mask, the masks are distinct whenever that many masks with
    this number of ones exist, and the mean pairwise IoU is close to the paper's
    ``1/(2*scale-1)``. ``scale=1`` (or ``n=1``) gives all ones, a single model; a large scale
    gives disjoint masks.

    The construction is direct, with no retry loop: a random permutation deals the channels out
    to the masks (coverage), then each mask draws its remaining ones uniformly from the channels
    it was not dealt. A mask that repeats an earlier one (likely only below a few dozen
    channels) is then replaced by an unused mask, found in at most ``n`` candidates. Its cost is
    a few sorts of an (n, channels) array.

    Args:
        channels: width of the masks (number of channels of the layer), >= 1.
        n: number of masks, >= 1.
        scale: overlap control, a finite number >= 1.
        seed: None (fresh entropy), an int (same masks on every run) or a Generator.

    Returns:
        bool array of shape (n, channels).

    Warns:
        DuplicateMasksWarning: ``scale > 1`` but fewer than ``n`` distinct masks with this number
            of ones exist (``comb(channels, ones) < n``); as many distinct masks as exist are
            returned, and the other members repeat them.
    """
    channels = check_channels(channels)
    n = check_n(n)
    scale = check_scale(scale)
    ones = ones_per_mask(channels, n, scale)
    rng = make_rng(seed)
    owner = np.argsort(rng.random(channels), kind="stable") % n  # channel -> mask it is dealt to
    dealt: BoolArray = owner[None, :] == np.arange(n)[:, None]
    extra_needed = ones - dealt.sum(axis=1)
    keys = rng.random((n, channels))
    keys[dealt] = 2.0  # never re-draw a dealt channel
    masks = dealt | _rows_with_k_ones(keys, extra_needed)
    distinct = _distinct_subsets(channels, ones, at_most=n)
    if distinct < n and scale > 1.0:
        warnings.warn(
            f"{n} masks cannot all differ: the number of distinct masks with {ones} ones among {channels} channels "
            f"is {distinct}, less than n, so members share masks (channels={channels}, n={n}, scale={scale}); "
            "use more channels or fewer masks",
            DuplicateMasksWarning,
            stacklevel=2,
        )
    _replace_repeats(masks, distinct, rng)
    return masks


def validate_masks(masks: ArrayLike) -> BoolArray:
    """Check user-supplied masks and return them as a new bool array of shape (n, channels).

    Accepts bool arrays and numeric arrays holding only 0 and 1.

    Raises:
        ValueError: not 2-D, empty, values other than 0/1, or a mask with no ones.
    """
    array = np.asarray(masks)
    if array.ndim != 2:
        raise ValueError(f"masks must be a 2-D array (n, channels); received shape {array.shape}")
    if array.shape[0] < 1 or array.shape[1] < 1:
        raise ValueError(f"masks must have n >= 1 rows and channels >= 1 columns; received shape {array.shape}")
    if array.dtype != np.bool_:
        if not (np.issubdtype(array.dtype, np.number) and not np.issubdtype(array.dtype, np.complexfloating)):
            raise ValueError(f"masks must be boolean or numeric 0/1; received dtype {array.dtype}")
        binary = (array == 0) | (array == 1)
        if not binary.all():
            bad = array[~binary].ravel()[0]
            raise ValueError(f"masks must hold only 0 and 1; received the value {bad!r}")
    result = np.array(array != 0, dtype=np.bool_)
    empty = np.flatnonzero(~result.any(axis=1))
    if empty.size:
        raise ValueError(f"every mask needs at least one 1; mask(s) {empty.tolist()} are all zero")
    return result


@dataclass(frozen=True, eq=False)
class LayerArguments:
    """A Masksembles layer's arguments, validated once for every framework by ``layer_arguments``.

    ``masks``: the (n, C) masks the user gave, or None (then they are generated once the channels are known).
    """

    n: int
    scale: float | None
    seed: int | np.random.Generator | None
    masks: BoolArray | None
    channel_axis: int
    mode: str

    def masks_for(self, channels: int | None) -> BoolArray:
        """The layer's (n, C) masks for ``channels`` input channels (None: not known, only with given masks)."""
        if self.masks is not None:
            if channels is not None and check_channels(channels) != self.masks.shape[1]:
                raise ValueError(
                    f"channels={channels} does not match the masks' width {self.masks.shape[1]} "
                    f"(masks shape {self.masks.shape})"
                )
            return self.masks.copy()
        if channels is None or self.scale is None:
            raise ValueError("channels is required when masks is not given")
        return generate_masks(channels, self.n, self.scale, seed=self.seed)


def layer_arguments(
    channels: object,
    n: object,
    scale: object,
    *,
    seed: object = None,
    masks: ArrayLike | None = None,
    channel_axis: object,
    mode: object = "grouped",
) -> LayerArguments:
    """Validate what a Masksembles layer takes, in one order for every framework.

    The order: ``channels`` (None when the layer reads them from its input), ``n``, ``scale``, ``seed``, ``masks``
    (and that they agree with ``n`` and ``channels``), ``channel_axis``, ``mode``. ``n`` and ``scale`` may be None
    when ``masks`` is given (``n`` is then the number of masks).

    Raises:
        TypeError, ValueError: the first argument that is wrong, with its name, the allowed values and the value.
    """
    checked_channels = None if channels is None else check_channels(channels)
    checked_n = None if n is None else check_n(n)
    checked_scale = None if scale is None else check_scale(scale)
    checked_seed = check_seed(seed)
    given = None if masks is None else validate_masks(masks)
    if given is None and (checked_n is None or checked_scale is None):
        raise ValueError("n and scale are required when masks is not given")
    if given is not None:
        if checked_n is not None and checked_n != given.shape[0]:
            raise ValueError(
                f"n={checked_n} does not match the {given.shape[0]} masks given (masks shape {given.shape})"
            )
        if checked_channels is not None and checked_channels != given.shape[1]:
            raise ValueError(
                f"channels={checked_channels} does not match the masks' width {given.shape[1]} "
                f"(masks shape {given.shape})"
            )
    return LayerArguments(
        n=int(given.shape[0]) if given is not None else cast(int, checked_n),
        scale=checked_scale,
        seed=checked_seed,
        masks=given,
        channel_axis=check_channel_axis(channel_axis),
        mode=check_mode(mode),
    )
