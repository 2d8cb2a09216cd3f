"""Flax Masksembles layers in sequence-first blocks, (L, B, C) (after ``nnx.RNN``/``nn.RNN`` with ``time_major=True``):
each layer groups the samples along axis 1 there, so every sample meets one member, as in a batch-first twin with the
same weights and masks; ``predict`` and ``pack`` run the members per sample. A declared axis the batch is not on, a
model called on sequence-first inputs, and an output whose axes 0 and 1 both hold the tiled batch are refused with
what to do."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import masksembles_flax as mf
from masksembles_flax import linen as ml
from masksembles_flax import nnx as mn

N, LENGTH, FEATURES, HIDDEN = 4, 5, 6, 16


def close(actual: Any, expected: Any) -> None:
    """Equal up to float32 rounding (the twins run the same arithmetic on transposed arrays)."""
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=1e-5, atol=1e-5)


def batch(size: int, seed: int = 1) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (size, LENGTH, FEATURES))


class Recurrent(nnx.Module):
    """Batch-first inputs (B, L, F) through an RNN of either layout, then Linear layers (and a dropout) on its output:
    (L, B, H) for a time-major one. Returns (B, L, 3), or the time-major (L, B, 3) with ``sequence_output``."""

    def __init__(self, time_major: bool, *, sequence_output: bool = False, dropout: float = 0.0) -> None:
        rngs = nnx.Rngs(0)
        self.time_major, self.sequence_output = time_major, sequence_output
        self.rnn = nnx.RNN(nnx.SimpleCell(FEATURES, HIDDEN, rngs=rngs), time_major=time_major)
        self.hidden = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.head = nnx.Linear(HIDDEN, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.rnn(x.transpose(1, 0, 2) if self.time_major else x)
        y = self.head(self.drop(nnx.relu(self.hidden(h))))
        return y.transpose(1, 0, 2) if self.time_major and not self.sequence_output else y


@functools.cache
def nnx_twins(surgery: str, *, sequence_output: bool = False) -> tuple[nnx.Module, nnx.Module]:
    """A model with a time-major RNN and its batch-first twin: the same weights, masks placed the same way, the
    layers' axes declared from an example of 4 samples (made once: a test that changes them changes a clone)."""
    x = batch(4)
    made = []
    for time_major in (True, False):
        if surgery == "insert":
            made.append(mn.insert(Recurrent(time_major, sequence_output=sequence_output), N, 2.0, seed=0,
                                  example_input=x))  # fmt: skip
        else:
            model = Recurrent(time_major, sequence_output=sequence_output, dropout=0.5)
            made.append(mn.convert_dropout(model, x, N, 2.0, seed=0))
    return made[0], made[1]


def axes(model: nnx.Module) -> list[int | None]:
    return [layer.batch_axis for _, layer in nnx.iter_graph(model) if isinstance(layer, mn.Masksembles)]


def as_sequence_first(members: Any) -> Any:
    """A batch-first twin's predict (n, B, L, K) in a sequence-first output's layout (L, n*B, K)."""
    return members.transpose(2, 0, 1, 3).reshape(LENGTH, -1, members.shape[-1])


@pytest.mark.parametrize("surgery", ["insert", "convert_dropout"])
def test_nnx_time_major_model_groups_by_sample_as_its_batch_first_twin(surgery: str) -> None:
    """Training call, predict (whole and in two chunks of the batch) and pack equal the twin's: each sample meets one
    member, not a mix of members over its token positions (main's code grouped axis 0 of (L, B, C): 0.6 apart)."""
    x = batch(4)
    sequence, twin = nnx_twins(surgery)
    assert 1 in axes(sequence) and set(axes(twin)) == {0}
    close(sequence(x), twin(x))
    expected = mf.predict(twin, x)
    close(mf.predict(sequence, x), expected)
    close(jnp.concatenate([mf.predict(sequence, x[:3]), mf.predict(sequence, x[3:])], axis=1), expected)
    if surgery == "convert_dropout":  # one pack here: its traces and compilations take seconds
        close(mn.pack(sequence, x, program="packed")(x), expected)


def test_a_sequence_first_output_keeps_the_members_blocks_in_predict_and_pack() -> None:
    """An output (L, n*B, K) keeps member k's block at ``[:, k*B:(k+1)*B]``: the twin's predict rearranged, in
    predict and in the packed program."""
    x = batch(3)
    sequence, twin = nnx_twins("convert_dropout", sequence_output=True)
    expected = as_sequence_first(mf.predict(twin, x))
    close(mf.predict(sequence, x), expected)
    close(mn.pack(sequence, x, program="packed")(x), expected)


