"""The uncertainty head: a packed or Masksembles model answering with its predictive uncertainty, in torch ops.

``with_uncertainty`` wraps the model in an ``nn.Module`` whose output is ``masksembles_core.heads``' dict (the same
names, the values of ``masksembles_core.metrics``), computed in the graph so that it compiles and exports with the
model (``torch.export``, ONNX).
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import Tensor, nn

import masksembles_core.adapter as mca
from masksembles_core import metrics
from masksembles_core.heads import HeadSpec, check_head

from ._inference import refuse_sequence_first_inputs, tile
from ._layers import Masksembles, samples_known
from ._packing import PackedMasksembles
from ._structures import Inputs, batch_size, call, map_batched
from ._surgery import keep_masks_off_fused_paths


class UncertaintyHead(nn.Module):
    """A model with members and the uncertainty head over them, made by ``with_uncertainty``.

    ``forward`` takes what the model takes (batch-first) and returns a dict in ``spec.outputs`` order: classification
    ``probabilities`` (B, K) (K = 2 for one sigmoid logit), ``predictive_entropy``, ``expected_entropy``,
    ``mutual_information``, ``max_probability`` (B,); regression ``mean``, ``variance`` (B, ...) and, with a Gaussian
    ``head``, ``aleatoric``, ``epistemic`` (B, ...).
    """

    def __init__(self, model: nn.Module, spec: HeadSpec, *, tiled_members: int | None, member_axis: int) -> None:
        super().__init__()
        self.model = model
        self.spec = spec
        self.tiled_members = tiled_members  # n for a Masksembles model run on the tiled batch; None: it outputs them
        self.member_axis = member_axis
        self.train(False)  # the model is checked in eval mode; the head has no mode of its own

    @property
    def outputs(self) -> tuple[str, ...]:
        """The names of the dict it answers with, in order (ONNX ``output_names=list(head.outputs)``)."""
        return self.spec.outputs

    def extra_repr(self) -> str:
        how = f"tiled n={self.tiled_members}" if self.tiled_members else f"member_axis={self.member_axis}"
        return f"task={self.spec.task!r}, logits={self.spec.logits}, head={self.spec.head!r}, {how}"

    def forward(self, inputs: Inputs) -> dict[str, Tensor]:
        """``inputs`` as ``predict`` takes them (a tensor, a tuple or a dict of keyword inputs, batch-first) -> the
        dict."""
        eager = not torch.compiler.is_compiling()
        if eager:
            _check_eval(self)
        members = self._members(inputs)
        if self.spec.task == "classification":
            if eager:  # the core's checks; an exported or compiled graph does not run them
                metrics.member_probabilities(members.detach().cpu().to(torch.float64).numpy(), logits=self.spec.logits)
            return _classification(members, logits=self.spec.logits)
        if self.spec.head is None:
            mean = members.mean(0)
            return {"mean": mean, "variance": (members - mean).square().mean(0)}
        return _gaussian(members, self.spec.head, self.spec.min_variance)

    def _members(self, inputs: Inputs) -> Tensor:
        """The members' outputs, members first: (n, B, ...)."""
        n = self.tiled_members
        if n is None:
            return _tensor_output(call(self.model, inputs), self.model).movedim(self.member_axis, 0)
        tiled = map_batched(inputs, lambda tensor: tile(tensor, n))
        if torch.compiler.is_compiling():  # the eager calls check the layers' axes and the output's
            output = _tensor_output(call(self.model, tiled), self.model)
        else:
            rows = n * batch_size(inputs)
            with samples_known(self.model, rows):
                output = _tensor_output(call(self.model, tiled), self.model)
            if output.ndim == 0 or output.shape[0] != rows:
                raise ValueError(
                    f"with_uncertainty needs the model's output with the tiled batch of {rows} samples on axis 0; "
                    f"{type(self.model).__name__} returned shape {tuple(output.shape)} (a sequence-first output, "
                    "(L, B, ...), must be transposed to batch-first in the model)"
                )
        return cast(Tensor, output.unflatten(0, (n, -1)))  # type: ignore[no-untyped-call]


