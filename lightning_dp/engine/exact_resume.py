"""``exact_resume=True``: the secret state a checkpoint then keeps, so that a resumed run continues the uninterrupted
one (docs/design.md section 2.3): the run's randomness
(:meth:`~lightning_dp.runtime.randomness.DPRandomness.state_dict`: base seed, restart count, generator states) and,
with ``noise_correlation``, each optimizer's noise stream
(:meth:`~lightning_dp.correlated_noise.CorrelatedNoise.state_dict`: the last ``b - 1`` outputs or the ``d`` buffers).
With both, the resumed steps draw the batches (the samplers are keyed by the step) and the noise of the uninterrupted
run, and the correlated noise's ledger stays one segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_dp.accounting.segments import SegmentedAccountant
from lightning_dp.config import PrivacyConfig
from lightning_dp.correlated_noise.streaming import CorrelatedNoise
from lightning_dp.engine.run_state import RunState
from lightning_dp.runtime.sharding import is_sharded

#: the checkpoint entry (in the privacy state) that holds the secret state.
SECRET_KEY = "exact_resume"


def secret_state(run: RunState) -> dict[str, Any]:
    """``{"randomness": ..., "noise_streams": [...]}``: what :func:`restore_secret_state` continues from (a restored
    stream no optimizer has taken yet included). It reveals the noise: for a private resume file only
    (docs/privacy.md)."""
    streams = [s.state_dict() for s in run.noise_streams] + list(run.restored_noise_streams or [])
    return {"randomness": run.randomness.state_dict(), "noise_streams": streams}


def restore_secret_state(run: RunState, saved: Any) -> None:
    """Continue the checkpoint's streams instead of restarting them; the noise streams are handed to the optimizers by
    :func:`continued_stream`. Call after the ledger is restored.

    Raises:
        ValueError: a malformed entry; noise streams without ``noise_correlation`` or without the ledger's correlated
            steps (a stream must have taken exactly the steps of the ledger's last segment).
    """
    if not isinstance(saved, dict) or not isinstance(saved.get("noise_streams"), list) or "randomness" not in saved:
        raise ValueError(f"The checkpoint's {SECRET_KEY} entry is corrupted; resume from an intact checkpoint")
    streams = saved["noise_streams"]
    accountant = run.accountant
    segments = accountant.segment_steps() if isinstance(accountant, SegmentedAccountant) else []
    steps = segments[-1] if segments else 0  # of the last segment: what each stream must have taken
    if any(not isinstance(s, dict) or s.get("step") != steps for s in streams) or (steps and not streams):
        raise ValueError(
            f"The checkpoint's noise streams ({[s.get('step') if isinstance(s, dict) else s for s in streams]} steps) "
            f"do not continue its ledger (last segment: {steps} steps); resume from an intact checkpoint"
        )
    run.randomness.load_state_dict(saved["randomness"])
    run.restored_noise_streams = list(streams) if steps else None  # before any correlated step: nothing to continue


def continues_segment(run: RunState) -> bool:
    """Whether this start of training continues the checkpoint's correlated noise (same segment of the ledger)."""
    return run.restored_noise_streams is not None


def continued_stream(run: RunState) -> CorrelatedNoise | None:
    """The next optimizer's correlated noise stream (``None`` without ``noise_correlation``): fresh, or on an exact
    resume the checkpoint's, continued; kept in ``run.noise_streams`` for the next checkpoint.

    Raises:
        ValueError: the checkpoint's stream is of another kind or strategy; more optimizers than the checkpoint's
            streams.
    """
    if run.correlation is None:
        return None
    stream = run.correlation.noise_stream()
    if run.restored_noise_streams is not None:
        if not run.restored_noise_streams:
            raise ValueError(
                "The checkpoint holds fewer noise streams than this run has optimizers: resume with the same optimizers"
            )
        stream.load_state_dict(run.restored_noise_streams.pop(0))
    run.noise_streams.append(stream)
    return stream


def finish_restore(run: RunState) -> None:
    """Once the optimizers are wrapped: an exact resume's noise streams are all taken (a later ``fit`` of this run
    restarts the correlation).

    Raises:
        ValueError: the checkpoint holds more noise streams than this run has optimizers.
    """
    left, run.restored_noise_streams = run.restored_noise_streams, None
    if left:
        raise ValueError(
            f"The checkpoint holds {len(left)} noise stream(s) more than this run has optimizers: resume with the same "
            "optimizers"
        )


def check_unsharded(config: PrivacyConfig, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Refuse ``exact_resume`` on FSDP2-sharded parameters: each rank draws their noise from its shards' own streams,
    which a checkpoint written by one rank does not hold.

    Raises:
        ValueError: ``exact_resume=True`` and an optimizer updates a sharded parameter.
    """
    if config.exact_resume and any(is_sharded(p) for o in optimizers for g in o.param_groups for p in g["params"]):
        raise ValueError(
            "exact_resume=True is not supported on FSDP2-sharded parameters (each rank's shards have their own noise "
            "streams): remove exact_resume (a resume then draws fresh streams)"
        )
