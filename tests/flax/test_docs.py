"""docs/flax.md runs as written: its Python blocks, section by section, and the messages and outputs it quotes."""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import masksembles_core as mc
from masksembles_core.heads import uncertainty_head
from masksembles_flax import predict
from masksembles_flax.nnx import Masks
from tests.flax.common import LinenMLP, assert_head_equals

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "flax.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.MULTILINE | re.DOTALL)


def sections() -> dict[str, list[tuple[str, str | None]]]:
    """Heading -> its (Python code, printed output or None) blocks, in order.

    A ``text`` block right after a Python block is what that block prints. Indented blocks (in lists) are prose.
    """
    found: dict[str, list[tuple[str, str | None]]] = {}
    heading = ""
    position = 0
    text = GUIDE.read_text()
    for match in FENCE.finditer(text):
        for line in text[position : match.start()].splitlines():
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
        blocks = found.setdefault(heading, [])
        language, body = match.groups()
        if language == "python":
            blocks.append((body, None))
        elif language == "text" and blocks and blocks[-1][1] is None and not text[position : match.start()].strip():
            blocks[-1] = (blocks[-1][0], body)
        position = match.end()
    return {heading: blocks for heading, blocks in found.items() if blocks}


SECTIONS = sections()


@pytest.fixture(scope="module")
def run_section(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], dict[str, Any]]]:
    """Run a section's blocks in order as one module (once per test module), in a fresh directory; check what
    they print against the guide's output blocks."""
    done: dict[str, types.ModuleType] = {}

    def run(heading: str) -> dict[str, Any]:
        if heading not in done:
            # A module in sys.modules, as a script would be: dataclasses (TrainState) look their module up.
            module = done[heading] = types.ModuleType(f"flax_guide_{len(done)}")
            sys.modules[module.__name__] = module
            directory, cwd = tmp_path_factory.mktemp("guide"), Path.cwd()
            os.chdir(directory)
            try:
                for code, expected in SECTIONS[heading]:
                    printed = io.StringIO()
                    with contextlib.redirect_stdout(printed):
                        exec(compile(code, f"{GUIDE}: {heading}", "exec"), vars(module))
                    if expected is not None:
                        assert printed.getvalue() == expected
            finally:
                os.chdir(cwd)
        return vars(done[heading])

    yield run
    for module in done.values():
        del sys.modules[module.__name__]


def test_the_guide_has_the_expected_sections() -> None:
    assert list(SECTIONS) == [
        "Linen",
        "Training with `TrainState`",
        "`insert` and `convert_dropout` (linen)",
        "NNX",
        "`insert`: Masksembles into an existing model",
        "`convert_dropout` and scan-over-layers (NNX)",
        "Packed inference (Flax NNX)",
        "Conformal prediction from `predict`",
        "Deploy",
    ]


def test_linen_and_nnx_quickstarts(run_section: Callable[[str], dict[str, Any]]) -> None:
    assert run_section("Linen")["members"].shape == (4, 8, 10)
    assert run_section("NNX")["members"].shape == (4, 8, 10)


def test_the_trainstate_pattern_trains_with_a_partial_batch_and_keeps_the_masks(
    run_section: Callable[[str], dict[str, Any]],
) -> None:
    guide = run_section("Training with `TrainState`")
    state, variables, restored = guide["state"], guide["variables"], guide["restored"]
    assert int(state.step) == 3 and np.isfinite(float(guide["loss"]))
    masks = jax.tree.leaves(state.masks)
    assert len(masks) == 3 and all(leaf.dtype == jnp.bool_ for leaf in masks)
    assert jax.tree.all(jax.tree.map(np.array_equal, state.masks, variables["masksembles"]))
    assert not any(jax.tree.leaves(jax.tree.map(np.array_equal, state.params, variables["params"])))
    assert not any(jax.tree.leaves(jax.tree.map(np.array_equal, state.batch_stats, variables["batch_stats"])))
    assert guide["members"].shape == (4, 5, 10) and guide["probs"].shape == (5, 10)
    for name, saved in (("params", state.params), ("batch_stats", state.batch_stats), ("masksembles", state.masks)):
        assert jax.tree.all(jax.tree.map(np.array_equal, restored[name], saved))


def test_insert_on_the_tutorial_cnn(run_section: Callable[[str], dict[str, Any]]) -> None:
    guide = run_section("`insert`: Masksembles into an existing model")
    model = guide["model"]
    assert np.isfinite(float(guide["loss"])) and guide["members"].shape == (4, 8, 10)
    rows = model.masksembles_report.changed
    trained = [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(model, Masks))]
    made = [mc.generate_masks(row.channels, 4, 2.0, seed=row.seed) for row in rows]
    assert sorted(map(np.ndarray.tobytes, trained)) == sorted(map(np.ndarray.tobytes, made))


def test_linen_insert_and_convert_dropout(run_section: Callable[[str], dict[str, Any]]) -> None:
    guide = run_section("`insert` and `convert_dropout` (linen)")
    assert guide["members"].shape == (4, 8, 10) and set(guide["variables"]["masksembles"]) == {"Dense_1", "Dense_2"}


def test_nnx_convert_dropout_on_scan_over_layers(run_section: Callable[[str], dict[str, Any]]) -> None:
    guide = run_section("`convert_dropout` and scan-over-layers (NNX)")
    assert guide["masks"].shape == (4, 4, 64) and guide["members"].shape == (4, 8, 10)
    assert not np.array_equal(guide["masks"][0], guide["masks"][1])


def test_packed_inference_equals_predict(run_section: Callable[[str], dict[str, Any]]) -> None:
    guide = run_section("Packed inference (Flax NNX)")
    expected = predict(guide["model"], guide["x"], 4)
    np.testing.assert_allclose(guide["y"], expected, rtol=1e-4, atol=1e-4)
    assert guide["member"](guide["x"]).shape == (2, 10)
    assert guide["packed"].program == "packed" and guide["fastest"].program in ("packed", "dense")
    np.testing.assert_allclose(guide["fastest"](guide["x"]), expected, rtol=1e-4, atol=1e-4)


def test_the_deploy_recipe_serves_the_core_head(run_section: Callable[[str], dict[str, Any]]) -> None:
    guide = run_section("Deploy")
    for batch in (1, 3):
        x = jax.random.normal(jax.random.key(batch), (batch, 8, 8, 3))
        assert_head_equals(guide["served"].call(x), uncertainty_head(np.asarray(predict(guide["model"], x))))
        v = jax.random.normal(jax.random.key(batch), (batch, 32))
        members = predict(lambda b: guide["Net"]().apply(guide["variables"], b), v, n=4)
        assert_head_equals(guide["served_linen"].call(v), uncertainty_head(np.asarray(members), task="regression"))


def quoted(text: str) -> str:
    return " ".join(text.split())


def test_the_missing_masks_error_is_the_one_quoted() -> None:
    model = LinenMLP()
    x = jnp.ones((4, 3))
    params = model.init(jax.random.key(0), x)["params"]
    with pytest.raises(ValueError) as info:
        model.apply({"params": params}, x)
    assert f"ValueError: {info.value}" in GUIDE.read_text()


def test_differentiating_every_collection_fails_as_quoted() -> None:
    model = LinenMLP()
    x = jnp.ones((4, 3))
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(TypeError) as info:
        jax.grad(lambda variables: model.apply(variables, x).sum())(variables)
    quote = re.search(r"`(TypeError: grad requires .*?)`", GUIDE.read_text(), re.DOTALL)
    assert quote is not None
    assert quoted(f"TypeError: {info.value}").startswith(quoted(quote.group(1)))