@pytest.mark.slow
def test_dense_programs_extracted_members_and_other_batch_sizes_of_a_sequence_first_model() -> None:
    """pack's dense program and extract_member keep predict's layout of a sequence-first output; a packed program
    built at one batch size runs at others."""
    x = batch(3)
    sequence, twin = nnx_twins("insert", sequence_output=True)
    members = mf.predict(twin, x)
    close(mn.pack(sequence, x, program="dense")(x), as_sequence_first(members))
    close(mn.extract_member(sequence, 2, x)(x), members[2].transpose(1, 0, 2))
    packed = mn.pack(sequence, x, program="packed")
    for size in (1, 6):
        close(packed(batch(size, seed=size)), as_sequence_first(mf.predict(twin, batch(size, seed=size))))


def test_a_shape_both_layouts_fit_is_told_by_the_example_input() -> None:
    """At B == L, (L, B, C) fits both layouts: insert's example input declares the layers (the axis that grows with
    one more sample); undeclared, a call reads axis 0, the batch-first convention (torch's rule), and pack, whose
    probe batch sizes reach L, refuses the model."""
    x = batch(LENGTH)
    declared, twin = nnx_twins("insert")
    close(declared(x), twin(x))
    undeclared = mn.insert(Recurrent(True), N, 2.0, seed=0)
    assert set(axes(undeclared)) == {None}
    close(undeclared(batch(3)), twin(batch(3)))  # L=5 is no multiple of B=3: axis 1 is told by the shape
    assert not np.allclose(undeclared(x), twin(x), atol=1e-3)  # (5, 5, C): axis 0, by token position
    with pytest.raises(ValueError, match=r"different operations at batch sizes 3 and 5.*declares no batch_axis"):
        mn.pack(undeclared, batch(3))  # its probes at 3, 4 and 5 samples reach B = L


class LinenRecurrent(nn.Module):
    """linen's ``Recurrent``: batch-first inputs, an ``nn.RNN`` of either layout, Dense layers and a dropout."""

    time_major: bool
    sequence_output: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.RNN(nn.SimpleCell(HIDDEN), time_major=self.time_major)(x.transpose(1, 0, 2) if self.time_major else x)
        h = nn.Dropout(0.5, deterministic=True)(nn.relu(nn.Dense(HIDDEN)(h)))
        y = nn.Dense(3)(nn.relu(nn.Dense(HIDDEN)(h)))
        return y.transpose(1, 0, 2) if self.time_major and not self.sequence_output else y


def linen_wrapped(
    surgery: str, time_major: bool, example: jax.Array | None, sequence_output: bool = False
) -> nn.Module:
    module = LinenRecurrent(time_major, sequence_output)
    if surgery == "insert":
        return ml.insert(module, N, 2.0, seed=0, example_input=example)
    return ml.convert_dropout(module, N, 2.0, seed=0, example_input=example)


@pytest.mark.parametrize(
    ("surgery", "declared"),
    [
        ("insert", True),
        ("convert_dropout", False),
        pytest.param("insert", False, marks=pytest.mark.slow),
        pytest.param("convert_dropout", True, marks=pytest.mark.slow),
    ],
)
def test_linen_time_major_model_groups_by_sample_as_its_batch_first_twin(surgery: str, declared: bool) -> None:
    """linen: the same variables (params and masks) in both layouts; apply and predict equal, whether the example
    declared the axes or each call decides them from the recorded batch size."""
    x = batch(4)
    sequence = linen_wrapped(surgery, True, x if declared else None)
    twin = linen_wrapped(surgery, False, x)
    assert (1 in dict(sequence.batch_axes).values()) == declared
    assert set(dict(twin.batch_axes).values()) == {0}
    variables = sequence.init(jax.random.key(0), x)
    close(sequence.apply(variables, x), twin.apply(variables, x))
    expected: Any = mf.predict(functools.partial(twin.apply, variables), x)
    close(mf.predict(functools.partial(sequence.apply, variables), x), expected)
    close(mf.predict(lambda b: sequence.apply(variables, b), x[:3]), expected[:, :3])


def test_linen_sequence_first_output_keeps_the_members_blocks() -> None:
    x = batch(3)
    sequence = linen_wrapped("convert_dropout", True, x, sequence_output=True)
    twin = linen_wrapped("convert_dropout", False, x)
    variables = sequence.init(jax.random.key(0), x)
    expected = as_sequence_first(mf.predict(functools.partial(twin.apply, variables), x))
    close(mf.predict(functools.partial(sequence.apply, variables), x), expected)


