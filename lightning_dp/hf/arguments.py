"""``PrivacyArguments``: the privacy configuration of a ``DPTrainer`` run, parsable by ``HfArgumentParser``.

The fields carry the names and meaning of :class:`~lightning_dp.lightning.DPStrategy`'s arguments, except two that
``TrainingArguments`` already has (``HfArgumentParser((TrainingArguments, PrivacyArguments))`` refuses duplicate
flags): the clipping bound is ``per_sample_max_grad_norm`` (the dp-transformers name) and the seed is ``dp_seed``. And
``__post_init__`` validates them by building the :class:`~lightning_dp.privacy_engine.PrivacyEngine` they describe
(its validators, no copies), so a bad combination fails when the arguments are parsed, not at the first step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_dp.clipping.clipper import DEFAULT_SUM_CHECK_EVERY
from lightning_dp.data import validate_sample_rate
from lightning_dp.privacy_engine import PrivacyEngine

PER_EXAMPLE_REDUCTIONS = ("mean", "sum")


@dataclass
class PrivacyArguments:
    """Differential-privacy arguments of :class:`~lightning_dp.hf.DPTrainer`.

    ``HfArgumentParser((TrainingArguments, PrivacyArguments))`` parses them from the command line
    (``--target_epsilon 3 --per_sample_max_grad_norm 1.0 --noise_params '{"noise_scale": 2.0}'``), a JSON file or a
    YAML file.

    Attributes:
        per_sample_max_grad_norm: per-sample clipping bound C > 0 (l2; l1 for ``noise="laplace"``); the
            ``max_grad_norm`` of ``DPStrategy``. Not to be confused with ``TrainingArguments.max_grad_norm`` (clipping
            of the batch gradient after it is formed), which DPTrainer switches off.
        target_epsilon: privacy budget; the noise is calibrated for the Trainer's planned optimizer steps
            (``max_steps``, or ``num_train_epochs`` times the steps per epoch). Exclusive with ``noise_multiplier``
            and ``noise_params``.
        target_delta: delta in (0, 1); default ``1/N^1.1``.
        noise_multiplier: Gaussian sigma (noise std ``sigma * C`` on the clipped sum of a logical step).
        noise: ``"gaussian" | "laplace" | "laplace-advanced" | "lap2" | "plrv"`` (a ``NoiseMechanism`` instance is
            accepted when constructed in Python).
        noise_params: parameters of a non-Gaussian mechanism: a dict, or its JSON text on the command line,
            e.g. ``'{"noise_scale": 3.0}'``.
        clipping: per-sample clipping engine, ``"flat" | "ghost" | "fgc" | "mixed" | "hutch" | "hutchpp"``.
        bookkeeping: one backward pass with the clipped sum formed from the layer terms (default), or a second
            backward (``False``; see :class:`~lightning_dp.clipping.PerSampleClipper`).
        sum_check_every: period in batches of the per-sample sum check under book-keeping (``None``: off).
        projection_dim: ``k`` of ``hutch``/``hutchpp`` (default 32; they are accounted with ``accountant="rc"``).
        accountant: accountant name (default: the mechanism's sound default, ``"pld"`` for Gaussian).
        sample_rate: Poisson rate q; default ``per_device_train_batch_size * gradient_accumulation_steps *
            world_size / N``.
        poisson_sampling: replace the Trainer's sampler by Poisson sampling (default). ``False`` keeps the Trainer's
            shuffled fixed-size batches and logs that the reported epsilon assumes Poisson sampling.
        dp_seed: seed of the dedicated noise and sampling generators (``None``: OS entropy, recommended for real runs);
            independent of ``TrainingArguments.seed`` and never written to checkpoints.
        per_example_reduction: how an example's token losses become its one loss: ``"mean"`` over its non-ignored
            tokens (default: every example weighs the same whatever its length) or ``"sum"`` (long examples weigh
            more, and are clipped more often). Labels ``-100`` are ignored either way.
        momentum_length: ``k`` of the per-sample momentum (DP-PMLF seed, Algorithm 1 line 5; 1: DP-SGD): with
            ``k > 1`` each micro-batch's forward also runs at the ``k - 1`` stored iterates (newest first, the same
            dropout masks), whose copies of the trainable parameters are saved with each checkpoint; see
            :mod:`lightning_dp.optim.momentum`.
        momentum_beta: ``beta`` in ``(0, 1]`` of the per-sample momentum weights (ignored when ``k = 1``).
        check_batch_independence: check on the first step that no example's loss depends on another example's data
            (see :class:`~lightning_dp.privacy_engine.PrivacyEngine`); ``False`` switches it off.
        check_batch_independence_every: ``N >= 1``: repeat that check every N optimizer steps (steps ``0, N, 2N,
            ...``; with ``gradient_accumulation_steps`` on the step's first micro-batch with two examples or more), to
            catch mixing that starts after the first step (a schedule, a data-dependent branch); ``None`` (default):
            the first step only. Each checked step costs ``2 ceil(log2 B)`` extra backward passes and two extra
            forwards (measured: 3.6x to 4.7x the time of an unchecked step, docs/privacy.md) and leaves the update
            unchanged; mixing on unchecked steps is not seen. Needs ``check_batch_independence=True``.
        secure_mode: noise from the OS CSPRNG with floating-point mitigations (docs/privacy.md); rejects ``dp_seed``.
        lowpass: low-pass filter of the noisy gradient (LP-DPSGD; DP-PMLF seed, Algorithm 1 lines 9-11): a preset
            name of :data:`~lightning_dp.optim.lowpass.LOWPASS_PRESETS`, a dict ``{"a": [...], "b": [...]}``, or its
            JSON text on the command line (``--lowpass '{"a": [-0.9], "b": [0.1]}'``); ``None``: off.

    Raises:
        ValueError: any invalid value or combination, with what to change (same rules as ``DPStrategy``).
    """

    per_sample_max_grad_norm: float = field(default=1.0, metadata={"help": "Per-sample clipping bound C > 0."})
    target_epsilon: float | None = field(
        default=None, metadata={"help": "Privacy budget; the noise is calibrated for the planned steps."}
    )
    target_delta: float | None = field(default=None, metadata={"help": "Delta in (0, 1); default 1/N^1.1."})
    noise_multiplier: float | None = field(default=None, metadata={"help": "Gaussian noise multiplier sigma."})
    noise: str = field(
        default="gaussian", metadata={"help": "Noise mechanism: gaussian, laplace, laplace-advanced, lap2, plrv."}
    )
    noise_params: dict[str, Any] | str | None = field(
        default=None, metadata={"help": 'Non-Gaussian mechanism parameters as JSON, e.g. {"noise_scale": 3.0}.'}
    )
    clipping: str = field(
        default="flat", metadata={"help": "Per-sample clipping engine: flat, ghost, fgc, mixed, hutch, hutchpp."}
    )
    bookkeeping: bool = field(
        default=True, metadata={"help": "One backward pass (book-keeping) instead of a second backward."}
    )
    sum_check_every: int | None = field(
        default=DEFAULT_SUM_CHECK_EVERY, metadata={"help": "Batches between per-sample sum checks (None: off)."}
    )
    projection_dim: int | None = field(
        default=None, metadata={"help": "Projection columns k of hutch/hutchpp (default 32)."}
    )
    accountant: str | None = field(default=None, metadata={"help": "Accountant (default: the mechanism's)."})
    sample_rate: float | None = field(
        default=None, metadata={"help": "Poisson rate q; default batch * accumulation * world_size / N."}
    )
    poisson_sampling: bool = field(default=True, metadata={"help": "Poisson-sample the training set."})
    dp_seed: int | None = field(default=None, metadata={"help": "Seed of the DP noise and sampling generators."})
    per_example_reduction: Literal["mean", "sum"] = field(
        default="mean", metadata={"help": "Reduce an example's token losses by their mean or sum."}
    )
    momentum_length: int = field(default=1, metadata={"help": "Per-sample momentum length k (DP-PMLF); 1 is DP-SGD."})
    momentum_beta: float = field(default=0.9, metadata={"help": "Per-sample momentum decay beta in (0, 1]."})
    check_batch_independence: bool = field(
        default=True, metadata={"help": "Check on the first step that examples do not influence each other's loss."}
    )
    check_batch_independence_every: int | None = field(
        default=None,
        metadata={"help": "Repeat the batch-independence check every N optimizer steps (None: first step only)."},
    )
    secure_mode: bool = field(
        default=False, metadata={"help": "Noise from the OS CSPRNG with floating-point mitigations; no dp_seed."}
    )
    lowpass: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": 'Low-pass filter of the noisy gradient: a preset name or JSON {"a": [...], "b": [...]}.'},
    )

    def __post_init__(self) -> None:
        if isinstance(self.noise_params, str):
            try:
                self.noise_params = json.loads(self.noise_params)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"noise_params must be a JSON object such as '{{\"noise_scale\": 3.0}}', got {self.noise_params!r}"
                ) from error
        if self.noise_params is not None and not isinstance(self.noise_params, dict):
            raise ValueError(f"noise_params must be a dict (JSON object), got {self.noise_params!r}")
        if isinstance(self.lowpass, str) and self.lowpass.lstrip().startswith("{"):
            try:
                self.lowpass = json.loads(self.lowpass)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f'lowpass must be a preset name or a JSON object such as \'{{"a": [-0.9], "b": [0.1]}}\', got '
                    f"{self.lowpass!r}"
                ) from error
        if self.per_example_reduction not in PER_EXAMPLE_REDUCTIONS:
            raise ValueError(
                f"per_example_reduction must be one of {PER_EXAMPLE_REDUCTIONS}, got {self.per_example_reduction!r}"
            )
        if self.sample_rate is not None:
            validate_sample_rate(self.sample_rate)
        self.make_engine()  # validates every privacy argument; the trainer builds its own engine

    def make_engine(self) -> PrivacyEngine:
        """A fresh :class:`PrivacyEngine` for these arguments. Raises ``ValueError`` as the class docstring."""
        return PrivacyEngine(
            max_grad_norm=self.per_sample_max_grad_norm,
            target_epsilon=self.target_epsilon,
            target_delta=self.target_delta,
            noise_multiplier=self.noise_multiplier,
            noise=self.noise,
            noise_params=self.noise_params,
            clipping=self.clipping,
            bookkeeping=self.bookkeeping,
            sum_check_every=self.sum_check_every,
            projection_dim=self.projection_dim,
            accountant=self.accountant,
            seed=self.dp_seed,
            momentum_length=self.momentum_length,
            momentum_beta=self.momentum_beta,
            check_batch_independence=self.check_batch_independence,
            check_batch_independence_every=self.check_batch_independence_every,
            secure_mode=self.secure_mode,
            lowpass=self.lowpass,
        )
