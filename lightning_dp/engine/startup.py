"""The start-up block of :class:`~lightning_dp.engine.privacy_engine.PrivacyEngine`, logged once when training starts:
processes and batches, sampling, planned steps, noise and its origin, delta, accountant and every default applied
that affects the guarantee (INFO on the ``lightning_dp`` logger, rank 0 only).
"""

from __future__ import annotations

import logging
import os
import sys

from lightning_dp.config import PrivacyConfig
from lightning_dp.data.physical_batches import expected_physical_batches
from lightning_dp.engine.run_state import RunState
from lightning_dp.runtime.console import show_info_lines
from lightning_dp.runtime.launch_check import process_count_warning

log = logging.getLogger("lightning_dp")

#: The first line of the block.
HEADER = "DP training start-up:"


def _row(label: str, value: object) -> str:
    return f"  {label:<24}{value}"


def describe_users(config: PrivacyConfig) -> str:
    """One line on the user-level set-up: the key and rows per sampled user (options only; per-user counts are data
    statistics and never logged).
    """
    key = config.user_key
    source = f"column {key!r}" if isinstance(key, str) else "user_key function"
    cap = config.examples_per_user
    rows = "all of their examples" if cap is None else f"at most {cap} of their examples (a random {cap} of more)"
    return f"user ({source}): a sampled user brings {rows}, one clipped mean per user"


class StartupBlock:
    """The start-up block of a run, read from its :class:`~lightning_dp.engine.run_state.RunState`."""

    def __init__(self, state: RunState) -> None:
        self.state = state

    @property
    def _world_size(self) -> int:
        """Processes training together (1 without a process group)."""
        return self.state.distributed.world_size if self.state.distributed is not None else 1

    def startup_lines(self) -> list[str]:
        """The start-up block, one string per line: :data:`HEADER`, then one ``label value`` row per fact.

        Raises:
            RuntimeError: before :meth:`~lightning_dp.engine.privacy_engine.PrivacyEngine.prepare` (no noise, q or
                N yet).
        """
        state = self.state
        if (
            state.mechanism is None
            or state.accountant is None
            or state.sample_rate is None
            or state.num_samples is None
        ):
            raise RuntimeError("prepare() (or start_training()) must run before startup_lines()")
        batch_size, micro_batches = state.loader_batches or (None, 1)
        sampling = "expected size: Poisson sampling" if state.config.poisson_sampling else "your sampler's batches"
        per_device = f"{batch_size} ({sampling})" if batch_size else "not read from the training loader"
        grouping = ", grouped by length" if state.length_grouped else ""
        steps = "unbounded (no max_steps or epochs)" if state.planned_steps is None else str(state.planned_steps)
        if state.steps:
            steps += f", {state.steps} taken before this run (restored from the checkpoint)"
        noise = ", ".join(f"{k}={v:.4g}" for k, v in state.mechanism.describe().items())
        lines = [
            HEADER,
            _row("world size", f"{self._world_size} process(es)"),
            _row("per-device batch", per_device),
            _row("gradient accumulation", f"{micro_batches} micro-batch(es) per step{grouping}"),
            _row("global expected batch", f"q N = {state.sample_rate * state.num_samples:.6g}"),
            _row("q (sample rate)", f"{state.sample_rate:.6g}"),
            _row("N (users)" if state.config.privacy_unit == "user" else "N (training examples)", state.num_samples),
            _row("planned steps", steps),
            _row("noise", f"{state.mechanism.name} ({noise}), {state.noise_origin}"),
            _row("delta", f"{state.target_delta:.3g}"),
            _row("accountant", state.accountant.name),
            *([_row("noise correlation", state.correlation.describe())] if state.correlation is not None else []),
            _row("clipping", state.clipping),
        ]
        if state.config.clipping_fn == "automatic":
            gamma = state.config.automatic_clipping_gamma
            lines.append(_row("clip function", f"automatic: C / (||g|| + {gamma:g}) (Bu et al. 2023), sensitivity C"))
        if state.config.max_physical_batch_size is not None:
            lines.insert(4, _row("physical batch cap", self._physical_batches(batch_size, micro_batches)))
        if state.clipping_groups is not None:
            lines.append(_row("clipping groups", state.clipping_groups.describe()))
        copies = state.config.augmentation_multiplicity
        if copies > 1:
            lines.append(
                _row(
                    "augmentation", f"{copies} copies per example (augmentation multiplicity), averaged before clipping"
                )
            )
        if state.config.privacy_unit == "user":
            lines.append(_row("privacy unit", describe_users(state.config)))
        if state.adaptive is not None:
            adaptive = state.adaptive
            lines.append(
                _row(
                    "adaptive clipping",
                    f"C from {adaptive.bound:.4g} towards the {adaptive.target_unclipped_quantile:g} quantile of the "
                    f"norms (learning rate {adaptive.clipbound_learning_rate:g}); count noise std "
                    f"{adaptive.unclipped_num_std:.4g}, sum noise multiplier "
                    f"{state.sum_noise_multiplier:.4g}",
                )
            )
        if state.config.exact_resume:
            secret = "hold the secret randomness and noise state (exact_resume): keep them as private as the data"
            lines += [_row("checkpoints", secret), _row("", "and resume each once (a second resume replays its noise)")]
        defaults = state.defaults_applied or ["none"]
        lines.append(_row("defaults applied", defaults[0]))
        lines += [_row("", default) for default in defaults[1:]]
        return lines

    def _physical_batches(self, batch_size: int | None, micro_batches: int) -> str:
        """The cap, and the forward/backward passes per logical step it makes on one process in expectation (of rank
        0's shard: from q, N and the options only)."""
        state = self.state
        cap = state.config.max_physical_batch_size
        assert cap is not None and state.sample_rate is not None and state.num_samples is not None
        unit = "users" if state.config.privacy_unit == "user" else "examples"
        expected = expected_physical_batches(
            shard_size=-(-state.num_samples // self._world_size),
            sample_rate=state.sample_rate,
            micro_batches=micro_batches,
            cap=cap,
            batch_size=None if state.config.poisson_sampling else batch_size,
        )
        return (
            f"{cap} {unit} per forward/backward (max_physical_batch_size); {expected:.3g} pass(es) per logical step "
            "per process expected"
        )

    def log_startup(self) -> None:
        """Log :meth:`startup_lines` as one INFO record, then a warning when the launcher asked for more processes than
        are training (:func:`~lightning_dp.runtime.launch_check.process_count_warning`).
        """
        show_info_lines(log)
        log.info("\n".join(self.startup_lines()))
        warning = process_count_warning(self._world_size, os.environ, sys.argv)
        if warning is not None:
            log.warning(warning)
