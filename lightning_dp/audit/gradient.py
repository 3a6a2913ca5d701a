"""White-box gradient canaries (Nasr et al. 2023, "Tight auditing of differentially private machine learning";
Steinke, Nasr & Jagielski 2023, Section 7): a canary is an example whose clipped per-sample gradient is a Dirac
``C e_j`` in one coordinate ``j`` of the flattened trainable parameters (a Dirac of any norm >= C clips to exactly
that, in l2 and in l1), and its score is the inner product of the released gradients with ``e_j``.

How the canaries enter the run: :meth:`GradientCanaries.install` adds a hook to the run's
:class:`~lightning_dp.optim.DPOptimizer` that runs after the real examples' clipped sum is in ``p.grad`` and BEFORE
the optimizer's own mechanism adds its noise. Each step, every included canary is Poisson-sampled at the run's
sample rate ``q`` (like every real example) and, when sampled, its Dirac is added to the clipped sum; the noise,
its scale and the division by ``q N`` are then the configured run's own. The auditor observes every step's
privatised gradient (a step pre-hook of the wrapped optimizer) and scores canary ``i`` by
``sum_t <g_t, e_{j_i}>``, i.e. minus the inner product of the SGD update with the canary direction, over all steps.
Canaries sit in distinct coordinates, so their scores are independent given the inclusion.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lightning_dp.audit.canaries import audit_generator, draw_inclusion
from lightning_dp.optim import DPOptimizer


class GradientCanaries:
    """``m`` Dirac gradient canaries in distinct coordinates, injected into one DP optimizer.

    Args:
        num_canaries: m >= 1 (at most the number of trainable coordinates).
        seed: seed of the audit's own generator (inclusion, coordinates, per-step sampling); ``None``: OS entropy.
        coordinates: optional 1-d integer tensor of candidate coordinates (flat indices into the trainable
            parameters concatenated in the optimizer's order) to draw the canaries' coordinates from, e.g. weights
            the real data never moves; default all trainable coordinates. The real examples' clipped gradients in
            a canary's coordinate add to its score for IN and OUT alike and so blur the audit (never invalidate it).

    Attributes:
        included: ``[m]`` booleans, the canaries in the training input (probability 1/2 each).
        scores: ``[m]`` float64 scores, summed over the observed steps (higher: more likely included).
        steps_observed: number of privatised steps scored.
    """

    def __init__(self, num_canaries: int, *, seed: int | None = None, coordinates: torch.Tensor | None = None) -> None:
        self.generator = audit_generator(seed)
        self.candidate_coordinates = coordinates
        self.included = draw_inclusion(num_canaries, self.generator)
        self.num_canaries = int(num_canaries)
        self.scores = np.zeros(self.num_canaries)
        self.steps_observed = 0
        self._slots: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = []
        self._optimizer: DPOptimizer | None = None
        self._handle: Any = None
        self._sample_rate = 0.0
        self._value = 0.0

    def install(self, optimizer: DPOptimizer, *, sample_rate: float) -> None:
        """Choose the canary coordinates among ``optimizer``'s trainable parameters and hook into its step.

        Args:
            optimizer: the run's DP optimizer (its mechanism adds the noise; its ``max_grad_norm`` is C).
            sample_rate: the run's Poisson rate q per logical step.

        Raises:
            ValueError: more canaries than candidate coordinates, a candidate outside the parameters, or a rate
                outside (0, 1].
            RuntimeError: already installed.
        """
        if self._optimizer is not None:
            raise RuntimeError("GradientCanaries are already installed; call remove() first")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate}")
        params = optimizer.params
        sizes = [p.numel() for p in params]
        total = sum(sizes)
        candidates = self.candidate_coordinates
        if candidates is None:
            candidates = torch.arange(total)
        candidates = torch.unique(torch.as_tensor(candidates, dtype=torch.long).flatten())
        if candidates.numel() and not 0 <= int(candidates.min()) <= int(candidates.max()) < total:
            raise ValueError(f"canary coordinates must lie in [0, {total}), the trainable coordinates")
        if self.num_canaries > candidates.numel():
            raise ValueError(
                f"{self.num_canaries} gradient canaries need as many distinct coordinates, {candidates.numel()} are "
                "available: use fewer canaries, more candidate coordinates or a larger model"
            )
        coordinates = candidates[torch.randperm(candidates.numel(), generator=self.generator)[: self.num_canaries]]
        start = 0
        for param, size in zip(params, sizes, strict=True):
            ids = torch.nonzero((coordinates >= start) & (coordinates < start + size)).flatten()
            if ids.numel():
                self._slots.append((param, (coordinates[ids] - start).to(param.device), ids))
            start += size
        self._sample_rate = float(sample_rate)
        self._value = optimizer.mechanism.max_grad_norm
        optimizer.clipped_sum_hooks.append(self._inject)
        self._handle = optimizer.original_optimizer.register_step_pre_hook(self._observe)
        self._optimizer = optimizer

    def remove(self) -> None:
        """Unhook from the optimizer (the scores are kept)."""
        if self._optimizer is not None:
            self._optimizer.clipped_sum_hooks.remove(self._inject)
            self._handle.remove()
            self._optimizer, self._handle, self._slots = None, None, []

    def _inject(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Add ``C e_j`` to the clipped sum for every included canary Poisson-sampled at this step."""
        sampled = self.included & (torch.rand(self.num_canaries, generator=self.generator) < self._sample_rate)
        for param, local, ids in self._slots:
            hit = sampled[ids].to(local.device)
            flat = _flat_view(param.grad)
            flat.index_add_(
                0, local[hit], torch.full((int(hit.sum()),), self._value, dtype=flat.dtype, device=flat.device)
            )

    def _observe(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Step pre-hook of the wrapped optimizer: ``p.grad`` is the privatised gradient of this step."""
        for param, local, ids in self._slots:
            self.scores[ids.numpy()] += _flat_view(param.grad)[local].double().cpu().numpy()
        self.steps_observed += 1


def _flat_view(grad: torch.Tensor | None) -> torch.Tensor:
    if grad is None or not grad.is_contiguous():
        raise RuntimeError("gradient canaries need a contiguous p.grad (set by the DP optimizer before noise)")
    return grad.view(-1)
