"""Checkpoints of an FSDP2-sharded model under :class:`~lightning_dp.hf.DPTrainer`: :class:`ShardedCheckpoints`, a
mixin of ``DPTrainer`` placed before ``transformers.Trainer`` in its bases.

``save_model`` gathers the full weights (every rank calls it; rank 0 writes a folder ``from_pretrained`` loads); a
checkpoint also holds the model's and the optimizer's shards (``sharded_state``, ``torch.distributed.checkpoint``),
from which ``resume_from_checkpoint`` (and ``load_best_model_at_end``) restores them on the same number of processes
(docs/design.md section 8.1). On an unsharded model every method is the Trainer's.

This goes through overrides of PRIVATE ``transformers.Trainer`` methods, not documented "subclass and override"
points, so a transformers release may rename them or change their signatures or when they are called. They are listed
in one place, :data:`PRIVATE_TRAINER_OVERRIDES` (the only private ``Trainer`` methods ``DPTrainer`` and this mixin
override), with the transformers releases they are tested against, :data:`TRANSFORMERS_TESTED`. Each is marked
``@override``, so a type checker reports one the installed ``Trainer`` no longer has;
``tests/adapters/test_conformance.py`` checks that each still exists on the installed ``Trainer`` with the
parameters overridden here and that no other private one is overridden, and ``tests/adapters/test_hf_fsdp.py`` and
``tests/adapters/test_hf_accelerate_fsdp.py`` exercise them on 2 processes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME
from typing_extensions import override

from lightning_dp.optim import DPOptimizer
from lightning_dp.runtime.sharding import (
    full_state_dict,
    load_sharded_model,
    load_sharded_optimizer,
    save_sharded,
    uses_fsdp,
)

log = logging.getLogger("lightning_dp")

#: The private ``transformers.Trainer`` methods overridden by ``DPTrainer`` (all of them here, in
#: :class:`ShardedCheckpoints`), with their parameters: ``_save(output_dir=None, state_dict=None)``,
#: ``_save_optimizer_and_scheduler(output_dir)``, ``_load_from_checkpoint(resume_from_checkpoint, model=None)``,
#: ``_load_optimizer_and_scheduler(checkpoint)``, ``_load_best_model()``.
PRIVATE_TRAINER_OVERRIDES: tuple[str, ...] = (
    "_save",
    "_save_optimizer_and_scheduler",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_best_model",
)
#: The transformers releases :data:`PRIVATE_TRAINER_OVERRIDES` are tested against: pyproject.toml's floor
#: (``transformers>=5.23``, the suite run there by scripts/floor_versions.py) up to the release the test suite runs on.
#: Before 5.23 ``save_model`` called ``_save`` on rank 0 only, and DPTrainer's ``_save`` gathers a sharded model's
#: weights (a collective), which the other ranks then never joined.
TRANSFORMERS_TESTED: tuple[str, str] = ("5.23.0", "5.25.0")

#: The folder, inside a checkpoint of a sharded model, holding the model's and the optimizer's shards.
SHARDED_STATE_NAME = "sharded_state"

# Type checkers see the Trainer as the base (the methods below override its own, and call it through super());
# at run time the mixin is a plain class, which DPTrainer places before Trainer in its bases.
if TYPE_CHECKING:
    _TrainerBase = Trainer
else:
    _TrainerBase = object


class ShardedCheckpoints(_TrainerBase):
    """The Trainer's checkpoint saving and loading, with the model's and optimizer's shards of an FSDP2-sharded model
    (``fully_shard``) written and read by every rank.

    Reads ``self._dp_optimizer`` (the ``DPOptimizer`` ``DPTrainer.create_optimizer`` built): its user optimizer's
    state is what the shards hold, as under Lightning.
    """

    _dp_optimizer: DPOptimizer | None

    @override
    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        """``Trainer._save``; on an FSDP2-sharded model, with the full weights gathered first (a collective: every
        rank calls ``save_model``, rank 0 writes), so that the folder loads with ``from_pretrained``. A saved model is a
        release: the deferred finite check of the clipped sums is read first (docs/design.md section 9.2)."""
        if self._dp_optimizer is not None:
            self._dp_optimizer.check_finite()
        if state_dict is None and uses_fsdp(self.model):
            state_dict = full_state_dict(self.model)
        super()._save(output_dir, state_dict)

    @override
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's; on an FSDP2-sharded model, the model's and the optimizer's shards go to
        ``output_dir/sharded_state`` (``torch.distributed.checkpoint``: every rank writes its own) and rank 0 writes
        the scheduler, as the Trainer does."""
        if not uses_fsdp(self.model):
            return super()._save_optimizer_and_scheduler(output_dir)
        save_sharded(Path(output_dir) / SHARDED_STATE_NAME, self.model, self._user_optimizer())
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), Path(output_dir) / SCHEDULER_NAME)

    @override
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """The Trainer's; on an FSDP2-sharded model, each rank loads its shards from ``sharded_state``
        (``CheckpointState.loading_weights``).

        Raises:
            FileNotFoundError: a sharded model's checkpoint without ``sharded_state`` (``save_only_model``).
            ValueError: its shards are not this model's (another model, other adapters).
        """
        with self.privacy_engine.checkpoint.loading_weights(model or self.model):
            if not uses_fsdp(self.model):
                super()._load_from_checkpoint(resume_from_checkpoint, model)
            else:
                load_sharded_model(self._sharded_state(resume_from_checkpoint), self.model)

    @override
    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The Trainer's; on an FSDP2-sharded model, each rank loads its optimizer shards from ``sharded_state``,
        and the scheduler is read as the Trainer reads it.

        Raises:
            FileNotFoundError: a sharded model's checkpoint without ``sharded_state`` (``save_only_model``).
            ValueError: its shards are not this optimizer's.
        """
        if checkpoint is None or not uses_fsdp(self.model):
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_sharded_optimizer(self._sharded_state(checkpoint), self.model, self._user_optimizer())
        self.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / SCHEDULER_NAME, weights_only=True))

    @override
    def _load_best_model(self) -> None:
        """The Trainer's (``load_best_model_at_end``); on an FSDP2-sharded model, each rank loads its shards from
        the best checkpoint's ``sharded_state``.

        Raises:
            FileNotFoundError: the best checkpoint has no ``sharded_state`` (``save_only_model=True``).
        """
        if not uses_fsdp(self.model):
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        log.info("Loading the best model from %s (score: %s)", best, self.state.best_metric)
        load_sharded_model(self._sharded_state(best), self.model)

    @staticmethod
    def _sharded_state(checkpoint: str) -> Path:
        """The checkpoint's folder of model and optimizer shards.

        Raises:
            FileNotFoundError: there is none (the checkpoint was written with ``save_only_model=True``).
        """
        folder = Path(checkpoint) / SHARDED_STATE_NAME
        if not folder.is_dir():
            raise FileNotFoundError(
                f"{checkpoint} has no {SHARDED_STATE_NAME} folder: a sharded run resumes from a checkpoint written "
                "by a sharded DPTrainer run with save_only_model=False"
            )
        return folder

    def _user_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the DPOptimizer wraps (torch's sharded state helpers may call ``step()`` on it)."""
        assert self._dp_optimizer is not None
        return self._dp_optimizer.original_optimizer
