"""TrainerCallbacks of a ``DPTrainer`` run: privacy state in checkpoints, the budget stop; the helpers that find a
checkpoint's folder and read tensor files from it (shared with :mod:`lightning_dp.hf.averaging`)."""

from __future__ import annotations

import json
import logging
import os
import pickle
import secrets
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from typing_extensions import override

from lightning_dp.engine.adapter import EpsilonBudget
from lightning_dp.engine.exact_resume import SECRET_KEY
from lightning_dp.engine.privacy_engine import PrivacyEngine
from lightning_dp.runtime.checkpoints import atomic_save, atomic_write_bytes

log = logging.getLogger("lightning_dp")

#: File holding the privacy state (ledger, mechanism, delta, sample rate) in each Trainer checkpoint folder.
PRIVACY_STATE_NAME = "lightning_dp_privacy.json"
#: The JSON entry pairing the privacy state with its secret file (``exact_resume``): a random token both hold.
SECRET_TOKEN = "exact_resume_token"
#: Files holding the parts of the privacy state that are tensors (so not JSON) next to it, when the run has them:
#: the low-pass filter's past values, the per-sample momentum's stored iterates and, with ``exact_resume``, the run's
#: secret randomness and noise streams (a file to keep private: it reveals the noise).
TENSOR_STATE_NAMES = {
    "lowpass": "lightning_dp_lowpass.pt",
    "momentum": "lightning_dp_momentum.pt",
    SECRET_KEY: "lightning_dp_exact_resume.pt",
}


def checkpoint_folder(args: TrainingArguments, state: TrainerState) -> Path:
    """The folder the Trainer writes the checkpoint of step ``state.global_step`` to: ``output_dir/checkpoint-STEP``."""
    return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"


def written_checkpoint_folder(args: TrainingArguments, state: TrainerState, content: str) -> Path:
    """:func:`checkpoint_folder`, which the Trainer has just written (called from ``on_save``).

    Args:
        content: what the caller will write there, for the error message.

    Raises:
        RuntimeError: the folder does not exist (the Trainer saved elsewhere: hyperparameter search runs).
    """
    folder = checkpoint_folder(args, state)
    if not folder.is_dir():
        raise RuntimeError(
            f"Expected the checkpoint folder {folder} to hold {content}; checkpoints saved elsewhere (hyperparameter "
            "search runs) are not supported"
        )
    return folder


