"""Packed inference for Keras 3: every member at about the cost of one model, from the structure of the masks.

Member ``k`` of a Masksembles model only ever uses its live channels, so the layers next to a Masksembles layer can
be shrunk physically. ``pack`` builds one Keras model that runs all members on compacted weights (or, with
``program="dense"``, as the tiled dense model: every layer at full width on the member-stacked batch; ``"auto"``
times both); ``extract_member`` builds member ``k`` alone, as a smaller model. Both have inference semantics
(BatchNormalization moving statistics, Dropout off, grouped masks) and return a ``PackedMasksembles``: an ordinary
functional Keras model, batch first, that ``predict``, ``evaluate``, ``jit_compile=True`` and ``.keras`` files
handle like any other.

How, one file a step: ``_pack_capture`` reads the model's graph call by call (layers and raw operations), probes
every value at two batch sizes and classifies each call as a ``masksembles_core.packing`` kind, answering the core's
questions by running the call alone; ``masksembles_core.captured`` solves the channel axes and builds the core's
graph, from which ``masksembles_core.packing.plan_program`` decides which channels each member computes; ``_pack_emit``
writes the program as Keras layers (``_packed_layers``). This module builds, verifies against ``predict`` and
chooses.

Exactness: results equal the dense model's for finite activations, up to float rounding. Channels that Masksembles
zeroes are left out instead of multiplied by 0 (a masked inf or NaN gives NaN in the dense model and is absent here).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from time import perf_counter as clock  # the wall clock auto's build time and timings read
from typing import Any

import keras
import numpy as np

import masksembles_core as mc
from masksembles_core import captured
from masksembles_core.adapter import check_program
from masksembles_core.packing import (
    AUTO_BUILD,
    VERIFICATION,
    VERIFY_SAMPLES,
    FoldConflict,
    chosen_members,
    output_mismatch,
    plan_program,
    program_raised,
    samples_per_chunk,
    timed_choice_on_samples,
    verified,
)

from . import _packed_layers
from ._inference import _no_autograd
from ._layers import SERIALIZATION_PACKAGE, Masksembles
from ._pack_capture import Capture, by_name, compiled, model_input
from ._pack_emit import Emitter
from ._packed_layers import SelectMembers, TileBatch, in_chunks

REPORT = ("members", "program", "fallbacks", "macs", "seconds", "choice")
CHUNKED = ("jax", "tensorflow")  # the backends a program runs on batch chunks on


@keras.saving.register_keras_serializable(package=SERIALIZATION_PACKAGE)
class PackedMasksembles(keras.Model):  # type: ignore[misc]  # keras is untyped: Model is Any to mypy
    """Members of a Masksembles model on compacted weights, made by ``pack`` or ``extract_member``.

    A functional Keras model: (B, ...) -> (B, m, ...) for the m members it was built for (``np.moveaxis(y, 1, 0)``
    is ``masksembles_keras.predict``'s (m, B, ...)), or (B, ...) for an extracted member, so ``model.predict`` and
    ``model.evaluate`` batch it like any model. Inference only. The report (``members``, ``program``,
    ``fallbacks``, ``macs``, ``seconds``, ``choice``) is saved in its config and kept by ``.keras`` files.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        report = dict(kwargs.pop("masksembles", None) or {})
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "_report", report)  # not tracked by Keras: plain values for the config

    def call(self, inputs: Any, training: Any = None, mask: Any = None, **kwargs: Any) -> Any:
        """The functional model's call; on JAX and TensorFlow, a program proven to keep samples apart runs on chunks
        of the batch where the batch is known when it is traced and its largest tensor (its report's
        ``sample_bytes`` per sample) exceeds ``_packed_layers.CHUNK_BYTES`` (``masksembles_core.packing.
        samples_per_chunk``)."""
        leaves = keras.tree.flatten(inputs)
        batch = leaves[0].shape[0] if len(leaves) == 1 else None
        sample_bytes = int(self._report.get("sample_bytes", 0)) * _declared_none(self, leaves[0].shape)
        if sample_bytes and isinstance(batch, int) and keras.backend.backend() in CHUNKED:
            samples = samples_per_chunk(batch, sample_bytes, _packed_layers.CHUNK_BYTES)
            if samples:
                run = super().call
                return in_chunks(lambda chunk: run(chunk, training=training, mask=mask, **kwargs), leaves[0], samples)
        return super().call(inputs, training=training, mask=mask, **kwargs)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "masksembles": dict(self._report)}

    @property
    def members(self) -> tuple[int, ...]:
        """The members it computes (indices into the masks)."""
        return tuple(self._report.get("members", ()))

    @property
    def program(self) -> str:
        """``"packed"`` (compacted where it can), or ``"dense"`` (the tiled model, as ``predict`` runs it)."""
        return str(self._report.get("program", ""))

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """The model's layers and operations that run at full width on the member-stacked batch (nothing here
        compacts them), as ``path (class)``; the first entry starts with ``verification:`` where verification
        replaced the packed program."""
        return tuple(self._report.get("fallbacks", ()))

    @property
    def macs(self) -> dict[str, int]:
        """Multiply-adds per sample of the Dense and convolution layers and of attention (``MultiHeadAttention``'s
        projections, scores and weighted sums): ``dense`` (m dense models), ``packed`` (as
        built) and ``fallback`` (the part of ``packed`` that runs at full width); ``moves``: those of the one-hot
        products that move channels between layers (TensorFlow, not in ``packed``); empty when the whole model runs
        tiled."""
        return dict(self._report.get("macs", {}))

    @property
    def seconds(self) -> dict[str, float]:
        """What ``pack(program="auto")`` measured on the example input (median seconds per call), or empty."""
        return dict(self._report.get("seconds", {}))

    @property
    def choice(self) -> str:
        """Why ``pack(program="auto")`` returned this program, from its interleaved timings; empty otherwise."""
        return str(self._report.get("choice", ""))

    def __repr__(self) -> str:
        if self.program == "dense":
            why = self.choice or "; ".join(f for f in self.fallbacks if f.startswith(VERIFICATION))
            return f"<PackedMasksembles members={list(self.members)}, program=dense" + (f" ({why})>" if why else ">")
        shown = ", ".join(self.fallbacks[:8]) + (", ..." if len(self.fallbacks) > 8 else "")
        return f"<PackedMasksembles members={list(self.members)}, fallbacks={len(self.fallbacks)}" + (
            f": {shown}>" if shown else ">"
        )


