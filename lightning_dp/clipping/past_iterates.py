"""Per-sample momentum's past iterates for :class:`~lightning_dp.clipping.clipper.PerSampleClipper` (DP-PMLF seed,
Algorithm 1 line 5; docs/design.md section 7).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_dp.clipping.hooks import Capture, CaptureHooks


class PastIteratesMixin:
    """The past iterates of per-sample momentum (a base of the clipper)."""

    _hooks: CaptureHooks
    _loss_scale: float  # LossScaleMixin's: the past iterates' backward is scaled as the current one's
    # methods of the other bases of PerSampleClipper
    _batch_size: Callable[[torch.Tensor], int]
    _backward_pass: Callable[..., tuple[list[Capture], dict[nn.Parameter, torch.Tensor | None]]]

    def _init_past_iterates(self) -> None:
        """No past iterate (called once by ``PerSampleClipper.__init__``)."""
        #: captures of the current batch at past iterates (per-sample momentum), output gradients set and weighted.
        self._past: list[Capture] = []
        self._past_batch = 0
        #: ``[B]`` bool, whether each sample's loss was finite at every past iterate (None: no past iterate).
        self._past_finite: torch.Tensor | None = None

    def add_past_iterate(self, per_sample_loss: torch.Tensor, weight: float) -> None:
        """Keep the batch's per-sample terms at a past iterate, scaled by ``weight``, for the next :meth:`backward` or
        :meth:`per_sample_norms` (DP-PMLF seed, Algorithm 1 line 5).

        Call right after the forward at that iterate (its graph is consumed). The next clip takes, per sample, the exact
        norm of ``weight_now * grad_i(now) + sum_past weight * grad_i(past)``.

        Args:
            per_sample_loss: ``[B]``, the batch's per-sample loss at the past iterate.
            weight: its momentum weight ``beta^(t-i) / c_beta``.

        Raises:
            ValueError: ``per_sample_loss`` not ``[B]`` or not requiring grad, or another batch size than an earlier
                past iterate's.
            RuntimeError: after :meth:`detach`.
        """
        if not self._hooks.attached:
            raise RuntimeError("this PerSampleClipper was detached; create a new one to clip again")
        batch = self._batch_size(per_sample_loss)
        try:
            if self._past and batch != self._past_batch:
                raise ValueError(
                    f"past iterates of one batch gave {self._past_batch} and {batch} per-sample losses: the forward "
                    "at every iterate must see the same batch"
                )
            if batch:
                captures, _ = self._backward_pass(per_sample_loss, param_grads=False, weight=weight * self._loss_scale)
                for capture in captures:  # the parameters are the past iterate's only until the next update
                    capture.keep_parameter_values()
                self._past.extend(captures)
                finite = torch.isfinite(per_sample_loss.detach())
                self._past_finite = finite if self._past_finite is None else self._past_finite & finite
            self._past_batch = batch
        except BaseException:
            self.discard_past_iterates()
            raise
        finally:
            self._hooks.clear()

    def discard_past_iterates(self) -> None:
        """Forget the terms kept by :meth:`add_past_iterate` (e.g. when the batch is skipped)."""
        self._past = []
        self._past_batch = 0
        self._past_finite = None
