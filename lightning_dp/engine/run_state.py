"""The state of one DP training run that the engine's parts share (docs/design.md section 2.2): the privacy engine
owns one :class:`RunState`, and its parts (the ledger, the clipping bound, the checkpoint state, the start-up block,
the run sequence) each receive it, so every name they read is a typed field declared here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, overload, runtime_checkable

if TYPE_CHECKING:
    import torch

    from lightning_dp.accounting import Accountant
    from lightning_dp.checks.guard import TrainingGuard
    from lightning_dp.clipping import PerSampleClipper
    from lightning_dp.clipping.groups import ClippingGroups
    from lightning_dp.config import PrivacyConfig
    from lightning_dp.correlated_noise.streaming import CorrelatedNoise
    from lightning_dp.data.users import UserDataset
    from lightning_dp.engine.correlation import CorrelationPlan
    from lightning_dp.mechanisms import NoiseMechanism
    from lightning_dp.optim.adaptive_clipping import AdaptiveClipping
    from lightning_dp.optim.lowpass import LowPassFilter
    from lightning_dp.optim.momentum import PerSampleMomentum
    from lightning_dp.runtime.distributed import DistributedContext
    from lightning_dp.runtime.randomness import DPRandomness


@runtime_checkable
class GaussianNoise(Protocol):
    """A mechanism that adds Gaussian noise of std ``noise_multiplier * max_grad_norm`` (by its attributes, as
    randomized and adaptive clipping read it, whatever its class)."""

    noise_multiplier: float


@dataclass(eq=False)
class RunState:
    """What one run knows, filled in as it goes (construction, ``attach``, the training loader, ``prepare``, the
    steps, a restored checkpoint). ``None`` means not known yet."""

    #: the run's options.
    config: PrivacyConfig
    #: per-sample momentum (a no-op with ``momentum_length = 1``).
    momentum: PerSampleMomentum
    #: the dedicated noise, sampling and projection generators.
    randomness: DPRandomness
    #: the sensitivity of a step's clipped sum, the mechanism's ``max_grad_norm``: the bound C, or with
    #: ``clipping_groups`` and a list of bounds ``sqrt(sum_g C_g^2)`` (``config.max_grad_norm`` keeps the list).
    max_grad_norm: float
    #: the bound the next micro-batch is clipped at: ``max_grad_norm``, or under adaptive clipping the bound it has
    #: moved to (a released value).
    current_max_grad_norm: float
    #: the clipping engine's name: ``config.clipping``, or the engine ``'auto'`` resolved to.
    clipping: str
    #: whether that engine clips by a random norm estimate (accounted by ``rc``), fixed when the engine is built.
    randomized_clipping: bool
    #: with ``clipping='auto'``, the engine chosen and why, one phrase for :attr:`defaults_applied`.
    auto_clipping: str | None
    #: the low-pass filter applied to every noisy step, or ``None``.
    lowpass: LowPassFilter | None
    #: the noise of a step (what is accounted for): given, calibrated by ``prepare`` or restored.
    mechanism: NoiseMechanism | None = None
    #: where the noise came from, for the start-up block: ``"given"``, ``"calibrated for ..."`` or ``"restored from
    #: the checkpoint"``.
    noise_origin: str | None = None
    #: delta of the reported epsilon: ``config.target_delta``, or its default once N is known (``prepare``).
    target_delta: float | None = None
    #: the defaults that affect the guarantee, one phrase each, shown by the start-up block.
    defaults_applied: list[str] = field(default_factory=list)
    accountant: Accountant | None = None
    #: the per-sample clipping hooks (``attach`` to ``detach``).
    clipper: PerSampleClipper | None = None
    #: checks around each training forward (buffers, batch independence), created by ``attach``.
    guard: TrainingGuard | None = None
    #: the resolved clipping groups and their bounds (``None``: flat clipping), kept after ``detach``.
    clipping_groups: ClippingGroups | None = None
    #: the rows of the forward one clipped unit owns, once the training loader regrouped users (else the option).
    unit_rows: int | None = None
    #: whether the clipper of a finished run dropped examples with a non-finite loss or gradient (this process).
    dropped_nonfinite: bool = False
    #: set only by the audit's test-only controls: what was broken (the summary then says so).
    broken_for_testing: str | None = None
    #: ``d`` of the randomized-clipping event (hutch/hutchpp).
    norm_dim: int | None = None
    #: Poisson rate q of a logical step and the dataset size N (users with ``privacy_unit="user"``).
    sample_rate: float | None = None
    num_samples: int | None = None
    #: trainable parameters of the clipped model.
    num_params: int | None = None
    #: a restored checkpoint's sample rate and adaptive bound, until ``prepare`` uses them.
    restored_sample_rate: float | None = None
    restored_clip_bound: float | None = None
    #: when set (by the ``PrivacyBudget`` callback), no step is taken that would push epsilon above it.
    epsilon_budget: float | None = None
    #: the moving clipping bound with ``target_unclipped_quantile``, else ``None``.
    adaptive: AdaptiveClipping | None = None
    #: the mechanism that noises the clipped sum: :attr:`mechanism`, except under adaptive clipping (the sum's share
    #: of the noise, at the current bound).
    sum_mechanism: NoiseMechanism | None = None
    #: the process group of a multi-process run (``None`` on one process).
    distributed: DistributedContext | None = None
    #: the per-process batch size (``None`` when unknown) and micro-batches per step of the training loader.
    loader_batches: tuple[int | None, int] | None = None
    #: whether each Poisson batch is split into micro-batches of similar lengths.
    length_grouped: bool = False
    #: the logical steps the run plans (``None``: unbounded).
    planned_steps: int | None = None
    #: computes the fraction of the last clipped pass's examples (the micro-batch's, or its last pass's under
    #: ``max_physical_batch_size``) whose norm exceeded the bound (diagnostic only: never logged; computed and read
    #: only when asked for, so that no step syncs for it).
    last_clip_fraction: Callable[[], float] | None = None
    #: the sample rate fixed by the first training loader.
    loader_rate: float | None = None
    #: micro-batches counted in the current logical step.
    micro_batches: int = 0
    #: the collator, dataset and rank a stand-in batch is drawn from.
    stand_in_source: tuple[Callable[[list[Any]], Any], Any, int] | None = None
    #: the training set regrouped by user (``privacy_unit="user"``).
    user_data: UserDataset | None = None
    #: with ``noise_correlation``, the strategy, scale and event of this start of training (``prepare``).
    correlation: CorrelationPlan | None = None
    #: a restored checkpoint's strategy (``CorrelationPlan.checkpoint_entry``), until ``prepare`` uses it.
    restored_correlation: dict[str, Any] | None = None
    #: with ``noise_correlation``, the noise stream of each wrapped optimizer of this start of training, with the
    #: parameters it noises (in the stream's order; sharded ones are noised shard by shard).
    noise_streams: list[tuple[CorrelatedNoise, list[torch.Tensor]]] = field(default_factory=list)
    #: an exact resume's noise streams (their ``state_dict``, full tensors), until the optimizers take them; ``None``
    #: otherwise.
    restored_noise_streams: list[dict[str, Any]] | None = None
    #: the processes, devices, sharding, dataset size and parameters the noise is drawn on
    #: (``exact_resume.draw_schedule``), fixed when training starts; an exact resume's, until then.
    draw_schedule: dict[str, Any] | None = None
    restored_draw_schedule: dict[str, Any] | None = None
    #: whether a start of training from the restored secret state began (``exact_resume.check_draw_schedule``); it
    #: ends by ``exact_resume.finish_restore``, or a refusal that then stays until the next load.
    resume_started: bool = False
    #: whether a checkpoint's load changed the run (``CheckpointState.begin_load``) and no start of training has
    #: followed (``exact_resume.finish_restore``).
    load_unfinished: bool = False
    #: whether an adapter's load holds part of a checkpoint (its privacy state before the weights, or weights without
    #: their privacy state: ``CheckpointState.begin_load``) until it loads the rest (``CheckpointState.end_load``) or
    #: training starts (``exact_resume.finish_restore``); ``CheckpointState.state_dict`` refuses meanwhile.
    load_partial: bool = False
    #: whether a fit began after such a load (``exact_resume.abandon_load``): its start is refused unless it
    #: loads a checkpoint itself.
    stale_load: bool = False
    #: with ``noise_correlation``, the training set its partition indexes (the first training loader's).
    partitioned_dataset: Any = None

    @property
    def steps(self) -> int:
        """Logical steps taken (and accounted) so far."""
        return self.accountant.steps if self.accountant is not None else 0

    @property
    def rows_per_unit(self) -> int:
        """The rows of the forward that one clipped unit owns: the ``augmentation_multiplicity`` copies of an
        example, times, with ``privacy_unit="user"``, the ``examples_per_user`` rows of a user (known once the
        training loader regrouped the data)."""
        return self.unit_rows or self.config.augmentation_multiplicity

    @property
    def noise_multiplier(self) -> float:
        """``sigma`` of the step's Gaussian noise, for the runs that require ``noise="gaussian"`` (randomized and
        adaptive clipping): the ``noise_multiplier`` of the mechanism registered, or given, under that name.

        Raises:
            RuntimeError: no mechanism yet, or one without a ``noise_multiplier``.
        """
        if not isinstance(self.mechanism, GaussianNoise):
            raise RuntimeError("the run's noise has no noise_multiplier (randomized and adaptive clipping need one)")
        return self.mechanism.noise_multiplier

    @property
    def sum_noise_multiplier(self) -> float:
        """Under adaptive clipping, the noise multiplier of the clipped sum (its Gaussian share of the noise).

        Raises:
            RuntimeError: before adaptive clipping is set up.
        """
        if not isinstance(self.sum_mechanism, GaussianNoise) or self.sum_mechanism is self.mechanism:
            raise RuntimeError("the clipped sum has its own noise only under adaptive clipping, once prepared")
        return self.sum_mechanism.noise_multiplier


T = TypeVar("T")


class _HasState(Protocol):
    state: RunState


class RunStateField(Generic[T]):
    """An attribute of the privacy engine (any object with a ``state``) that is the field of the same name of its
    :class:`RunState`."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, engine: None, owner: type) -> RunStateField[T]: ...
    @overload
    def __get__(self, engine: _HasState, owner: type) -> T: ...
    def __get__(self, engine: _HasState | None, owner: type) -> T | RunStateField[T]:
        return self if engine is None else getattr(engine.state, self.name)

    def __set__(self, engine: _HasState, value: T) -> None:
        setattr(engine.state, self.name, value)
