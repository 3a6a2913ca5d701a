"""Gradient canaries that are CLIPPED like any example (white-box; Nasr et al. 2023, "Tight auditing of
differentially private machine learning", Section 4; scored as in Steinke, Nasr & Jagielski 2023, Algorithm 1).

Canary ``i`` is a training example: input ``x_i = s e_{j_i}`` (``j_i`` a feature the data never uses), label ``-1 -
k_i``, per-sample loss ``logit_{k_i}(x_i)`` of an audited ``Linear`` layer (:func:`per_sample_loss_with_canaries`),
so its gradient has l2 norm ``sqrt(s^2 + 1) > C`` and the run's own sampler and clipper must act on it. Its score is
the released gradient's coordinate ``(k_i, j_i)`` summed over steps. Unlike the Dirac canaries of
:mod:`lightning_dp.audit.gradient`, they also catch a clipping bug (docs/audit.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import ConcatDataset, Dataset, TensorDataset

from lightning_dp.audit.canaries import audit_generator, draw_inclusion
from lightning_dp.optim import DPOptimizer


def per_sample_loss_with_canaries(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy for labels ``>= 0`` and the canary loss ``logits[i, -1 - labels[i]]`` for labels
    ``< 0`` (the logit of class ``k`` for a canary of label ``-1 - k``: linear in the parameters).

    Args:
        logits: ``[B, classes]``, the output of the audited ``Linear`` layer on the batch (canary rows included).
        labels: ``[B]`` integer labels; negative for canary rows.

    Returns:
        ``[B]`` per-sample losses (the gradient of a canary row is exactly that of its logit: ``torch.where`` sends
        none through the cross-entropy branch).

    Raises:
        ValueError: shapes that are not ``[B, classes]`` and ``[B]``, or a canary class outside ``[0, classes)``.
    """
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        shapes = f"{tuple(logits.shape)} and {tuple(labels.shape)}"
        raise ValueError(f"logits [B, classes] and labels [B] expected, got {shapes}")
    canary = labels < 0
    loss = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
    if not bool(canary.any()):
        return loss
    classes = -1 - labels[canary]
    if int(classes.max()) >= logits.shape[1]:
        raise ValueError(f"canary label {-1 - int(classes.max())} names a class outside [0, {logits.shape[1]})")
    linear = logits.gather(1, (-1 - labels).clamp(min=0, max=logits.shape[1] - 1)[:, None]).squeeze(1)
    return torch.where(canary, linear, loss)


