"""The start-up block of :class:`~lightning_dp.engine.privacy_engine.PrivacyEngine`: what a run is about to do, printed
once when training starts (:meth:`~lightning_dp.engine.steps.EngineSteps.start_training`), by every trainer adapter
alike.

It names the processes and batches (world size, per-device batch, gradient accumulation, the global expected batch
``q N``), the sampling (q, N), the planned steps, the noise (and whether it was given, calibrated or restored), delta,
the accountant and every default applied that affects the guarantee. It goes to the ``lightning_dp`` logger at INFO,
which only rank 0 keeps on several processes (:meth:`~lightning_dp.runtime.distributed.DistributedContext.
log_on_rank_zero_only`), and which shows on stderr in a script that set up no logging
(:mod:`lightning_dp.runtime.console`). A launch that started fewer processes than asked for adds a warning
(:mod:`lightning_dp.runtime.launch_check`).
"""

from __future__ import annotations

import logging
import os
import sys

from lightning_dp.runtime.console import show_info_lines
from lightning_dp.runtime.launch_check import process_count_warning

log = logging.getLogger("lightning_dp")

#: The first line of the block.
HEADER = "DP training start-up:"


def _row(label: str, value: object) -> str:
    return f"  {label:<24}{value}"


class EngineStartup:
    """The start-up block of :class:`~lightning_dp.engine.privacy_engine.PrivacyEngine` (a base class of it). The
    attributes it reads (``distributed``, ``loader_batches``, ``sample_rate``, ``num_samples``, ``planned_steps``,
    ``mechanism``, ``noise_origin``, ``target_delta``, ``accountant``, ``defaults_applied``, ...) are the engine's."""

    @property
    def _world_size(self) -> int:
        """Processes training together (1 without a process group)."""
        return self.distributed.world_size if self.distributed is not None else 1

    def startup_lines(self) -> list[str]:
        """The start-up block, one string per line: :data:`HEADER`, then one ``label value`` row per fact.

        Raises:
            RuntimeError: before :meth:`~lightning_dp.engine.privacy_engine.PrivacyEngine.prepare` (no noise, q or
                N yet).
        """
        if self.mechanism is None or self.accountant is None or self.sample_rate is None or self.num_samples is None:
            raise RuntimeError("prepare() (or start_training()) must run before startup_lines()")
        batch_size, micro_batches = self.loader_batches or (None, 1)
        sampling = "expected size: Poisson sampling" if self.config.poisson_sampling else "your sampler's batches"
        per_device = f"{batch_size} ({sampling})" if batch_size else "not read from the training loader"
        grouping = ", grouped by length" if self.length_grouped else ""
        steps = "unbounded (no max_steps or epochs)" if self.planned_steps is None else str(self.planned_steps)
        if self.steps:
            steps += f", {self.steps} taken before this run (restored from the checkpoint)"
        noise = ", ".join(f"{k}={v:.4g}" for k, v in self.mechanism.describe().items())
        lines = [
            HEADER,
            _row("world size", f"{self._world_size} process(es)"),
            _row("per-device batch", per_device),
            _row("gradient accumulation", f"{micro_batches} micro-batch(es) per step{grouping}"),
            _row("global expected batch", f"q N = {self.sample_rate * self.num_samples:.6g}"),
            _row("q (sample rate)", f"{self.sample_rate:.6g}"),
            _row("N (users)" if self.config.privacy_unit == "user" else "N (training examples)", self.num_samples),
            _row("planned steps", steps),
            _row("noise", f"{self.mechanism.name} ({noise}), {self.noise_origin}"),
            _row("delta", f"{self.target_delta:.3g}"),
            _row("accountant", self.accountant.name),
            _row("clipping", self.clipping),
        ]
        if self.clipping_groups is not None:
            lines.append(_row("clipping groups", self.clipping_groups.describe()))
        copies = self.config.augmentation_multiplicity
        if copies > 1:
            lines.append(
                _row(
                    "augmentation", f"{copies} copies per example (augmentation multiplicity), averaged before clipping"
                )
            )
        if self.config.privacy_unit == "user":
            lines.append(_row("privacy unit", self.describe_users()))
        if self.adaptive is not None:
            adaptive = self.adaptive
            lines.append(
                _row(
                    "adaptive clipping",
                    f"C from {adaptive.bound:.4g} towards the {adaptive.target_unclipped_quantile:g} quantile of the "
                    f"norms (learning rate {adaptive.clipbound_learning_rate:g}); count noise std "
                    f"{adaptive.unclipped_num_std:.4g}, sum noise multiplier "
                    f"{self.sum_mechanism.noise_multiplier:.4g}",
                )
            )
        defaults = self.defaults_applied or ["none"]
        lines.append(_row("defaults applied", defaults[0]))
        lines += [_row("", default) for default in defaults[1:]]
        return lines

    def log_startup(self) -> None:
        """Log :meth:`startup_lines` as one INFO record of the ``lightning_dp`` logger (shown on stderr when no
        logging is set up, :func:`~lightning_dp.runtime.console.show_info_lines`), then a warning when the launcher
        asked for more processes than are training
        (:func:`~lightning_dp.runtime.launch_check.process_count_warning`)."""
        show_info_lines(log)
        log.info("\n".join(self.startup_lines()))
        warning = process_count_warning(self._world_size, os.environ, sys.argv)
        if warning is not None:
            log.warning(warning)
