"""NNX ``with_uncertainty``: a packed or inserted model that answers with its uncertainty, computed in the graph."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

import masksembles_core.adapter as mca
from masksembles_core.heads import HeadSpec, check_head

from ._heads import check_members_first, uncertainty_outputs
from ._nnx_layers import Masksembles
from ._ops import predict
from ._packing import PackedMasksembles

TRAINING_FLAGS = ("deterministic", "use_running_average")  # False in training mode; eval() sets them to True


class UncertaintyHead(nnx.Module):
    """``model`` followed by the uncertainty head: (B, ...) -> a dict of arrays (``with_uncertainty``'s docstring).

    Attributes:
        model: the wrapped module (its state is this module's ``model`` state).
        spec: the validated head (``masksembles_core.heads.HeadSpec``); ``spec.outputs`` lists the dict's keys.
        n: the number of members.
        member_axis: the members' axis in what ``model`` returns (0 where the head tiles the batch).
        tiled: whether the head tiles the batch n times for ``model`` (an inserted model) or ``model`` returns its
            members itself (a packed one).
    """

    def __init__(self, model: nnx.Module, spec: HeadSpec, n: int, member_axis: int, tiled: bool) -> None:
        self.model = model
        self.spec, self.n, self.member_axis, self.tiled = spec, n, member_axis, tiled

    def __call__(self, x: jax.Array) -> dict[str, jax.Array]:
        """(B, ...) -> ``{name: array}`` in ``spec.outputs`` order: (B, K) probabilities and (B,) scores, or the
        regression moments (B, ...)."""
        if self.tiled:
            check_inference_mode(self.model)
            members = predict(self.model, x, self.n)
        else:
            members = self.model(x)
        if not isinstance(members, jax.Array):
            raise TypeError(
                f"with_uncertainty needs a model that returns one array; it returned {type(members).__name__}"
            )
        if self.tiled:
            check_members_first(members, self.n, x.shape[0])
        return uncertainty_outputs(members, self.spec, self.member_axis)


def with_uncertainty(
    model: nnx.Module,
    *,
    task: str = "classification",
    logits: bool = True,
    head: str | None = None,
    min_variance: float = 1e-6,
    member_axis: int = 0,
    n: int | None = None,
) -> UncertaintyHead:
    """``model`` answering with its uncertainty: an ``nnx.Module`` (B, ...) -> dict, the head computed with jax.numpy
    in the same graph, so ``nnx.jit``, ``jax.jit`` after ``nnx.split`` and ``jax.export`` (``export``) take it whole.

    The dict's keys and values are those of ``masksembles_core.heads.uncertainty_head`` on the members, in float32
    (at least): classification ``probabilities`` (B, K) (one logit: a sigmoid, K = 2), ``predictive_entropy``,
    ``expected_entropy``, ``mutual_information``, ``max_probability`` (B,); regression ``mean``, ``variance``, and
    with ``head="log_variance"``/``"variance"`` (members (n, B, ..., 2), as ``gaussian_nll_loss`` trains them)
    ``aleatoric`` and ``epistemic``.

    ``model`` is either

    - a model that returns its members: ``pack``'s ``PackedMasksembles`` ((n, B, ...): ``member_axis=0``), or a module
      around one that returns them on ``member_axis``; it is called as it is (pack has eval semantics);
    - a model with Masksembles layers (``insert``, ``convert_dropout``, your own): run as ``masksembles_flax.predict``
      runs it, on the batch tiled n times then untiled (``jnp`` reshapes, so it jits and exports), its members on
      axis 0. It must be in inference mode (``model.eval()``): checked here and at every call (trace).

    The head shares ``model``'s state (no copy). Members with concrete values (an eager call) are checked as the core
    checks them (logits that look like probabilities and the reverse, NaN); under ``jit`` or in an exported program
    the values are unknown while tracing and are not checked.

    Args:
        task, logits, head, min_variance: as ``masksembles_core.heads.check_head`` takes them.
        member_axis: the members' axis in ``model``'s output (a model that returns its members only).
        n: the number of members; None reads it from the model (its Masksembles layers, or the packed members).

    Raises:
        ValueError: bad head arguments (``check_head``); a model with no members (no Masksembles layer and no packed
            program) or one member alone (``extract_member``); ``n`` that differs from the model's; ``member_axis``
            other than 0 on a model the head tiles; a model in training mode (Dropout ``deterministic=False``,
            BatchNorm ``use_running_average=False``, a random-mode Masksembles layer not deterministic).
        TypeError: ``model`` is not an ``nnx.Module``, or ``logits``/``min_variance`` of the wrong type.
    """
    spec = check_head(task, logits=logits, head=head, min_variance=min_variance)
    if not isinstance(model, nnx.Module):
        raise TypeError(f"with_uncertainty takes an nnx.Module; received {type(model).__name__}")
    nodes = [node for _, node in nnx.iter_graph(model)]
    packed = [node for node in nodes if isinstance(node, PackedMasksembles)]
    counts = [node.n for node in nodes if isinstance(node, Masksembles)]
    if any(node.plan.squeeze for node in packed):
        raise ValueError(
            "with_uncertainty needs every member, and the model holds one member alone (extract_member): "
            "wrap pack(model, example) or the model itself"
        )
    if packed and counts:
        raise ValueError("the model holds both a packed program and Masksembles layers: wrap one of them")
    if packed:
        return UncertaintyHead(model, spec, mca.check_members([len(p.members) for p in packed], n), member_axis, False)
    if not counts:
        raise ValueError(
            f"{type(model).__name__} has no Masksembles layer and no packed program: it has no members to take the "
            f"uncertainty of (insert or convert_dropout puts Masksembles layers into a model; pack packs it)"
        )
    if member_axis != 0:
        raise ValueError(
            f"member_axis={member_axis!r} is for a model that returns its members; the head stacks the members "
            f"of a model with Masksembles layers on axis 0"
        )
    check_inference_mode(model)
    return UncertaintyHead(model, spec, mca.check_members(counts, n), 0, True)


def check_inference_mode(model: nnx.Module) -> None:
    """Refuse a model set to train: a module whose ``deterministic`` or ``use_running_average`` is False (Dropout,
    attention dropout, BatchNorm; a Masksembles layer only in random mode, grouped ones ignore the flag)."""
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module) or (isinstance(node, Masksembles) and node.mode != "random"):
            continue
        attributes: dict[str, Any] = vars(node)  # not getattr: Masked forwards unknown names to its layer
        for flag in TRAINING_FLAGS:
            if attributes.get(flag) is False:
                where = ".".join(map(str, path)) or "the model"
                raise ValueError(
                    f"with_uncertainty answers in inference mode, and the model is set to train: {where} "
                    f"({type(node).__name__}) has {flag}=False. Call model.eval() first (predict and pack run "
                    f"an eval copy of the model; the head shares the model itself)"
                )