class ClippedGradientCanaries:
    """``m`` canary examples whose per-sample gradient (norm ``sqrt(s^2 + 1)``) the run's clipper clips, and their
    scores.

    Args:
        num_canaries: m >= 1, at most ``len(features) * classes``.
        features: 1-d integer tensor of input features the real data never uses.
        width: ``in_features`` of the audited ``Linear`` layer.
        classes: its ``out_features``.
        input_scale: ``s > 0``; choose it between 2 C and 10 C (above C so that clipping must act).
        seed: seed of the audit's own generator (inclusion, canary coordinates); ``None``: OS entropy.

    Attributes:
        inputs: ``[m, width]`` canary input rows; labels: ``[m]`` canary labels ``-1 - k``.
        coordinates: ``[m]`` flat indices ``k * width + j`` of the canaries in the layer's weight.
        included: ``[m]`` booleans, the canaries in the training set (probability 1/2 each).
        scores: ``[m]`` float64 scores, summed over the observed steps (higher: more likely included).
        steps_observed: number of privatised steps scored.

    Raises:
        ValueError: ``num_canaries < 1``, more canaries than ``(feature, class)`` pairs, a feature outside
            ``[0, width)``, or ``input_scale <= 0``.
    """

    def __init__(
        self,
        num_canaries: int,
        *,
        features: torch.Tensor,
        width: int,
        classes: int,
        input_scale: float,
        seed: int | None = None,
    ) -> None:
        if not input_scale > 0:
            raise ValueError(f"input_scale must be > 0, got {input_scale}")
        features = torch.unique(torch.as_tensor(features, dtype=torch.long).flatten())
        if features.numel() and not 0 <= int(features.min()) <= int(features.max()) < width:
            raise ValueError(f"canary features must lie in [0, {width}), the layer's input features")
        self.generator = audit_generator(seed)
        self.included = draw_inclusion(num_canaries, self.generator)
        candidates = (torch.arange(classes)[:, None] * width + features[None, :]).flatten()
        if num_canaries > candidates.numel():
            raise ValueError(
                f"{num_canaries} clipped gradient canaries need as many (feature, class) pairs, {candidates.numel()} "
                "are available: use fewer canaries or more unused features"
            )
        self.num_canaries = int(num_canaries)
        self.width, self.classes, self.input_scale = int(width), int(classes), float(input_scale)
        self.coordinates = candidates[torch.randperm(candidates.numel(), generator=self.generator)[:num_canaries]]
        self.inputs = torch.zeros(num_canaries, width)
        self.inputs[torch.arange(num_canaries), self.coordinates % width] = self.input_scale
        self.labels = -1 - torch.div(self.coordinates, width, rounding_mode="floor")
        self.scores = np.zeros(self.num_canaries)
        self.steps_observed = 0
        self._weight: nn.Parameter | None = None
        self._handle: Any = None

    def training_set(self, dataset: Dataset) -> ConcatDataset:
        """``dataset`` (yielding ``(x, y)`` with ``x`` of shape ``[width]``) followed by the included canaries; train
        on it: the sample rate counts the canaries in ``N`` and the run's Poisson sampler draws them."""
        keep = torch.nonzero(self.included).flatten()
        canaries = TensorDataset(self.inputs[keep], self.labels[keep])
        return ConcatDataset([dataset, canaries])

    def install(self, optimizer: DPOptimizer, layer: nn.Linear, *, max_grad_norm: float) -> None:
        """Score every privatised step of ``optimizer`` on ``layer.weight``'s canary coordinates.

        Args:
            optimizer: the run's DP optimizer (a step pre-hook of the optimizer it wraps reads the released
                gradient).
            layer: the audited ``Linear(width, classes)`` layer, whose input the canary rows are.
            max_grad_norm: the run's C; the canaries' norm must exceed it.

        Raises:
            ValueError: ``layer`` is not a ``Linear`` of the canaries' shape, its weight is not trained by
                ``optimizer``, or ``input_scale <= max_grad_norm`` (clipping would not act on the canaries).
            RuntimeError: already installed.
        """
        if self._weight is not None:
            raise RuntimeError("ClippedGradientCanaries are already installed; call remove() first")
        if not isinstance(layer, nn.Linear) or tuple(layer.weight.shape) != (self.classes, self.width):
            raise ValueError(f"the audited layer must be nn.Linear({self.width}, {self.classes}), got {layer!r}")
        if not any(p is layer.weight for p in optimizer.params):
            raise ValueError("the audited layer's weight is not a trainable parameter of the DP optimizer")
        if not self.input_scale > max_grad_norm:
            raise ValueError(
                f"input_scale {self.input_scale} must exceed max_grad_norm {max_grad_norm}, so that the clipper must "
                "clip the canaries (choose 2 to 10 times C)"
            )
        self._weight = layer.weight
        self._handle = optimizer.original_optimizer.register_step_pre_hook(self._observe)

    def remove(self) -> None:
        """Stop scoring (the scores are kept)."""
        if self._handle is not None:
            self._handle.remove()
        self._weight, self._handle = None, None

    def _observe(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Step pre-hook: ``weight.grad`` is the privatised gradient of this step."""
        assert self._weight is not None
        grad = self._weight.grad
        if grad is None or not grad.is_contiguous():
            raise RuntimeError("clipped gradient canaries need a contiguous weight.grad (the released gradient)")
        self.scores += grad.view(-1)[self.coordinates.to(grad.device)].double().cpu().numpy()
        self.steps_observed += 1