def test_a_declared_axis_that_does_not_hold_the_batch_is_refused() -> None:
    """Declared batch-first, a layer refuses an input whose axis 1, not axis 0, holds the recorded batch; declared
    sequence-first, one whose axis 1 does not hold it (NNX and linen)."""
    x = batch(4)
    sequence = nnx.clone(nnx_twins("insert")[0])
    for _, layer in nnx.iter_graph(sequence):
        if isinstance(layer, mn.Masksembles) and layer.batch_axis == 1:
            layer.batch_axis = 0
    with pytest.raises(ValueError, match=r"batch_axis=0\) received shape \(5, 4, 16\), whose axis 1, not axis 0"):
        sequence(x)
    with pytest.raises(ValueError, match=r"batch_axis=0\) received shape \(5, 16, 16\)"):
        mf.predict(sequence, x)
    layer = ml.Masksembles(n=N, scale=2.0, seed=0, batch_axis=1)
    variables = layer.init(jax.random.key(0), jnp.ones((LENGTH, 4, HIDDEN)))
    with mf.batch_size(LENGTH), pytest.raises(ValueError, match=r"batch_axis=1\) expects a sequence-first input"):
        layer.apply(variables, jnp.ones((LENGTH, 4, HIDDEN)))  # the recorded batch is 5, axis 1 holds 4


class TimeMajorInputs(nnx.Module):
    """A model called on sequence-first inputs (L, B, F) that it hands to Linear layers: tiling axis 0 repeats L."""

    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.rnn = nnx.RNN(nnx.SimpleCell(FEATURES, HIDDEN, rngs=rngs), time_major=True)
        self.hidden, self.head = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs), nnx.Linear(HIDDEN, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(nnx.relu(self.hidden(self.rnn(x))))


def test_a_model_called_on_sequence_first_inputs_is_refused() -> None:
    """A time-major RNN called by predict or pack itself is refused by its type; a model that hands such inputs on is
    caught by its declared layers (the tiled axis 0 is not the batch their axis 1 holds)."""
    rngs = nnx.Rngs(0)
    rnn = nnx.RNN(nnx.SimpleCell(FEATURES, HIDDEN, rngs=rngs), time_major=True)
    time_major = jnp.ones((LENGTH, 4, FEATURES))
    with pytest.raises(ValueError, match=r"predict takes inputs with the samples on axis 0.*RNN with time_major=True"):
        mf.predict(rnn, time_major, n=N)
    with pytest.raises(ValueError, match=r"pack/extract_member takes inputs with the samples on axis 0"):
        mn.pack(rnn, time_major)
    module = nn.RNN(nn.SimpleCell(HIDDEN), time_major=True)
    variables = module.init(jax.random.key(0), time_major)
    with pytest.raises(ValueError, match=r"predict takes inputs with the samples on axis 0"):
        mf.predict(functools.partial(module.apply, variables), time_major, n=N)
    model = mn.insert(TimeMajorInputs(), N, 2.0, seed=0)  # its example would grow axis 0, L: declared by hand
    for path, layer in nnx.iter_graph(model):
        if isinstance(layer, mn.Masksembles) and path[0] in ("hidden", "head"):
            layer.batch_axis = 1
    refused = r"batch_axis=1\) expects a sequence-first input .* batch of {}; .*through a wrapper"
    with pytest.raises(ValueError, match=refused.format(LENGTH)):
        model(time_major)  # the model's batch is read on axis 0 of its input: L
    with pytest.raises(ValueError, match=refused.format(N * LENGTH)):
        mf.predict(model, time_major)


def test_an_output_whose_axes_0_and_1_both_hold_the_tiled_batch_is_refused() -> None:
    """A sequence-first output (L, n*B, K) with L = n*B: which axis is the batch cannot be told."""
    x = jax.random.normal(jax.random.key(1), (1, N, FEATURES))  # L = 4 = n*B
    sequence, _ = nnx_twins("convert_dropout", sequence_output=True)
    with pytest.raises(ValueError, match=r"\(4, 4, 3\) holds the tiled batch of 4x1 on axes 0 and 1"):
        mf.predict(sequence, x)


@pytest.mark.parametrize("value", [2, -1, True])
def test_batch_axis_is_0_1_or_none(value: object) -> None:
    with pytest.raises(ValueError, match="batch_axis must be 0"):
        mn.Masksembles(HIDDEN, N, 2.0, batch_axis=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_axis must be 0"):
        ml.Masksembles(n=N, scale=2.0, batch_axis=value)  # type: ignore[arg-type]


def test_with_uncertainty_refuses_a_sequence_first_output() -> None:
    """The head reads the members on axis 0: a sequence-first output (L, n*B, K) is refused, not read along L."""
    x = batch(3)
    sequence = nnx.clone(nnx_twins("convert_dropout", sequence_output=True)[0])
    sequence.eval()  # type: ignore[no-untyped-call]
    with pytest.raises(ValueError, match=r"with_uncertainty needs the model's output with the tiled batch of 4x3"):
        mn.with_uncertainty(sequence)(x)
    module = linen_wrapped("insert", True, x, sequence_output=True)
    variables = module.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"with_uncertainty needs the model's output with the tiled batch of 4x3"):
        ml.with_uncertainty(module).apply(variables, x)
