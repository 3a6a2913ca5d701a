"""The per-sample clipping hooks of a run on the user's model, and the checks around its forward."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

from lightning_dp.checks.attach_probe import ForwardContext, probe_at_attach
from lightning_dp.checks.guard import TrainingGuard
from lightning_dp.clipping import PerSampleClipper
from lightning_dp.clipping.engines.hutch import norm_dim
from lightning_dp.engine.run_state import RunState
from lightning_dp.mechanisms.base import mechanism_class


class ClippingAttachment:
    """Attaches and detaches the run's :class:`~lightning_dp.clipping.PerSampleClipper` and
    :class:`~lightning_dp.checks.guard.TrainingGuard` (``state.clipper``, ``state.guard`` of its
    :class:`~lightning_dp.engine.run_state.RunState`)."""

    def __init__(self, state: RunState) -> None:
        self.state = state

    def attach(self, module: nn.Module, forward_context: ForwardContext = nullcontext) -> PerSampleClipper:
        """Attach per-sample clipping hooks to ``module`` in place (an FSDP2-sharded ``module`` included, docs/design.md
        section 8.1).

        With ``rows_per_unit == 1`` the model's example inputs (:mod:`lightning_dp.checks.probe_inputs`: its own, or
        built from an HF model's config) are clipped once (:func:`~lightning_dp.checks.attach_probe.probe_at_attach`),
        its forward under ``forward_context()`` (the training's autocast), so that what a forward shows is refused here.

        Raises:
            ValueError: unsupported layers (see :class:`PerSampleClipper`), found at construction or by the probe.
        """
        state, config = self.state, self.state.config
        clip_norm = (state.mechanism or mechanism_class(config.noise_name)).clip_norm
        grouped = config.clipping_groups is not None
        clipper = PerSampleClipper(
            module,
            clipping=state.clipping,
            max_grad_norm=config.max_grad_norm if grouped else state.current_max_grad_norm,
            clipping_groups=config.clipping_groups,
            norm=clip_norm,
            sum_check_every=config.sum_check_every,
            projection_dim=config.projection_dim,
            generator_for=state.randomness.projection_generator,
            augmentation_multiplicity=state.rows_per_unit,
            clipping_fn=config.clipping_fn,
            automatic_clipping_gamma=config.automatic_clipping_gamma,
        )
        state.clipper = clipper
        state.clipping_groups = clipper.groups
        state.momentum.bind(clipper)
        state.num_params = sum(p.numel() for p in clipper.trainable_parameters)
        state.guard = TrainingGuard(
            module,
            clipper.output_targets,
            check_batch_independence=bool(config.check_batch_independence),
            check_every=config.check_batch_independence_every,
            step=lambda: state.steps,
            copies=state.rows_per_unit,
        )
        if state.randomized_clipping:
            state.norm_dim = norm_dim(clipper.trainable_parameters)
        if state.rows_per_unit == 1:
            try:
                probe_at_attach(module, clipper, forward_context)
            except BaseException:
                state.clipper = state.guard = None
                clipper.detach()
                raise
        return clipper

    def set_rows_per_unit(self, rows: int) -> None:
        """Make the clipper and the checks fold ``rows`` consecutive rows of every hooked layer into one unit (a
        user's rows; :mod:`lightning_dp.clipping.multiplicity`), now and when attached later."""
        state = self.state
        state.unit_rows = int(rows)
        if state.clipper is not None:
            state.clipper.augmentation_multiplicity = state.unit_rows
        if state.guard is not None:
            state.guard.copies = state.unit_rows

    def detach(self) -> None:
        """Remove the clipping hooks; the module is exactly as before :meth:`attach`. Whether the clipper dropped
        examples with a non-finite loss or gradient is kept in ``state.dropped_nonfinite`` (this process only)."""
        state = self.state
        if state.clipper is not None:
            state.dropped_nonfinite |= state.clipper.dropped_nonfinite
            state.clipper.detach()
            state.clipper = None
        state.guard = None
        state.distributed = None  # the run is over: a later restore must not reach for its process group

    def add_past_iterates(self, compute_loss: Callable[[], torch.Tensor | None], *, stand_in: bool = False) -> None:
        """Per-sample momentum: run ``compute_loss`` at each stored iterate and keep its weighted terms for the next
        clip (:meth:`~lightning_dp.optim.momentum.PerSampleMomentum.add_past_iterates`).

        Raises:
            RuntimeError: before :meth:`attach`.
        """
        if self.state.clipper is None:
            raise RuntimeError("attach(module) must run before add_past_iterates()")
        self.state.momentum.add_past_iterates(self.state.clipper, compute_loss, stand_in=stand_in)
