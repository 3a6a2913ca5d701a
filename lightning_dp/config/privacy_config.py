"""The privacy options of a run, defined, documented and validated once (:class:`PrivacyConfig`).

The adapters' surfaces are derived from the fields: the strategies' signatures and ``Args`` (:func:`option_parameters`,
:func:`option_docs`) and HF's ``PrivacyArguments`` (renamed per :data:`HF_NAMES`). A new option is one field plus, if
needed, a check in :meth:`PrivacyConfig.__post_init__` under :func:`~lightning_dp.config.errors.checking`;
``tests/config/test_config.py`` catches drift (docs/design.md section 2.1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from lightning_dp.accounting.base import validate_delta, validate_epsilon
from lightning_dp.checks.guard import validate_independence_every
from lightning_dp.clipping import AUTO, ENGINES, auto_engine, clipping_choices
from lightning_dp.clipping.clip_functions import (
    DEFAULT_AUTOMATIC_CLIPPING_GAMMA,
    validate_automatic_clipping_gamma,
    validate_clipping_fn,
)
from lightning_dp.clipping.clipper import DEFAULT_SUM_CHECK_EVERY
from lightning_dp.clipping.groups import (
    PER_LAYER,
    is_bound_list,
    sensitivity,
    validate_bounds,
    validate_clipping_groups,
)
from lightning_dp.clipping.multiplicity import validate_multiplicity
from lightning_dp.clipping.sum_check import validate_sum_check
from lightning_dp.config.combinations import (
    check_clipping_groups,
    check_exact_resume,
    check_noise_correlation,
    check_noise_given,
    check_randomized_and_adaptive,
)
from lightning_dp.config.errors import checking
from lightning_dp.data.physical_batches import validate_max_physical_batch_size
from lightning_dp.data.poisson import validate_sample_rate
from lightning_dp.data.users import validate_user_options
from lightning_dp.mechanisms import NoiseMechanism
from lightning_dp.mechanisms.base import mechanism_class, validate_max_grad_norm
from lightning_dp.mechanisms.secure import check_secure_mechanism
from lightning_dp.optim.adaptive_clipping import validate_adaptive_clipping
from lightning_dp.optim.lowpass import LowPassFilter, make_lowpass
from lightning_dp.optim.momentum import validate_momentum
from lightning_dp.utils.naming import did_you_mean

#: option name -> its name on the HF surface (``TrainingArguments`` already has ``max_grad_norm`` and ``seed``).
HF_NAMES = {"max_grad_norm": "per_sample_max_grad_norm", "seed": "dp_seed"}


def _option(default: Any, doc: str, help: str) -> Any:  # noqa: A002 - "help" is the HF metadata key
    return field(default=default, metadata={"doc": " ".join(doc.split()), "help": help})


@dataclass(frozen=True)
class PrivacyConfig:
    """Every option of a differentially private run (documented per field in ``metadata["doc"]``; see
    :func:`option_docs`). Validated on construction.

    Raises:
        ValueError: any invalid value or combination, with what to change.
    """

    max_grad_norm: float | list[float] = _option(
        1.0,
        "per-sample clipping bound C > 0 (l2; l1 for ``noise='laplace'``), in the units of the gradient norm. With "
        "``clipping_groups``, one number (each of the G groups gets ``C / sqrt(G)``) or a list of one bound per "
        "group; the sensitivity, which the noise is scaled to, is then ``sqrt(sum_g C_g^2)``.",
        "Per-sample clipping bound C > 0; with clipping_groups, one bound per group (several values, or JSON list).",
    )
    target_epsilon: float | None = _option(
        None,
        "privacy budget epsilon > 0; the noise is calibrated for the run's planned optimizer steps. Exclusive with "
        "``noise_multiplier`` / ``noise_params`` / a ``NoiseMechanism`` instance: exactly one fixes the noise.",
        "Privacy budget; the noise is calibrated for the planned steps.",
    )
    target_delta: float | None = _option(
        None, "delta in (0, 1); default ``1/N^1.1`` once the dataset size N is known.", "Delta in (0, 1)."
    )
    noise_multiplier: float | None = _option(
        None,
        "Gaussian sigma: the noise std is ``sigma * C`` on the clipped sum of a logical step.",
        "Gaussian noise multiplier sigma.",
    )
    noise: str | NoiseMechanism = _option(
        "gaussian",
        "noise mechanism, ``'gaussian' | 'laplace' | 'laplace-advanced' | 'lap2' | 'plrv'``, or a ``NoiseMechanism`` "
        "instance (e.g. from ``search_lap2(...).mechanism()``; in Python only).",
        "Noise mechanism: gaussian, laplace, laplace-advanced, lap2, plrv.",
    )
    noise_params: dict[str, Any] | None = _option(
        None,
        "constructor arguments of a non-Gaussian mechanism, e.g. ``{'noise_scale': 3.0}`` (JSON text on the HF "
        "command line).",
        'Non-Gaussian mechanism parameters as JSON, e.g. {"noise_scale": 3.0}.',
    )
    clipping: str = _option(
        AUTO,
        "per-sample clipping engine, ``'auto' | 'flat' | 'ghost' | 'fgc' | 'mixed' | 'hutch' | 'hutchpp'`` "
        "(:mod:`lightning_dp.clipping`). ``'auto'`` (default) runs the fastest exact engine for the mechanism, "
        "``'mixed'`` for an l2 mechanism and ``'flat'`` for ``noise='laplace'`` (l1), and the start-up block says "
        "which and why; it never picks ``hutch`` / ``hutchpp``. The exact engines give the same clipped sum up to "
        "float rounding and differ in cost only.",
        "Per-sample clipping engine: auto (mixed for l2 mechanisms, flat for laplace), flat, ghost, fgc, mixed, "
        "hutch, hutchpp.",
    )
    sum_check_every: int | None = _option(
        DEFAULT_SUM_CHECK_EVERY,
        "period in batches of the per-sample sum check (``None``: off).",
        "Batches between per-sample sum checks (None: off).",
    )
    projection_dim: int | None = _option(
        None,
        "``k`` of the randomized engines ``hutch`` / ``hutchpp`` (default 32). Their clipping norm is a random "
        "estimate, so the run is accounted by the randomized-clipping accountant ``'rc'`` (Ullah et al. 2026, "
        "Section 5), the default and the only one accepted there, with Gaussian noise.",
        "Projection columns k of hutch/hutchpp (default 32).",
    )
    accountant: str | None = _option(
        None,
        "accountant name; default the mechanism's sound default (``'pld'`` for Gaussian, ``'rc'`` for randomized "
        "clipping, ``'banded-mf'`` with ``noise_correlation='banded'``, ``'blt-minsep'`` with ``'blt'``).",
        "Accountant (default: the mechanism's).",
    )
    noise_correlation: str | None = _option(
        None,
        "``None`` (default): independent noise at every step (DP-SGD). ``'banded'``: banded matrix-factorization "
        "noise (Choquette-Choo et al. 2023; docs/correlated_noise.md): step ``t`` adds ``sigma C s (C^-1 Z)_t`` for "
        "an optimised ``b``-banded Toeplitz ``C`` (largest column norm ``s``), the data are cyclically Poisson-sampled "
        "over ``b`` groups at ``q_b = b q``, and the ``'banded-mf'`` accountant counts ``ceil(n / b)`` "
        "participations. ``'blt'``: buffered-linear-Toeplitz noise (Dvijotham et al. 2024) with "
        "``correlation_buffers`` buffers, cyclic sampling over ``b = floor(1 / q)`` groups, and the ``'blt-minsep'`` "
        "accountant (b-min-separation sensitivity, no amplification credited). Gaussian noise, exact engines, fixed "
        "bound; one process, DDP, or FSDP2 under Lightning's DPModelParallelStrategy.",
        "Correlated noise: banded or blt (matrix factorization with cyclic sampling); None: independent.",
    )
    correlation_band: int | None = _option(
        None,
        "``b >= 1``, the band of ``noise_correlation='banded'`` and its number of cyclic groups (1 is DP-SGD; needs "
        "``b q <= 1``).",
        "Band b of noise_correlation=banded (its number of cyclic groups).",
    )
    correlation_buffers: int | None = _option(
        None,
        "``d >= 1``, the buffers of ``noise_correlation='blt'`` (default 4): model-sized noise vectors the stream "
        "keeps.",
        "Buffers d of noise_correlation=blt (default 4).",
    )
    sample_rate: float | None = _option(
        None,
        "Poisson rate q in (0, 1] of the whole dataset; default ``batch_size * accumulation * W / N`` with the "
        "per-process batch size and W processes.",
        "Poisson rate q; default batch * accumulation * world_size / N.",
    )
    poisson_sampling: bool = _option(
        True,
        "replace the training sampler by Poisson sampling (default). ``False`` keeps the framework's batches and "
        "logs that the reported epsilon assumes Poisson sampling, which shuffled fixed-size batches are not.",
        "Poisson-sample the training set.",
    )
    max_physical_batch_size: int | None = _option(
        None,
        "``c >= 1``: the most examples (users with ``privacy_unit='user'``) one forward/backward pass takes "
        "(Opacus's name). Each micro-batch, whose Poisson size varies, runs in ``max(1, ceil(B / c))`` passes, their "
        "clipped sums added before the step's one noise draw: the update, the noise and the accountant are those "
        "without the cap. The start-up block shows the expected passes per step. ``None`` (default): one pass per "
        "micro-batch.",
        "Most examples per forward/backward pass; a micro-batch runs in as many passes as it needs (None: one).",
    )
    seed: int | None = _option(
        None,
        "seed of the dedicated noise, sampling and projection generators; ``None`` uses OS entropy (recommended "
        "for real runs). Written to checkpoints only with ``exact_resume`` (:mod:`lightning_dp.runtime.randomness`).",
        "Seed of the DP noise and sampling generators.",
    )
    exact_resume: bool = _option(
        False,
        "write the run's secret randomness (base seed, noise generators' states, correlated noise's stream) into its "
        "checkpoints, so a resume continues the run exactly: the same batches (sampling keyed by the step), noise "
        "and, with ``noise_correlation``, one ledger segment. Such a checkpoint reveals the noise: keep it private "
        "(docs/privacy.md). Not with ``secure_mode``, ``privacy_unit='user'``, ``poisson_sampling=False``, "
        "``hutch``/``hutchpp`` or FSDP2-sharded parameters.",
        "Checkpoints hold the secret randomness so a resume continues the run exactly (keep them private).",
    )
    momentum_length: int = _option(
        1,
        "``k >= 1``: each example's clipped quantity is its per-sample momentum over the ``k`` most recent iterates "
        "(Xu et al. 2026, Algorithm 1 line 5; :mod:`lightning_dp.optim.momentum`); 1 is DP-SGD. ``k > 1`` runs the "
        "forward ``k`` times per batch (first at each stored iterate, newest first, with logging dropped there) and "
        "keeps ``k - 1`` copies of the trainable parameters, saved in checkpoints; the accountant is unchanged "
        "(the sensitivity stays ``C``).",
        "Per-sample momentum length k (DP-PMLF); 1 is DP-SGD.",
    )
    momentum_beta: float = _option(
        0.9,
        "``beta`` in ``(0, 1]``, the decay of the momentum weights ``beta^(t-i) / c_beta`` (ignored when "
        "``momentum_length = 1``).",
        "Per-sample momentum decay beta in (0, 1].",
    )
    check_batch_independence: bool = _option(
        True,
        "on the first step, check that no example's loss depends on another example's data (``h - h.mean(0)`` "
        "and the like; :mod:`lightning_dp.checks`); ``False`` switches the check off. Buffers written "
        "during a training forward are rejected on every step either way.",
        "Check on the first step that examples do not influence each other's loss.",
    )
    check_batch_independence_every: int | None = _option(
        None,
        "``N >= 1``: repeat that check every N optimizer steps (steps ``0, N, 2N, ...``; with gradient "
        "accumulation on the step's first micro-batch with two examples or more), to catch mixing that starts "
        "after the first step (a schedule, a data-dependent branch); ``None`` (default): the first step only. Each "
        "checked step costs ``2 ceil(log2 B)`` extra backward passes and six extra forwards (see docs/privacy.md for "
        "measured ratios to an unchecked step) and leaves the update unchanged; mixing on unchecked "
        "steps is not seen. Needs ``check_batch_independence=True``.",
        "Repeat the batch-independence check every N optimizer steps (None: first step only).",
    )
    secure_mode: bool = _option(
        False,
        "draw the noise and sampling streams from the OS CSPRNG, reseeded for every draw, with the floating-point "
        "mitigations of :mod:`lightning_dp.mechanisms.secure` (docs/privacy.md); rejects a ``seed``.",
        "Noise from the OS CSPRNG with floating-point mitigations; no seed.",
    )
    target_unclipped_quantile: float | None = _option(
        None,
        "adaptive clipping (Andrew et al. 2021, Algorithm 1): the fraction gamma in (0, 1) of examples to leave "
        "unclipped; C starts at ``max_grad_norm`` and after each step moves geometrically towards the gamma quantile "
        "of the per-sample norms, using a noisy count of unclipped examples (:mod:`lightning_dp.optim.adaptive_"
        "clipping`). The count's release is accounted: the clipped sum's noise multiplier becomes ``(sigma^-2 - (2 "
        "sigma_b)^-2)^(-1/2)`` so that a step costs one Gaussian step at ``noise_multiplier`` sigma. Gaussian noise "
        "and exact engines only. ``None`` (default): C fixed.",
        "Adaptive clipping: fraction of examples to leave unclipped (None: fixed C).",
    )
    clipbound_learning_rate: float = _option(
        0.2,
        "eta > 0 of adaptive clipping's update ``C <- C exp(-eta (unclipped fraction - gamma))`` (0.2, as in "
        "Andrew et al. 2021's experiments).",
        "Adaptive clipping: learning rate of the geometric update of C.",
    )
    min_clipbound: float | None = _option(
        None, "adaptive clipping: lower clamp of C (``None``: none).", "Adaptive clipping: lower clamp of C."
    )
    max_clipbound: float | None = _option(
        None, "adaptive clipping: upper clamp of C (``None``: none).", "Adaptive clipping: upper clamp of C."
    )
    unclipped_num_std: float | None = _option(
        None,
        "adaptive clipping: std sigma_b of the noise on the count of unclipped examples, in examples (in users under "
        "``privacy_unit='user'``); must exceed sigma / 2. Default: the expected batch size ``q N / 20``, as in Andrew "
        "et al. 2021's experiments.",
        "Adaptive clipping: std of the unclipped count's noise (default q N / 20).",
    )
    lowpass: str | dict[str, Any] | LowPassFilter | None = _option(
        None,
        "low-pass filter of the noisy gradient (Xu et al. 2026, Algorithm 1 lines 9-11; LP-DPSGD): ``None`` (off), "
        "a preset name of :data:`~lightning_dp.optim.lowpass.LOWPASS_PRESETS`, or ``{'a': [a_1, ...], 'b': [b_0, "
        "...]}`` (JSON text on the HF command line). Post-processing: no privacy cost, same accountant; its state "
        "is checkpointed.",
        'Low-pass filter of the noisy gradient: a preset name or JSON {"a": [...], "b": [...]}.',
    )
    clipping_groups: str | list[list[str]] | None = _option(
        None,
        "group-wise clipping (He et al. 2022, Section 3; :mod:`lightning_dp.clipping.groups`): ``None`` (default) "
        "clips each example's whole gradient to ``max_grad_norm``; ``'per_layer'`` makes one group per module "
        "owning trainable parameters (``named_modules`` order), a list of groups of fnmatch patterns on parameter "
        "names (``[['encoder.*'], ['classifier.*', 'pooler.*']]``) must put every trainable parameter in exactly "
        "one group. Each group's part of an example's gradient is clipped to its own bound ``C_g`` "
        "(``max_grad_norm``), the noise is scaled to ``sqrt(sum_g C_g^2)`` and the accounting is that of flat "
        "clipping at that bound. l2 mechanisms and exact engines only; not with adaptive clipping.",
        "Group-wise clipping: per_layer, or JSON list of groups of parameter-name patterns (None: flat clipping).",
    )
    clipping_fn: str = _option(
        "abadi",
        "the clip function (:mod:`lightning_dp.clipping.clip_functions`; fastDP's name): ``'abadi'`` (default) "
        "scales an example's (user's) gradient by ``min(1, C / ||g||)`` (Abadi et al. 2016, Algorithm 1); "
        "``'automatic'`` by ``C / (||g|| + gamma)`` (Bu et al. 2023, Section 4), every gradient normalised, so "
        "its scale no longer matters and the learning rate takes the role of ``C`` (``max_grad_norm=1`` is fastDP's "
        "form). Both keep the sensitivity ``C`` (per group ``C_g``) and the accounting unchanged. Automatic: exact "
        "engines only, not with adaptive clipping.",
        "Clip function: abadi (min(1, C/||g||), default) or automatic (C/(||g||+gamma), Bu et al. 2023).",
    )
    automatic_clipping_gamma: float = _option(
        DEFAULT_AUTOMATIC_CLIPPING_GAMMA,
        "gamma >= 0 of ``clipping_fn='automatic'``, in gradient-norm units: the stability constant of Bu et al. "
        "2023 (0.01, fastDP's default); 0 is normalised SGD (Das et al. 2023). Below 1e-6 it counts as 1e-6, the "
        "standard factor's constant, which keeps what underflow takes from a norm within the sensitivity. Ignored by "
        "``'abadi'``.",
        "Automatic clipping: stability constant gamma >= 0 (0.01; 0: normalised SGD).",
    )
    augmentation_multiplicity: int = _option(
        1,
        "augmentation multiplicity (De et al. 2022, Section 3.2; :mod:`lightning_dp.clipping.multiplicity`): ``K "
        ">= 1`` augmented copies of each example, whose gradients are averaged BEFORE the example is clipped, so "
        "one example's sensitivity stays ``C`` and the accounting is unchanged. With ``K > 1`` the training step "
        "makes the copies of its batch of ``B`` examples in sample-major order (rows ``i K .. i K + K - 1`` are "
        "example ``i``'s: :func:`lightning_dp.repeat_for_multiplicity`, then a per-row augmentation, only in train "
        "mode), and returns each example's mean over its copies, shape ``[B]`` "
        "(:func:`lightning_dp.augmentation_mean`); every hooked layer must see the ``B K`` rows. ``DPTrainer`` makes "
        "the copies itself and augments them with its ``augment_copies`` method, which must be overridden. A step "
        "costs about ``K`` times the forward and backward of ``K = 1``. 1 (default): no copies.",
        "Augmented copies per example, averaged before clipping (De et al. 2022); 1: none.",
    )
    privacy_unit: str = _option(
        "example",
        "what one unit of privacy is (:mod:`lightning_dp.data.users`): ``'example'`` (default), or ``'user'``: the "
        "training set is regrouped by ``user_key``, Poisson sampling includes each user with rate ``q`` (the batch "
        "size counts users), each sampled user's rows contribute one clipped quantity, the clipped mean of their "
        "examples' gradients, and epsilon is about adding or removing one user with all their examples (``N`` = "
        "the number of users; the default delta is ``1 / N^1.1`` of users). The training step is unchanged: it "
        "receives the sampled users' rows ``[U K, ...]`` and returns one loss per row.",
        "Unit of privacy: example (default) or user (Poisson sampling and clipping per user, see user_key).",
    )
    user_key: str | Callable[[Any], Any] | None = _option(
        None,
        "with ``privacy_unit='user'``: the column (key of each example) holding its user, or a function ``example "
        "-> user`` (Python API). A string column is removed from the examples before collation.",
        "With privacy_unit=user: the column holding each example's user.",
    )
    examples_per_user: int | None = _option(
        None,
        "with ``privacy_unit='user'``: ``K``, the rows a sampled user brings to a step: all their examples when "
        "they have ``K`` or fewer (padded with weight-0 copies), a fresh random subset of ``K`` otherwise. ``None`` "
        "(default): every example of every user, ``K`` = the largest user's count (a skewed set then computes "
        "mostly padding: cap it). A step's forward sees about ``U K`` rows for ``U`` sampled users.",
        "With privacy_unit=user: rows per sampled user (cap); None: all of each user's examples.",
    )

    def __post_init__(self) -> None:
        with checking("max_grad_norm"):
            if is_bound_list(self.max_grad_norm):
                validate_bounds(self.max_grad_norm)
            else:
                validate_max_grad_norm(cast(float, self.max_grad_norm))  # not a list: one bound
        with checking("clipping_groups"):
            validate_clipping_groups(self.clipping_groups, self.max_grad_norm)
        with checking("augmentation_multiplicity"):
            validate_multiplicity(self.augmentation_multiplicity)
        with checking("privacy_unit"):
            validate_user_options(self.privacy_unit, self.user_key, self.examples_per_user)
            if self.privacy_unit == "user" and not self.poisson_sampling:
                raise ValueError(
                    "privacy_unit='user' samples users (Poisson sampling over users): keep poisson_sampling=True"
                )
        with checking("max_physical_batch_size"):
            validate_max_physical_batch_size(self.max_physical_batch_size)
        with checking("check_batch_independence_every"):
            validate_independence_every(self.check_batch_independence_every, self.check_batch_independence)
        validate_momentum(self.momentum_length, self.momentum_beta)
        if self.secure_mode and self.seed is not None:
            raise ValueError(
                f"secure_mode=True draws every noise sample from the OS CSPRNG, so seed={self.seed} cannot apply: "
                "remove it, or set secure_mode=False for a reproducible experiment"
            )
        if self.target_epsilon is not None:
            with checking("target_epsilon"):
                validate_epsilon(self.target_epsilon)
        if self.target_delta is not None:
            with checking("target_delta"):
                validate_delta(self.target_delta, "target_delta")
        if self.sample_rate is not None:
            with checking("sample_rate"):
                validate_sample_rate(self.sample_rate)
        check_noise_given(self)
        with checking("sum_check_every"):
            validate_sum_check(self.sum_check_every)
        if self.clipping != AUTO and self.clipping not in ENGINES:
            choices = clipping_choices()
            with checking("clipping"):
                hint = did_you_mean(self.clipping, choices)
                if str(self.clipping).replace("-", "_").lower() == PER_LAYER:
                    hint = f" (per-layer clipping is clipping_groups='{PER_LAYER}', with an exact engine)"
                raise ValueError(f"clipping must be one of {choices}, got {self.clipping!r}{hint}")
        with checking("automatic_clipping_gamma"):
            validate_automatic_clipping_gamma(self.automatic_clipping_gamma)
        with checking("clipping_fn"):
            validate_clipping_fn(self.clipping_fn, randomized=self.randomized_clipping, adaptive=self.adaptive_clipping)
        if self.noise_multiplier is not None and self.noise != "gaussian":
            raise ValueError(f"noise_multiplier applies to noise='gaussian'; for {self.noise!r} pass noise_params")
        if isinstance(self.noise, NoiseMechanism) and not self._carries_sensitivity(self.noise):
            groups = f" (the sensitivity sqrt(sum C_g^2) = {self.sensitivity:.6g})" if self.clipping_groups else ""
            raise ValueError(
                f"max_grad_norm={self.max_grad_norm}{groups} differs from the mechanism's {self.noise.max_grad_norm}; "
                "make them equal"
            )
        if self.secure_mode:
            check_secure_mechanism(self.noise)
        with checking("lowpass"):
            make_lowpass(self.lowpass)  # validates the preset name or coefficients
        validate_adaptive_clipping(
            self.target_unclipped_quantile,
            self.clipbound_learning_rate,
            self.min_clipbound,
            self.max_clipbound,
            self.unclipped_num_std,
        )
        check_clipping_groups(self)
        check_randomized_and_adaptive(self)
        check_noise_correlation(self)
        check_exact_resume(self)

    @property
    def noise_name(self) -> str:
        """The mechanism's registry name (of the instance when ``noise`` is one)."""
        return self.noise.name if isinstance(self.noise, NoiseMechanism) else self.noise

    @property
    def sensitivity(self) -> float:
        """The l2 (l1 for ``noise='laplace'``) sensitivity of a step's clipped sum, which the mechanism's
        ``max_grad_norm`` is: ``max_grad_norm``, or ``sqrt(sum_g C_g^2)`` for a list of group bounds
        (:func:`~lightning_dp.clipping.groups.sensitivity`; a number split over groups keeps its value)."""
        return sensitivity(self.max_grad_norm)

    def _carries_sensitivity(self, mechanism: NoiseMechanism) -> bool:
        """Whether ``mechanism.max_grad_norm`` is :attr:`sensitivity`: equal to the bound, or for a list of group
        bounds equal up to float rounding (the root of the sum of squares computed elsewhere)."""
        if is_bound_list(self.max_grad_norm):
            return math.isclose(mechanism.max_grad_norm, self.sensitivity, rel_tol=1e-12)
        return mechanism.max_grad_norm == self.max_grad_norm

    @property
    def clip_norm(self) -> int:
        """The mechanism's clipping norm (1 or 2)."""
        mechanism = self.noise if isinstance(self.noise, NoiseMechanism) else mechanism_class(self.noise)
        return mechanism.clip_norm

    @property
    def adaptive_clipping(self) -> bool:
        """Whether the clipping bound adapts to a quantile of the per-sample norms (``target_unclipped_quantile``)."""
        return self.target_unclipped_quantile is not None

    @property
    def randomized_clipping(self) -> bool:
        """Whether the clipping engine clips by a random norm estimate (it then needs the ``rc`` accountant);
        ``'auto'`` never picks such an engine."""
        return self.clipping != AUTO and ENGINES[self.clipping].randomized

    def resolved_clipping(self) -> tuple[str, str | None]:
        """``(engine, reason)``: the engine the run uses, and why when ``clipping='auto'`` picked it (``None`` when
        the engine was named). ``'auto'`` resolves by the mechanism's clipping norm
        (:func:`~lightning_dp.clipping.engines.base.auto_engine`): ``'mixed'`` for l2, ``'flat'`` for l1."""
        if self.clipping != AUTO:
            return self.clipping, None
        return auto_engine(self.clip_norm)
