"""The checkpoint state of :class:`~lightning_dp.engine.privacy_engine.PrivacyEngine`: what a resumed run needs to
continue the same epsilon curve (ledger, mechanism, delta, sample rate, per-sample momentum and low-pass state), never a
seed or a generator state unless the run asks for ``exact_resume`` (docs/design.md section 2.3)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from lightning_dp.accounting import Accountant, make_accountant
from lightning_dp.engine.accounting import PrivacyLedger
from lightning_dp.engine.clip_bound import ClipBound
from lightning_dp.engine.exact_resume import SECRET_KEY, restore_secret_state, secret_state
from lightning_dp.engine.run_state import RunState
from lightning_dp.engine.weight_loads import trainable_weights_written
from lightning_dp.mechanisms import NoiseMechanism, make_mechanism
from lightning_dp.optim.adaptive_clipping import restored_bound

log = logging.getLogger("lightning_dp")

_CORRUPT_STATE = (
    "The checkpoint's privacy state is corrupted or incomplete (resuming from it could restart epsilon at 0); resume "
    "from an intact earlier checkpoint of this run"
)


def check_privacy_state(state: Any) -> None:
    """Check the structure of a :meth:`PrivacyEngine.state_dict` read back from a checkpoint.

    Raises:
        ValueError: not a dict with ``accountant`` (a dict with a name and a ledger of ``[event, count]`` pairs
            with positive counts), ``mechanism`` (a dict with a name), ``target_delta`` and ``sample_rate`` (numbers
            in (0, 1]).
    """
    problem = None
    if not isinstance(state, dict) or not {"accountant", "mechanism", "target_delta", "sample_rate"} <= set(state):
        problem = "missing entries (accountant, mechanism, target_delta, sample_rate)"
    elif not isinstance(state["mechanism"], dict) or "name" not in state["mechanism"]:
        problem = "no mechanism name"
    elif not isinstance(state["accountant"], dict) or not isinstance(state["accountant"].get("name"), str):
        problem = "no accountant name"
    elif not isinstance(state["accountant"].get("ledger"), list):
        problem = "no accountant ledger"
    elif any(
        not isinstance(item, list | tuple) or len(item) != 2 or not isinstance(item[1], int) or item[1] < 1
        for item in state["accountant"]["ledger"]
    ):
        problem = "ledger entries that are not [event, positive count]"
    else:
        for key in ("target_delta", "sample_rate"):
            value = state[key]
            if not isinstance(value, int | float) or not 0 < value <= 1:
                problem = f"{key}={value!r}"
    if problem is not None:
        raise ValueError(f"{_CORRUPT_STATE}: {problem}")


class CheckpointState:
    """Saves and restores the privacy state of a run's :class:`~lightning_dp.engine.run_state.RunState`."""

    def __init__(self, run: RunState, clip_bound: ClipBound, ledger: PrivacyLedger) -> None:
        self.run = run
        self.clip_bound = clip_bound
        self.ledger = ledger

    def state_dict(self) -> dict[str, Any]:
        """Ledger, mechanism parameters, delta and sample rate; with per-sample momentum ``"momentum"``, with a low-pass
        filter ``"lowpass"``, with adaptive clipping ``"adaptive_clipping"`` (all functions of released values), with
        correlated noise ``"noise_correlation"`` (its strategy's parameters, data-independent). A seed, the generators'
        states and the correlated noise's streaming state only with ``exact_resume`` (``"exact_resume"``, secret:
        docs/design.md sections 2.3 and 5.1).

        Raises:
            ValueError: a checkpoint's load into this run did not finish (``RunState.load_partial``).
        """
        run = self.run
        if run.load_partial:
            raise ValueError(
                "A checkpoint's load into this run did not finish (its privacy state without its weights, or the "
                "reverse): a checkpoint written now could pair them; write one once training has started from a "
                "loaded checkpoint (ckpt_path / resume_from_checkpoint)"
            )
        assert run.mechanism is not None and run.accountant is not None
        state = {
            "accountant": run.accountant.state_dict(),
            "mechanism": {"name": run.mechanism.name, **run.mechanism.describe()},
            "target_delta": run.target_delta,
            "sample_rate": run.sample_rate,
        }
        if run.momentum.enabled:
            state["momentum"] = run.momentum.state_dict()
        if run.lowpass is not None:
            state["lowpass"] = run.lowpass.state_dict()
        if run.adaptive is not None:
            state["adaptive_clipping"] = run.adaptive.state_dict()
        if run.config.privacy_unit == "user":
            state["privacy_unit"] = {"unit": "user", "user_key": _key_name(run.config.user_key)}
        if run.correlation is not None:  # the strategy only (public, like the mechanism); its stream state is noise
            state["noise_correlation"] = run.correlation.checkpoint_entry()
        if run.config.exact_resume:
            state[SECRET_KEY] = secret_state(run)
        return state

    def begin_load(self, *, partial: bool = True) -> None:
        """A checkpoint's load begins to change the run: its privacy state (:meth:`load_state_dict`, once checked),
        weights without their privacy state (a checkpoint without one), or everything at once (Lightning's
        ``ModelParallelStrategy``, before the privacy state is checked). Until training starts from it
        (``exact_resume.finish_restore``) a later fit must load a checkpoint itself (``exact_resume.abandon_load``).
        With ``partial`` (an adapter loads the rest, :meth:`end_load`), no checkpoint is written (:meth:`state_dict`)
        until it has, or training starts."""
        self.run.load_unfinished = True
        self.run.load_partial = self.run.load_partial or partial

    def end_load(self) -> None:
        """The adapter loaded the weights of the checkpoint whose privacy state it loaded: the run holds all of it."""
        self.run.load_partial = False

    @property
    def load_is_partial(self) -> bool:
        """Whether a load holds part of a checkpoint (:meth:`begin_load`): :meth:`state_dict` refuses meanwhile."""
        return self.run.load_partial

    @contextmanager
    def loading_weights(self, model: nn.Module) -> Iterator[None]:
        """Around the adapter's load of the weights of the checkpoint whose privacy state it loaded (and only those)
        into ``model``: if it raises, or leaves a trainable parameter as it was
        (:func:`~lightning_dp.engine.weight_loads.trainable_weights_written`), the load stays begun
        (:meth:`begin_load`); once it returns, the run holds the whole checkpoint (:meth:`end_load`) and a start of
        training that already followed the privacy state's load still counts.

        Raises:
            ValueError: a trainable parameter is not in the checkpoint.
        """
        unfinished = self.run.load_unfinished
        self.begin_load()
        with trainable_weights_written(model):
            yield
        self.run.load_unfinished = unfinished
        self.end_load()

    def load_state_dict(self, state: dict[str, Any], *, weights_follow: bool = False) -> None:
        """Restore :meth:`state_dict` before :meth:`prepare`: the saved mechanism replaces calibration, the ledger is
        replayed into this run's accountant, and the random streams restart, or with ``exact_resume`` and a checkpoint
        that holds its secret state continue (docs/design.md section 2.3). Everything is checked before anything of
        the run changes: a load its checks refuse leaves the run as it was (its ledger included); one that fails
        after them (an entry corrupted in a way they do not see) leaves the load begun (:meth:`begin_load`).

        Args:
            state: what :meth:`state_dict` returned, read back from a checkpoint.
            weights_follow: an adapter loads the same checkpoint's weights next (:meth:`loading_weights`): no
                checkpoint is written until it has (or training starts).

        Raises:
            ValueError: another mechanism or ``max_grad_norm``, or fixed noise parameters that differ; a malformed state
                (never replaced by an empty ledger); other per-sample momentum or lowpass settings; adaptive clipping on
                one side only, or a non-positive adaptive bound; example-level steps resumed user-level, or another
                ``user_key``; banded correlated noise on one side only (its band is checked when training starts); a
                corrupted ``exact_resume`` entry.
        """
        run = self.run
        check_privacy_state(state)
        self._check_privacy_unit(state.get("privacy_unit"))
        adaptive = state.get("adaptive_clipping")
        if (adaptive is not None) != run.config.adaptive_clipping:
            raise ValueError(
                "The checkpoint was trained with"
                + (
                    " adaptive clipping, this run clips at a fixed bound"
                    if adaptive is not None
                    else " a fixed clipping bound, this run clips adaptively"
                )
                + ": resume with the same target_unclipped_quantile setting"
            )
        bound = None if adaptive is None else restored_bound(adaptive)  # malformed: fails before anything changes
        correlation = self._restored_correlation(state.get("noise_correlation"))
        if "momentum" in state:
            run.momentum.check_state_dict(state["momentum"])
        elif run.momentum.enabled:
            raise ValueError(
                f"The checkpoint was trained without per-sample momentum, this run uses momentum_length="
                f"{run.momentum.momentum_length}: resume with the same per-sample momentum"
            )
        if run.lowpass is not None and state.get("lowpass") is not None:
            run.lowpass.check_state_dict(state["lowpass"])
        restored = self._restored_mechanism(state["mechanism"])
        saved = make_accountant(state["accountant"]["name"])
        try:
            saved.load_state_dict(state["accountant"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{_CORRUPT_STATE}: its ledger cannot be read ({error!r})") from error
        accountant = make_accountant(run.config.accountant or ("rc" if run.randomized_clipping else saved.name))
        for event, count in saved.ledger:
            accountant.compose(event, count)
        # Everything is checked: from here on the run changes (the secret state first, which checks itself first).
        self._continue_or_restart_randomness(state.get(SECRET_KEY), accountant)
        self.begin_load(partial=weights_follow)
        run.stale_load = False  # this fit loads a checkpoint itself
        if "momentum" in state:
            run.momentum.load_state_dict(state["momentum"])
        run.mechanism = restored
        run.noise_origin = "restored from the checkpoint"
        saved_delta = state["target_delta"]
        if run.target_delta is None:
            run.target_delta = saved_delta
        elif not math.isclose(run.target_delta, saved_delta):
            log.warning(
                "target_delta changed on resume: the checkpoint reported epsilon at delta = %.3g, this run reports "
                "the epsilon of the whole run (the checkpoint's steps included) at delta = %.3g",
                saved_delta,
                run.target_delta,
            )
        run.accountant = accountant
        self.ledger.clear_caches()  # its epsilon and step budget were those of the replaced ledger
        run.restored_sample_rate = state["sample_rate"]
        if run.user_data is not None:  # regrouped before the restore: its subsets restart with the other streams
            run.user_data.seed = run.randomness.stream_seed("user subsets")
        if run.distributed is not None:  # restored after the run started (Lightning's ModelParallelStrategy does):
            run.distributed.synchronize_randomness(run.randomness)  # share rank 0's fresh seed again
        self._load_lowpass_state(state.get("lowpass"))
        self.clip_bound.restore(bound)
        run.restored_correlation = correlation

    def _restored_mechanism(self, saved: dict[str, Any]) -> NoiseMechanism:
        """The checkpoint's mechanism, which must be this run's noise and bound (and its noise, when fixed).

        Raises:
            ValueError: another noise, ``max_grad_norm`` or fixed noise parameters.
        """
        run = self.run
        params = dict(saved)
        name = params.pop("name")
        if name != run.config.noise_name:
            raise ValueError(
                f"The checkpoint was trained with noise={name!r}, this run asks for {run.config.noise_name!r}"
            )
        if params.get("max_grad_norm") != run.max_grad_norm:
            raise ValueError(
                f"The checkpoint was trained with max_grad_norm={params.get('max_grad_norm')}, this run uses "
                f"{run.max_grad_norm}; resume with the same clipping bound"
            )
        restored = make_mechanism(name, **params)
        if run.mechanism is not None and run.mechanism.describe() != restored.describe():
            raise ValueError(
                f"The checkpoint's noise {restored.describe()} differs from this run's {run.mechanism.describe()}; "
                "resume with the same noise parameters (or with target_epsilon to reuse the checkpoint's)"
            )
        return restored

    def _continue_or_restart_randomness(self, secret: Any, accountant: Accountant) -> None:
        """With ``exact_resume`` and the checkpoint's secret state, continue its streams; else restart them at the
        ledger's step count (a warning when ``exact_resume`` finds no secret state: the checkpoint was written without
        it). An earlier load's restore, and its refusal (``RunState.resume_started``), end here, not before: a
        load that fails earlier leaves both.

        Raises:
            ValueError: a corrupted secret state (nothing changed then).
        """
        run = self.run
        if run.config.exact_resume and secret is not None:
            restore_secret_state(run, secret, accountant)
        else:
            if run.config.exact_resume:
                log.warning(
                    "exact_resume=True, but the checkpoint was written without it (no secret state): the random "
                    "streams restart%s",
                    " and the correlated noise starts a new segment" if run.config.noise_correlation else "",
                )
            run.randomness.restart(accountant.steps)
            run.restored_noise_streams = run.restored_draw_schedule = None
        run.resume_started = False

    def _restored_correlation(self, saved: dict[str, Any] | None) -> dict[str, Any] | None:
        """The checkpoint's strategy (``{"kind": ..., its parameters}``), kept for this run (the correlation itself
        restarts: docs/design.md section 5.1).

        Raises:
            ValueError: correlated noise on one side only or of another kind, or a malformed entry.
        """
        kind = self.run.config.noise_correlation
        trained = saved.get("kind") if isinstance(saved, dict) else None
        if (saved is not None) != (kind is not None) or (saved is not None and trained != kind):
            described = "independent noise" if saved is None else f"noise_correlation={trained!r}"
            raise ValueError(
                f"The checkpoint was trained with {described}: resume with the same noise_correlation setting"
            )
        if saved is None or kind is None:
            return None
        fields = {"banded": ("coefs",), "blt": ("decays", "scales")}[kind]
        restored: dict[str, Any] = {"kind": kind}
        for field in fields:
            values = saved.get(field)
            if not isinstance(values, list) or not values:
                raise ValueError(f"{_CORRUPT_STATE}: its noise_correlation entry {saved!r} is not a {kind} strategy")
            restored[field] = [float(v) for v in values]
        if kind == "blt":
            noise_scale = saved.get("noise_scale")
            if (
                isinstance(noise_scale, bool)
                or not isinstance(noise_scale, int | float)
                or not 0 < noise_scale < math.inf
            ):
                raise ValueError(
                    f"{_CORRUPT_STATE}: its noise_correlation entry {saved!r} has no finite noise_scale > 0"
                )
            restored["noise_scale"] = float(noise_scale)
        return restored

    def _check_privacy_unit(self, saved: dict[str, Any] | None) -> None:
        """Refuse a resume whose ledger was spent on another unit (user-level resumed at example level is allowed).

        Raises:
            ValueError: the checkpoint is example-level and this run user-level, or their ``user_key`` differ.
        """
        run = self.run
        if run.config.privacy_unit != "user":
            return
        if saved is None:
            raise ValueError(
                "The checkpoint's steps were taken with privacy_unit='example': their epsilon does not hold for "
                "users, so a user-level run cannot continue its ledger. Start a new user-level run (without the "
                "checkpoint's privacy state), or resume with privacy_unit='example'"
            )
        key = _key_name(run.config.user_key)
        if saved.get("user_key") != key:
            raise ValueError(
                f"The checkpoint grouped users by {saved.get('user_key')!r}, this run by {key!r}: its epsilon is "
                "about other groups of examples; resume with the same user_key"
            )

    def _load_lowpass_state(self, state: dict[str, Any] | None) -> None:
        """Restore the filter's state; a filter missing on either side starts fresh or is dropped, with a warning."""
        run = self.run
        if run.lowpass is not None and state is not None:
            run.lowpass.load_state_dict(state)
        elif run.lowpass is not None:
            log.warning("The checkpoint holds no lowpass state: the filter starts from rest at step %d", run.steps)
        elif state is not None:
            log.warning("The checkpoint was trained with a lowpass filter, this run has none: its state is dropped")


def saved_ledger_steps(state: Any) -> int | None:
    """The steps in the ledger of a saved privacy state (:meth:`CheckpointState.state_dict`); ``None`` when it cannot
    be read (:meth:`CheckpointState.load_state_dict` refuses it)."""
    try:
        return sum(int(count) for _, count in state["accountant"]["ledger"])
    except (KeyError, TypeError, ValueError):
        return None


def _key_name(user_key: Any) -> str:
    """How a checkpoint names the user key: the column, or the function's qualified name."""
    if isinstance(user_key, str):
        return user_key
    return f"function {getattr(user_key, '__module__', '?')}.{getattr(user_key, '__qualname__', repr(user_key))}"