def _declared_none(model: keras.Model, shape: Sequence[int | None]) -> int:
    """The product of ``shape``'s sizes on the axes (batch left out) the model's input declares None, as known when
    traced (``sample_bytes`` counts each such size as 1); 0 where one is unknown then."""
    sizes = [size for size, declared in zip(shape[1:], model.inputs[0].shape[1:], strict=True) if declared is None]
    product = 1
    for size in sizes:
        if size is None:
            return 0
        product *= int(size)
    return product


def _report(members: Sequence[int], program: str, fallbacks: Sequence[str], macs: dict[str, int]) -> dict[str, Any]:
    return {"members": [int(k) for k in members], "program": program, "fallbacks": list(fallbacks),
            "macs": {key: int(value) for key, value in macs.items()}, "seconds": {}, "choice": ""}  # fmt: skip


def _build(capture: Capture, chosen: Sequence[int], squeeze: bool, *, dense: bool = False) -> PackedMasksembles:
    """One program from the capture: compacted where it can, or (``dense``) every call at full width."""
    while True:
        capture.reset(dense)
        axis = captured.solve_axes(capture)
        nodes, output = captured.graph_nodes(capture, axis)
        pick = chosen[0] if squeeze and _reads_the_batch(capture) else -1
        members = list(range(capture.n)) if pick >= 0 else list(chosen)
        try:
            program = plan_program(nodes, output, members)
            break
        except FoldConflict as conflict:  # attention whose mask is computed per member: a plain fallback
            capture.unfold(conflict.node)
    emitter = Emitter(capture, axis, program, squeeze, pick)
    report = _report(chosen, "dense" if dense else "packed", emitter.fallbacks, emitter.macs)
    if keras.backend.backend() in CHUNKED and len(capture.inputs) == 1 and _keeps_samples_apart(capture):
        report["sample_bytes"] = emitter.sample_bytes
    return PackedMasksembles(emitter.input, emitter.output, name=f"{capture.model.name}_packed", masksembles=report)


def _reads_the_batch(capture: Capture) -> bool:
    """Whether a call that runs at full width may read the batch (its size, or other samples) and so runs on the
    member-stacked batch per member: one member's program must then compute every member, as ``predict`` does (a
    Masksembles layer at full width needs no other member: it applies the computed members' masks)."""
    return any(
        op.kind == "fallback" and op.batch_dependent and not isinstance(op.call.operation, Masksembles)
        for op in capture.ops.values()
    )


def _keeps_samples_apart(capture: Capture) -> bool:
    """Whether no call of the model mixes samples (a Masksembles layer's masks go by member in the program), so that
    the program may run on chunks of the batch (verification then checks it on chunks of one sample)."""
    return not any(
        not isinstance(call.operation, Masksembles) and capture.mixes_samples(call, key)
        for key, (call, _) in capture.by_key.items()
    )


