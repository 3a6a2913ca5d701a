"""The refusals of a Lightning checkpoint a DP strategy has read, before any of its state is loaded
(:meth:`~lightning_dp.lightning.dp_mixin.DPStrategyMixin.load_checkpoint`)."""

from __future__ import annotations

from typing import Any

from lightning_dp.engine.checkpoint import saved_ledger_steps


def unreadable(path: Any, error: Exception) -> ValueError:
    """The refusal of a checkpoint file that ``torch.load`` could not read (``error``)."""
    return ValueError(
        f"Cannot read the checkpoint {str(path)!r}: the file is truncated or corrupted ({error}). "
        "Resume from an intact earlier checkpoint of this run (the privacy ledger is never reset to 0)"
    )


def check_loaded_checkpoint(checkpoint: dict[str, Any], path: Any, *, resuming: bool, training: bool) -> None:
    """Whether the privacy state of ``checkpoint`` (read from ``path``) may be loaded.

    Args:
        checkpoint: the checkpoint as Lightning read it, the privacy state under ``"lightning_dp"``.
        path: where it was read from (for the messages).
        resuming: whether a fit resumes from it (its ``global_step`` is positive).
        training: whether training runs (the optimizers are wrapped for DP).

    Raises:
        ValueError: training runs (a load then, e.g. a callback's rollback, would rewind the privacy ledger over steps
            already taken); resuming from a checkpoint without privacy state, or with an empty ledger (either would
            restart epsilon at 0).
    """
    if training:
        raise ValueError(
            "A checkpoint loaded while training runs would rewind the privacy ledger over steps already taken: "
            "load checkpoints before training starts (fit(ckpt_path=...))"
        )
    if not resuming:
        return
    if "lightning_dp" not in checkpoint:
        raise ValueError(
            f"The checkpoint {str(path)!r} was saved after {checkpoint['global_step']} steps but holds no privacy "
            "state (it was not written by a DP strategy, or the entry was removed): resuming would restart epsilon at "
            "0. Resume from a checkpoint of this DP run, or load only the weights (module.load_state_dict) and start a "
            "new run without ckpt_path"
        )
    if saved_ledger_steps(checkpoint["lightning_dp"]) == 0:
        raise ValueError(
            f"The checkpoint {str(path)!r} was saved after {checkpoint['global_step']} steps but its privacy ledger is "
            "empty (damaged): resuming would restart epsilon at 0. Resume from an intact earlier checkpoint of this run"
        )