def with_uncertainty(
    model: nn.Module,
    *,
    task: str = "classification",
    logits: bool = True,
    head: str | None = None,
    min_variance: float = 1e-6,
    member_axis: int = 0,
    n: int | None = None,
) -> UncertaintyHead:
    """``model`` answering with its uncertainty: (B, ...) -> ``masksembles_core.heads``' dict, computed in torch ops.

    ``model`` is a packed model (``pack``: it outputs the members, (n, B, ...)), or a module around one whose output
    holds the members on ``member_axis``; or a Masksembles model (``insert``, ``convert_dropout``, your own layers),
    which runs as ``predict`` runs it: the batch tiled n times (n read from its Masksembles layers, as ``predict``
    does; ``n`` checks it), one call, the output split into (n, B, ...). The model must output one tensor (a logits
    tensor, not a ``ModelOutput``) and be in eval mode (``model.eval()``). The values are ``uncertainty_head``'s
    (``masksembles_core.heads``) up to float rounding, computed stably in the model's dtype (log-softmax,
    ``0 log 0 = 0``, mutual information clamped at 0; ``K = 1`` logits are a sigmoid: two classes); the module
    compiles (``torch.compile``) and exports (``torch.export``, ONNX) with the head in the graph.

    Called eagerly, it checks what the core checks before answering: every module in eval mode, and classification
    members that are logits or probabilities (``logits=False``: in [0, 1], rows summing to 1, as
    ``metrics.member_probabilities`` refuses them, with its messages; probabilities are renormalized, as there). A
    compiled or exported graph runs none of these checks.

    Args:
        task, logits, head, min_variance: as ``masksembles_core.heads.uncertainty_head`` (checked by ``check_head``).
        member_axis: the axis of the packed model's output that holds the members (0 for ``pack``'s); a Masksembles
            model's are on axis 0 (split from the tiled batch) and take no other.
        n: the number of members of a Masksembles model (None: from its layers); for a packed model, its members.

    Raises:
        ValueError: bad head arguments (``check_head``), a module in training mode, a model without members (no
            Masksembles layer and no packed model inside: a plain network, or ``extract_member``'s one member), ``n``
            that is not the model's, or ``member_axis`` other than 0 for a Masksembles model.
        TypeError: ``member_axis`` is not an integer.
    """
    spec = check_head(task, logits=logits, head=head, min_variance=min_variance)
    if isinstance(member_axis, bool) or not isinstance(member_axis, int):
        raise TypeError(f"member_axis must be an integer; received {member_axis!r} ({type(member_axis).__name__})")
    _check_eval(model)
    packed = [module for module in model.modules() if isinstance(module, PackedMasksembles)]
    inside_packed = {id(module) for program in packed for module in program.modules()}
    # a packed model's dense or whole-model program holds Masksembles layers: it outputs the members, never tiled here
    counts = [layer.n for layer in model.modules() if isinstance(layer, Masksembles) and id(layer) not in inside_packed]
    if counts and packed:
        raise ValueError(
            f"with_uncertainty reads either a Masksembles model (run on the tiled batch) or a packed one (it outputs "
            f"the members); {type(model).__name__} holds a packed model and Masksembles layers outside it"
        )
    if counts:
        if member_axis != 0:
            raise ValueError(
                f"member_axis must be 0 for a Masksembles model (its members are split from the tiled batch onto "
                f"axis 0); received {member_axis}"
            )
        refuse_sequence_first_inputs(model, "with_uncertainty")
        keep_masks_off_fused_paths(model)  # as predict runs the model
        return UncertaintyHead(model, spec, tiled_members=mca.check_members(counts, n), member_axis=0)
    members = {len(module.members) for module in packed if not module.meta["masksembles"]["squeeze"]}
    if not members:
        raise ValueError(
            f"with_uncertainty needs a model with members: a Masksembles model (insert, convert_dropout) or a packed "
            f"one (pack); {type(model).__name__} has no Masksembles layer and no packed model"
            + (" (extract_member's output is one member)" if packed else "")
        )
    if n is not None and members != {mca.check_n(n)}:
        raise ValueError(f"n={n} does not match the packed model's members: {sorted(members)}")
    return UncertaintyHead(model, spec, tiled_members=None, member_axis=member_axis)


def _check_eval(model: nn.Module) -> None:
    training = [name or type(model).__name__ for name, module in model.named_modules() if module.training]
    if training:
        shown = ", ".join(training[:3]) + (", ..." if len(training) > 3 else "")
        raise ValueError(
            f"with_uncertainty answers in eval mode (BatchNorm running statistics, dropout off); {len(training)} "
            f"module(s) are in training mode ({shown}): call model.eval()"
        )


def _tensor_output(output: Any, model: nn.Module) -> Tensor:
    if not isinstance(output, Tensor):
        raise TypeError(
            f"with_uncertainty needs the model to return one tensor of member outputs; {type(model).__name__} "
            f"returned {type(output).__name__} (wrap it in a module that returns the logits)"
        )
    return output


def _entropy(probs: Tensor, log_probs: Tensor) -> Tensor:
    """Entropy over the last axis with 0 log 0 = 0: (..., K) -> (...)."""
    return -torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs)).sum(-1)


def _classification(members: Tensor, *, logits: bool) -> dict[str, Tensor]:
    """Members (n, B, K) -> the classification head (``masksembles_core.heads``)."""
    if logits:
        if members.shape[-1] == 1:  # a sigmoid logit z: the two logits (0, z)
            members = torch.cat([torch.zeros_like(members), members], dim=-1)
        log_probs = torch.log_softmax(members, dim=-1)
        probs = log_probs.exp()
    else:
        probs = members / members.sum(-1, keepdim=True)
        log_probs = torch.log(torch.where(probs > 0, probs, torch.ones_like(probs)))
    mean = probs.mean(0)
    predictive = _entropy(mean, torch.log(torch.where(mean > 0, mean, torch.ones_like(mean))))
    expected = _entropy(probs, log_probs).mean(0)
    return {
        "probabilities": mean,
        "predictive_entropy": predictive,
        "expected_entropy": expected,
        "mutual_information": (predictive - expected).clamp_min(0.0),  # Jensen: >= 0 up to rounding
        "max_probability": mean.amax(-1),
    }


def _gaussian(members: Tensor, head: str, min_variance: float) -> dict[str, Tensor]:
    """Gaussian members (n, B, ..., 2) -> the mixture's mean and variance and its split (``masksembles_core.heads``)."""
    if members.shape[-1] != 2:
        raise ValueError(
            f"Gaussian members (head={head!r}) need a last axis of 2 (mean, variance channel); received shape "
            f"{tuple(members.shape)}"
        )
    means, channel = members[..., 0], members[..., 1]
    if head == "log_variance":
        variances = channel.clamp_min(math.log(min_variance)).exp()
    else:
        variances = channel.clamp_min(min_variance)
    mean = means.mean(0)
    aleatoric, epistemic = variances.mean(0), (means - mean).square().mean(0)
    return {"mean": mean, "variance": aleatoric + epistemic, "aleatoric": aleatoric, "epistemic": epistemic}