def load_checkpoint_tensors(path: Path, why_not_restart: str) -> Any:
    """``torch.load`` (``weights_only``, onto the CPU) of a file written next to a checkpoint.

    Args:
        path: the file.
        why_not_restart: why resuming cannot simply start that state afresh, for the error message.

    Raises:
        ValueError: the file is truncated or corrupted.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as error:
        raise ValueError(
            f"Cannot read {str(path)!r}: the file is truncated or corrupted ({error}). Resume from an intact earlier "
            f"checkpoint of this run ({why_not_restart})"
        ) from error


def load_privacy_state(engine: PrivacyEngine, checkpoint: str | os.PathLike[str]) -> None:
    """Restore ``engine`` from a checkpoint folder written by a ``DPTrainer`` (before ``engine.prepare``).

    Raises:
        ValueError: the folder has no privacy state (resuming would restart epsilon at 0), the state file is
            truncated or corrupted, or the state does not match the engine (see :meth:`PrivacyEngine.load_state_dict`).
    """
    path = Path(checkpoint) / PRIVACY_STATE_NAME
    if not path.is_file():
        raise ValueError(
            f"Checkpoint {str(checkpoint)!r} has no {PRIVACY_STATE_NAME}: it was not saved by DPTrainer, and resuming "
            "from it would restart epsilon at 0. Resume from a DPTrainer checkpoint, or start a new run without "
            "resume_from_checkpoint"
        )
    try:
        state = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"Cannot read {str(path)!r}: the file is truncated or corrupted ({error}). Resume from an intact earlier "
            "checkpoint of this run (the privacy ledger is never reset to 0)"
        ) from error
    for key, name in TENSOR_STATE_NAMES.items():
        tensor_path = Path(checkpoint) / name
        if tensor_path.is_file():
            state[key] = load_checkpoint_tensors(tensor_path, "the privacy ledger is never reset to 0")
    token, secret = state.pop(SECRET_TOKEN, None), state.get(SECRET_KEY)
    if isinstance(secret, dict) and (token is None or secret.pop("token", None) != token):
        log.warning(
            "%s was not written with this checkpoint's privacy state (%s): ignored, the random streams restart",
            TENSOR_STATE_NAMES[SECRET_KEY],
            "which has no exact_resume token" if token is None else "another token",
        )
        del state[SECRET_KEY]
    engine.load_state_dict(state, weights_follow=True)  # the Trainer's _load_from_checkpoint loads the weights next
    log.info("Restored the privacy state from %s: %d steps, epsilon=%.4g", path, engine.steps, engine.epsilon())


class PrivacyStateCallback(TrainerCallback):
    """Writes the engine's privacy state next to every checkpoint the Trainer saves (``on_save``).

    The state is :meth:`PrivacyEngine.state_dict` as JSON: the accountant's ledger, the mechanism, delta and the
    sample rate; no seed or generator state (see :mod:`lightning_dp.runtime.randomness`). The low-pass filter's state,
    the per-sample momentum's iterates (tensors) and, with ``exact_resume``, the secret randomness go to the files
    :data:`TENSOR_STATE_NAMES` beside it.

    Args:
        engine: the trainer's privacy engine.
    """

    def __init__(self, engine: PrivacyEngine) -> None:
        self.engine = engine

    @override
    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        """Before the Trainer writes ``checkpoint-STEP`` (``control.should_save``, set by the flow callback that runs
        first), remove a privacy state left there by an earlier run, its tensor files included: the Trainer writes the
        folder in place, and a kill mid-write would otherwise leave new files under an old marker that resuming trusts
        (or an earlier run's secret state beside this run's)."""
        if control.should_save and state.is_world_process_zero:
            folder = checkpoint_folder(args, state)
            for name in (PRIVACY_STATE_NAME, *TENSOR_STATE_NAMES.values()):
                (folder / name).unlink(missing_ok=True)
        return control

    @override
    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        """As :meth:`on_step_end`, for ``save_strategy="epoch"``."""
        return self.on_step_end(args, state, control, **kwargs)

    @override
    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if self.engine.accountant is None:
            return control
        privacy_state = self.engine.state_dict()  # on every rank: on a sharded model it gathers the filter's state
        if not state.is_world_process_zero:
            return control
        folder = written_checkpoint_folder(args, state, "DPTrainer's privacy state")
        tensor_states = {key: privacy_state.pop(key) for key in TENSOR_STATE_NAMES if key in privacy_state}
        if args.save_only_model:  # a folder that cannot resume training: no secret state in it
            tensor_states.pop(SECRET_KEY, None)
        if SECRET_KEY in tensor_states:  # paired with this JSON state: no other run's secret file is ever continued
            privacy_state[SECRET_TOKEN] = tensor_states[SECRET_KEY]["token"] = secrets.token_hex(16)
        for key, name in TENSOR_STATE_NAMES.items():  # an earlier run's file not written now (any save strategy)
            if key not in tensor_states:
                (folder / name).unlink(missing_ok=True)
        for key, tensor_state in tensor_states.items():
            atomic_save(tensor_state, folder / TENSOR_STATE_NAMES[key])
        # last and atomic: its presence marks the folder complete
        # (lightning_dp.runtime.checkpoints.last_complete_checkpoint)
        atomic_write_bytes(folder / PRIVACY_STATE_NAME, json.dumps(privacy_state, indent=1).encode())
        return control


class PrivacyBudget(EpsilonBudget, TrainerCallback):
    """Stops training before an optimizer step would push epsilon above the budget, with a message saying so.

    Add it to ``DPTrainer(callbacks=[PrivacyBudget(3.0)])``, typically with fixed noise (``noise_multiplier``). A step
    that would exceed the budget is never taken: the trainer skips its forward, backward and noise and sets
    ``control.should_training_stop``. The same semantics as :class:`lightning_dp.lightning.PrivacyBudget` (the logic
    of :class:`~lightning_dp.engine.adapter.EpsilonBudget`, which both share).

    Args:
        target_epsilon: the budget (default: ``PrivacyArguments.target_epsilon``).

    Raises:
        ValueError: non-positive budget, or none given and the run has no ``target_epsilon``.
    """

    def __init__(self, target_epsilon: float | None = None) -> None:
        super().__init__(target_epsilon)
        self.engine: PrivacyEngine | None = None

    def bind(self, engine: PrivacyEngine) -> None:
        """Set the engine whose budget this callback enforces (``DPTrainer.train`` calls it)."""
        self.start_budget(engine, configured_in="PrivacyArguments")
        self.engine = engine

    def _stop_if_exhausted(self, control: TrainerControl) -> TrainerControl:
        engine = self.engine
        if engine is None:
            raise RuntimeError("PrivacyBudget works with DPTrainer only")
        if self.budget_spent(engine):
            control.should_training_stop = True
        return control

    @override
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        # A resumed run may start with the budget already spent.
        return self._stop_if_exhausted(control)

    @override
    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        return self._stop_if_exhausted(control)