def _whole_model(model: keras.Model, n: int, chosen: Sequence[int], squeeze: bool, why: str) -> PackedMasksembles:
    """The model itself (a copy, or the model where its config does not rebuild it) on the tiled batch: what
    ``predict`` computes."""
    try:
        copy = keras.models.clone_model(model)
        copy.set_weights(model.get_weights())
    except Exception:  # a model whose config does not rebuild it (a keras-hub task after surgery)
        copy = model
    plain = len(model.inputs) == 1 and not by_name(model)
    inputs = [
        keras.Input(shape=t.shape[1:], dtype=t.dtype, name="input" if plain else t.name) for t in model.inputs
    ]  # fmt: skip
    x = model_input(model, inputs)
    tiled = keras.tree.map_structure(TileBatch(n), x)
    y = keras.tree.map_structure(SelectMembers(n, chosen, squeeze), copy(tiled, training=False))
    report = _report(chosen, "dense", [why], {})
    return PackedMasksembles(x, y, name=f"{model.name}_packed", masksembles=report)


class _Verifier:
    """Checks built programs against ``predict`` on the first ``VERIFY_SAMPLES`` samples of the example input."""

    def __init__(self, model: keras.Model, x: Any, n: int, chosen: Sequence[int], squeeze: bool) -> None:
        self.x = keras.tree.map_structure(lambda leaf: leaf[:VERIFY_SAMPLES], x)
        tiled = _run(model, keras.tree.map_structure(lambda leaf: mc.tile(leaf, n), self.x))  # what predict runs
        members = [mc.untile(_numpy(leaf), n)[list(chosen)] for leaf in keras.tree.flatten(tiled)]
        self.expected = [leaf[0] for leaf in members] if squeeze else members
        self.squeeze = squeeze

    def mismatch(self, packed: keras.Model) -> str | None:
        """Why ``packed`` differs from ``predict`` on the sample, or None."""
        return self._differs(lambda: _run(packed, self.x))

    def chunked_mismatch(self, packed: keras.Model) -> str | None:
        """Why ``packed`` run on chunks of one sample differs from ``predict`` on the sample, or None."""
        return self._differs(lambda: _run(packed, self.x, chunked=True))

    def _differs(self, run: Callable[[], Any]) -> str | None:
        try:
            actual = [_numpy(leaf) for leaf in keras.tree.flatten(run())]
        except Exception as error:  # a program that fails where the model runs differs from it
            return program_raised(error)
        if not self.squeeze:
            actual = [np.moveaxis(leaf, 1, 0) for leaf in actual]
        return output_mismatch(self.expected, actual, [_eps(leaf.dtype) for leaf in self.expected])


def _numpy(value: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(value))


def _eps(dtype: np.dtype) -> float:
    return float(np.finfo(dtype).eps) if np.issubdtype(dtype, np.inexact) else 0.0


def _run(model: keras.Model, x: Any, chunked: bool = False) -> Any:
    """One inference call of ``model`` on ``x`` (one compiled program on JAX; ``chunked``: on chunks of one sample)."""

    def run(value: Any) -> Any:
        return model(value, training=False)

    with _no_autograd():
        return compiled(lambda value: in_chunks(run, value, 1) if chunked else run(value))(x)


def _verified(
    packed: PackedMasksembles, verifier: _Verifier | None, full_width: Callable[[], PackedMasksembles],
    whole: Callable[[str], PackedMasksembles],
) -> PackedMasksembles:  # fmt: skip
    """``packed`` if it equals ``predict``; otherwise every call at full width, or the whole model tiled when that
    differs too, with the reason first in ``fallbacks`` (``masksembles_core.packing.verified``). A program that
    runs on batch chunks is checked on chunks of one sample (which also shows that it reads no batch size), and
    runs unchunked, checked as such, where that differs."""
    if verifier is None:
        return packed
    if packed._report.get("sample_bytes"):
        if verifier.chunked_mismatch(packed) is None:
            return packed
        del packed._report["sample_bytes"]
    replacements = [("every call at full width", full_width)] if packed.program == "packed" else []
    checked = verified(packed, packed.program, verifier.mismatch, replacements)
    result, reason = checked
    if result is None:
        return whole(f"{reason}: the whole model runs tiled")
    if reason:
        result._report["fallbacks"] = [reason, *result.fallbacks]
    if result is not packed:
        result._report.pop("sample_bytes", None)
    return result


def _timed(model: keras.Model, x: Any) -> Callable[[], object]:
    """One compiled inference call of ``model`` on ``x`` (``predict_on_batch``: the function ``predict`` runs)."""
    return lambda: model.predict_on_batch(x)


def _packed(
    model: keras.Model, example_input: Any, n: int | None, members: Sequence[int] | None, squeeze: bool,
    program: str, verify: bool,
) -> PackedMasksembles:  # fmt: skip
    """``pack``/``extract_member``: capture once, build the program(s), verify, and choose."""
    check_program(program)
    started = clock()
    capture = Capture(model, example_input, n)
    chosen = chosen_members(members, capture.n)
    verifier = _Verifier(model, capture.example, capture.n, chosen, squeeze) if verify else None

    def candidate(dense: bool) -> PackedMasksembles:
        return _verified(
            _build(capture, chosen, squeeze, dense=dense),
            verifier,
            lambda: _build(capture, chosen, squeeze, dense=True),
            lambda why: _whole_model(model, capture.n, chosen, squeeze, why),
        )

    if program != "auto":
        return candidate(program == "dense")
    packed = candidate(False)
    if packed.program == "dense":  # verification left nothing packed: nothing to choose
        return packed
    deadline = started + AUTO_BUILD * (clock() - started)  # AUTO_BUILD times what program="packed" takes
    candidates = {"packed": packed, "dense": candidate(True)}

    def calls_on(samples: int) -> dict[str, Callable[[], object]]:
        x = keras.tree.map_structure(lambda leaf: leaf[:samples], capture.example)
        return {name: _timed(built, x) for name, built in candidates.items()}

    batch = len(keras.tree.flatten(capture.example)[0])
    name, why, times = timed_choice_on_samples(
        calls_on, batch, "packed", deadline=deadline, clock=clock, compiled=True
    )  # predict_on_batch traces and compiles on its first call at a batch size
    result = candidates[name]
    result._report["seconds"] = {key: statistics.median(value) for key, value in times.items()}
    result._report["choice"] = why
    return result


def pack(
    model: keras.Model, example_input: Any, n: int | None = None, *, program: str = "auto", verify: bool = True
) -> PackedMasksembles:
    """All members of ``model`` in one model on compacted weights: (B, ...) -> (B, n, ...).

    Equals ``masksembles_keras.predict(model, x, n)`` moved to batch first (``np.moveaxis(y, 0, 1)``), in inference
    (BatchNormalization moving statistics, Dropout off), for finite activations, at about the cost the masks' overlap
    allows instead of n dense forward passes. ``example_input`` (batch on axis 0, any batch size; for a model with
    several inputs, their arrays in the structure of ``model.input``: a list, or a dict by input name) is run through
    the model call by call to record shapes; the model is read, not modified. The packed model takes inputs as the
    model does (sizes the model declares None stay free) and returns its output structure, each output batch first.
    Sequential and functional models pack, nested ones and raw operations (``x * 2.0``, ``keras.ops.sigmoid(x)``,
    ``x[:, 0]``) included; what this module cannot compact (custom layers, unknown operations, a ``Lambda``) runs at
    full width on the member-stacked batch and is listed in ``fallbacks``.

    Args:
        n: the number of members; None reads it from the model's Masksembles layers.
        program: ``"packed"`` (compacted where it can), ``"dense"`` (the tiled dense model: every call at full
            width on the member-stacked batch, as ``predict`` computes it), or ``"auto"`` (the default: both are
            timed with ``predict_on_batch`` in interleaved rounds on ``example_input``; the packed program is kept
            unless the dense one was clearly faster (``masksembles_core.packing.choose_program``); ``seconds`` holds
            the medians, ``choice`` the reason; give an example of the batch size you will run).
        verify: compare the program with ``predict`` on the first few samples of the example before returning it
            (the default). One that differs beyond float rounding is never returned: every call then runs at full
            width, or the whole model tiled, and the first entry of ``fallbacks`` says why. ``False`` skips it.

    Raises:
        TypeError: ``model`` is a subclassed model (its ``call()`` cannot be read) or not a Keras model.
        ValueError: ``program`` is not one of the three; an unbuilt model, an example that does not fit its inputs
            or whose arrays differ in batch size, no Masksembles layer (with ``n`` None), Masksembles layers of
            different n, or ``n`` that differs from theirs.
    """
    return _packed(model, example_input, n, None, False, program, verify)


def extract_member(model: keras.Model, k: int, example_input: Any, *, verify: bool = True) -> PackedMasksembles:
    """Member ``k`` of ``model`` as a standalone model: (B, ...) -> (B, ...).

    Every layer next to a Masksembles layer is physically shrunk to member ``k``'s live channels; the output equals
    member ``k``'s output of ``masksembles_keras.predict`` (inference, finite values), verified as in ``pack``. Same
    support and errors as ``pack``. Where a call that runs at full width may read the batch (a mean over it, its
    size), the returned model computes every member, as ``predict`` does, and returns member ``k``'s output.
    """
    return _packed(model, example_input, None, [k], True, "packed", verify)


__all__ = ["PackedMasksembles", "extract_member", "pack"]
