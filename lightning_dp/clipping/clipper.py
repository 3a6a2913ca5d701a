"""Per-sample gradient clipping of a module through layer hooks (docs/design.md sections 2.2 and 4).

Per-sample loss ``[B]`` -> one backward pass to the hooked layers' output gradients -> per-sample norms ``n_i`` ->
clip factors ``c_i = min(1, C / (nu_i + 1e-6))`` (``nu_i >= n_i``, section 4.10; automatic clipping: ``C / (nu_i +
gamma)``, section 4.11) -> the clipped sum
``sum_i c_i grad(loss_i)`` added into ``p.grad`` by book-keeping (Abadi et al. 2016, Algorithm 1; Bu et al. 2023,
Section 3; section 4.4). Group-wise clipping: section 4.7; per-sample momentum: section 7; augmentation
multiplicity: section 4.8; the sum check: section 9.3. The class's bases: :mod:`~.sample_norms` (norms and the sum
check), :mod:`~.clipped_sum` (the clipped sum), :mod:`~.past_iterates` (momentum's past iterates).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from copy import copy

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

from lightning_dp.clipping.clip_functions import (
    DEFAULT_AUTOMATIC_CLIPPING_GAMMA,
    clip_factors,
    validate_automatic_clipping_gamma,
    validate_clipping_fn,
)
from lightning_dp.clipping.clipped_sum import ClippedSumMixin, output_gradients
from lightning_dp.clipping.engines.base import ClippingEngine, make_clipping_engine
from lightning_dp.clipping.groups import (
    Bounds,
    ClippingGroups,
    GroupsSpec,
    check_grouped_clipping,
    resolve_clipping_groups,
    single_bound,
    validate_bounds,
    validate_clipping_groups,
)
from lightning_dp.clipping.hooks import Capture, CaptureHooks
from lightning_dp.clipping.layers.fallback import covered_parameters, describe_fallback, own_parameters
from lightning_dp.clipping.layers.registry import LayerFamily
from lightning_dp.clipping.loss_scaling import LossScaleMixin, unscale_linear
from lightning_dp.clipping.multiplicity import validate_multiplicity
from lightning_dp.clipping.past_iterates import PastIteratesMixin
from lightning_dp.clipping.rounding import full_precision, warn_if_half_precision
from lightning_dp.clipping.sample_norms import SampleNormsMixin, reported_norms
from lightning_dp.clipping.sum_check import reduced_precision, validate_sum_check
from lightning_dp.clipping.swaps.base import restore_modules, swap_modules
from lightning_dp.clipping.terms import Term
from lightning_dp.clipping.validation import check_trainable_set, hooked_modules
from lightning_dp.runtime.sharding import reshard_all, uses_fsdp

log = logging.getLogger("lightning_dp")

#: Default period (in clipped batches) of the sum check.
DEFAULT_SUM_CHECK_EVERY = 100

_LOSS_SHAPE_MESSAGE = (
    "training_step must return a per-sample loss of shape [B] (use reduction='none' and reduce over tokens per sample)"
)


class PerSampleClipper(LossScaleMixin, PastIteratesMixin, ClippedSumMixin, SampleNormsMixin):
    """Clips per-sample gradients of ``module`` and accumulates their sum into ``p.grad``.

    Hooks are attached in place (``state_dict`` keys unchanged); modules that use their parameters outside a hookable
    call (``nn.MultiheadAttention``, ``nn.LSTM``/``GRU``/``RNN``) are swapped in place (:mod:`~.swaps.base`);
    :meth:`detach` undoes both. Frozen parameters are ignored; the set of trainable parameters is fixed at construction
    (a change makes the next :meth:`backward` raise). A parameter used several times contributes the norm of its summed
    gradient (docs/design.md section 4.5).

    Args:
        module: the model; dim 0 of every hooked layer's input/output is the sample dimension (``B K`` rows,
            sample-major, with ``augmentation_multiplicity = K``).
        clipping: engine name, one of :data:`~lightning_dp.clipping.engines.base.ENGINES`.
        max_grad_norm: clipping bound ``C > 0`` (gradient-norm units); with ``clipping_groups``, one number (``C /
            sqrt(G)`` per group) or one bound per group; sensitivity ``sqrt(sum_g C_g^2)`` (:attr:`max_grad_norm`).
        clipping_groups: ``None`` (flat), ``"per_layer"`` or a list of groups of ``fnmatch`` patterns
            (:func:`~lightning_dp.clipping.groups.resolve_clipping_groups`); l2 and an exact engine only.
        norm: 2 (l2 clipping) or 1 (l1, Laplace mechanism; ``flat`` only).
        sum_check_every: period in batches of the sum check (first non-empty batch, then every N-th); ``None``: off.
            Tolerances: :class:`~.sum_check.SumCheck`; docs/design.md section 9.3.
        projection_dim: ``k`` of ``hutch``/``hutchpp`` (default 32).
        generator_for: ``device -> torch.Generator``, the run's DP randomness for the randomized engines' projections;
            required for ``hutch``/``hutchpp``.
        augmentation_multiplicity: ``K >= 1`` rows per example (De et al. 2022, Section 3.2;
            :mod:`~lightning_dp.clipping.multiplicity`); default 1.
        clipping_fn: the clip function, ``"abadi"`` (default, ``min(1, C / n)``) or ``"automatic"`` (``C / (n +
            gamma)``, Bu et al. 2023; :mod:`~.clip_functions`); the sensitivity is ``C`` (per group ``C_g``) for both.
        automatic_clipping_gamma: ``gamma >= 0`` of automatic clipping, in gradient-norm units (default 0.01; 0:
            normalised SGD, Das et al. 2023; below ``1e-6`` it counts as ``1e-6``).

    Raises:
        ValueError: unknown engine; ``norm`` not in {1, 2} or ``norm=1`` with an engine other than ``flat``; a bound
            not positive and finite; ``sum_check_every < 1``; a randomized engine without ``generator_for``; with
            groups, ``norm=1``, a randomized engine, groups not covering every trainable parameter once or bounds of
            the wrong length; a list ``max_grad_norm`` without groups; ``augmentation_multiplicity`` not an integer
            >= 1; swapped modules on an FSDP2-sharded model; an invalid clip function or gamma, or ``"automatic"`` with
            a randomized engine (:mod:`~.clip_functions`).
        UnsupportedModuleError: BatchNorm, another norm layer with ``track_running_stats=True``, or a trainable
            parameter not covered by a registered layer (:mod:`lightning_dp.clipping.layers.registry`).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        clipping: str = "flat",
        max_grad_norm: Bounds,
        norm: int = 2,
        sum_check_every: int | None = DEFAULT_SUM_CHECK_EVERY,
        projection_dim: int | None = None,
        generator_for: Callable[[torch.device], torch.Generator] | None = None,
        clipping_groups: GroupsSpec = None,
        augmentation_multiplicity: int = 1,
        clipping_fn: str = "abadi",
        automatic_clipping_gamma: float = DEFAULT_AUTOMATIC_CLIPPING_GAMMA,
    ) -> None:
        validate_multiplicity(augmentation_multiplicity)
        if norm not in (1, 2):
            raise ValueError(f"norm must be 1 or 2, got {norm!r}")
        self._engine: ClippingEngine = make_clipping_engine(clipping, projection_dim=projection_dim)
        if norm == 1 and not self._engine.supports_l1:
            raise ValueError(f"norm=1 (l1 clipping) requires clipping='flat', got clipping={clipping!r}")
        validate_bounds(max_grad_norm)
        validate_clipping_fn(clipping_fn, randomized=self._engine.randomized)
        validate_automatic_clipping_gamma(automatic_clipping_gamma)
        validate_clipping_groups(clipping_groups, max_grad_norm)
        if clipping_groups is not None:
            check_grouped_clipping(norm=norm, engine=clipping, randomized=self._engine.randomized)
        validate_sum_check(sum_check_every)
        if self._engine.randomized and generator_for is None:
            raise ValueError(f"clipping={clipping!r} draws random projections: pass generator_for (the DP randomness)")
        self.module = module
        self.clipping = clipping
        #: the groups of group-wise clipping and their bounds (``None``: flat clipping), resolved below.
        self.groups: ClippingGroups | None = None
        #: the group of each trainable parameter (empty: flat clipping, every parameter in group 0).
        self._group_of: dict[nn.Parameter, int] = {}
        #: the clipping bound of flat clipping (adaptive clipping moves it between steps); with groups, the l2
        #: sensitivity ``sqrt(sum_g C_g^2)`` of the clipped sum (read only: the groups' bounds clip).
        self.max_grad_norm = single_bound(max_grad_norm) if clipping_groups is None else 0.0
        #: ``[G, B]`` the per-group norms of the last clipped batch with groups (``None`` without).
        self.last_group_norms: torch.Tensor | None = None
        self.norm = norm
        #: the clip function (:data:`~.clip_functions.CLIPPING_FNS`) and automatic clipping's gamma.
        self.clipping_fn = clipping_fn
        self.automatic_clipping_gamma = float(automatic_clipping_gamma)
        #: ``K``, the rows per example of every hooked layer (augmentation multiplicity; 1: one row per example).
        self.augmentation_multiplicity = int(augmentation_multiplicity)
        self.sum_check_every = sum_check_every
        self._generator_for = generator_for
        self._checked_batches = 0
        self._slot = None
        #: FSDP2 swaps each sharded module's registered parameters (DTensor shards) for unsharded ones around its
        #: forward and backward, so parameters are identified by (module, attribute), never by the object a
        #: module holds at the moment (:mod:`lightning_dp.runtime.sharding`).
        self._sharded = uses_fsdp(module)
        if self._sharded:
            # after a forward (evaluation, generation) FSDP2 may hold some modules' parameters gathered: the
            # clipper must know the registered shards, which the clipped sums go to
            reshard_all(module)
        if clipping_groups is not None:  # named before the swaps add their proxies' names
            self._resolve_groups(module, clipping_groups, max_grad_norm)
        self._swaps = swap_modules(module)
        try:
            if self._sharded and self._swaps:
                raise ValueError(
                    f"{', '.join(sorted({swap.original.__name__ for swap in self._swaps}))} cannot be clipped "
                    "on an FSDP2-sharded model (their replacements use the parameters outside FSDP2's gathering); "
                    "train such a model unsharded (DPDDPStrategy), or shard a model without these modules"
                )
            hooked = hooked_modules(module, self._sharded)
        except BaseException:
            restore_modules(self._swaps)
            raise
        self._names = {p: name for name, p in module.named_parameters() if p.requires_grad}
        self._params = list(self._names)
        warn_if_half_precision(self._params)
        self._all_names = frozenset(
            name for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad
        )
        #: ``{path: descendant paths}``: modules whose fallback encloses parameters misplaced at their own modules
        self.enclosing: dict[str, tuple[str, ...]] = {}
        self._attach_hooks(hooked)
        #: modules whose folded (``B K r``) or expanded rows were seen to keep each example's rows its own
        self._rows_verified: set[str] = set()
        self._init_past_iterates()
        #: whether any sample has been dropped for a non-finite loss or norm since construction (see
        #: :meth:`backward`); read once at the end of a run, never per step.
        self.dropped_nonfinite = False
        #: whether a due sum check was postponed because its batch held a non-finite sample and has not run since
        #: (a check that never runs cannot catch a parameter used outside its layer); read at the end of a run.
        self.sum_check_postponed = False

    def _attach_hooks(self, hooked: dict[str, tuple[nn.Module, LayerFamily]], enclosing: bool = False) -> None:
        """Hook ``hooked`` (:func:`~.validation.hooked_modules`), key the parameters each family covers, and log the
        modules of the exact fallback (with ``enclosing``, those that enclose others only: the rest were logged)."""
        self._registered = {
            (id(owner), attr): p
            for owner in self.module.modules()
            for attr, p in own_parameters(owner).items()
            if p.requires_grad
        }
        for sub, family in hooked.values():
            for attr, p in covered_parameters(sub, family.encloses).items():
                if p.requires_grad:
                    self._registered[(id(sub), attr)] = p
        fallback = {
            path: entry for path, entry in hooked.items() if entry[1].encloses or entry[1].reruns and not enclosing
        }
        if fallback:
            log.info(describe_fallback(fallback))
        # under FSDP2 the fallback's data-dependent comparison could raise on one rank alone: the guard's lockstep
        # batch-independence check covers mixing there
        self._hooks = CaptureHooks(hooked, copy_parameters=self._sharded, record_outputs=not self._sharded)

    def enclose(self, enclosing: dict[str, tuple[str, ...]]) -> None:
        """Serve the own parameters of the modules named in ``enclosing`` (``{path: descendant paths relative to
        it}``) by the exact fallback on the enclosing module instead of their own hooks (found by the attach probe,
        :mod:`lightning_dp.checks.enclosing`); replaces any earlier enclosures. Re-hooks the model.

        Raises:
            UnsupportedModuleError: as :func:`~.validation.hooked_modules` (an FSDP2-sharded model).
        """
        hooked = hooked_modules(self.module, self._sharded, enclosing)
        self._hooks.remove()
        self.enclosing = dict(enclosing)
        self._attach_hooks(hooked, enclosing=True)

    def _resolve_groups(self, module: nn.Module, clipping_groups: GroupsSpec, max_grad_norm: Bounds) -> None:
        """Set :attr:`groups`, :attr:`_group_of` and :attr:`max_grad_norm` (the sensitivity).

        Raises:
            ValueError: as :func:`~lightning_dp.clipping.groups.resolve_clipping_groups`.
        """
        names: dict[nn.Parameter, list[str]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            if param.requires_grad:
                names.setdefault(param, []).append(name)
        self.groups = resolve_clipping_groups(clipping_groups, max_grad_norm, list(names.values()))
        self._group_of = dict(zip(names, self.groups.index, strict=True))
        self.max_grad_norm = self.groups.sensitivity

    def _group_bounds(self) -> tuple[float, ...]:
        """``C_g`` per group: ``(max_grad_norm,)`` for flat clipping, else the groups' bounds."""
        return (self.max_grad_norm,) if self.groups is None else self.groups.bounds

    @property
    def trainable_parameters(self) -> list[nn.Parameter]:
        """The trainable parameters (``requires_grad`` at construction), each once, in ``module.parameters()`` order."""
        return list(self._params)

    @property
    def _rounding_epsilon(self) -> float:
        """Machine epsilon of the per-sample arithmetic: float64's if every trainable parameter is float64, else
        float32's."""
        double = all(p.dtype == torch.float64 for p in self._params)
        return torch.finfo(torch.float64 if double else torch.float32).eps

    @property
    def _norm_dtype(self) -> torch.dtype:
        """float64 when any trainable parameter is float64, else float32 (the dtype of the returned norms)."""
        return torch.float64 if any(p.dtype == torch.float64 for p in self._params) else torch.float32

    @property
    def sharded(self) -> bool:
        """Whether the module is FSDP2-sharded (``fully_shard`` applied before the clipper was built)."""
        return self._sharded

    @property
    def engine(self) -> ClippingEngine:
        """The clipping engine in use."""
        return self._engine

    def _check_trainable_set(self) -> None:
        """Raise ``ValueError`` if the trainable set changed (:func:`~.validation.check_trainable_set`)."""
        current: dict[object, str]
        known: dict[object, str]
        if self._sharded:  # FSDP2 swaps the objects (sharded <-> unsharded), tied ones too: compare every name
            current = {
                name: name for name, p in self.module.named_parameters(remove_duplicate=False) if p.requires_grad
            }
            known = {name: name for name in self._all_names}
        else:
            current = {id(p): name for name, p in self.module.named_parameters() if p.requires_grad}
            known = {id(p): self._names[p] for p in self._params}
        check_trainable_set(current, known)

    def _batch_size(self, per_sample_loss: torch.Tensor) -> int:
        if not isinstance(per_sample_loss, torch.Tensor) or per_sample_loss.ndim != 1:
            shape = tuple(per_sample_loss.shape) if isinstance(per_sample_loss, torch.Tensor) else "not a tensor"
            raise ValueError(f"{_LOSS_SHAPE_MESSAGE}; got shape {shape}")
        return per_sample_loss.shape[0]

    def _clip(
        self, per_sample_loss: torch.Tensor, *, accumulate: bool, weight: float = 1.0, probing: bool = False
    ) -> torch.Tensor:
        """Norms, and with ``accumulate`` the clipped sum into ``p.grad``; returns the norms ``[B]``. ``probing``
        (:meth:`probe`): the sum check runs whatever ``sum_check_every``, and every capture whose rows are not examples
        is named at once."""
        if not self._hooks.attached:
            raise RuntimeError("this PerSampleClipper was detached; create a new one to clip again")
        self._check_trainable_set()
        self.last_group_norms = None
        batch = self._batch_size(per_sample_loss)
        try:
            if self._past and batch != self._past_batch:
                raise ValueError(
                    f"the per-sample loss has {batch} samples but the past iterates were given {self._past_batch}: "
                    "add_past_iterate must see the same batch as the backward that follows it"
                )
            if batch == 0:
                if self._sharded:  # the other ranks would wait in the collectives of this backward
                    raise ValueError(
                        "an empty batch on an FSDP2-sharded model: every rank must run every step's forward and "
                        "backward; run the step on PrivacyEngine.stand_in_batch() and clip it with stand_in=True"
                    )
                return torch.zeros(0, dtype=self._norm_dtype, device=per_sample_loss.device)
            if not self._sharded and batch >= 2 and per_sample_loss.requires_grad:
                self._verify_rows(per_sample_loss, batch)
            check = probing or self._check_due()  # the probe is free: its sum check runs whatever sum_check_every
            scaled = weight * self._loss_scale  # float16: a fixed power of two, unscaled in the norms and factors
            captures, batch_grads = self._backward_pass(per_sample_loss, param_grads=check, weight=scaled)
            if probing:
                self._check_all_rows(captures, batch)
            kept: list[dict[nn.Parameter, list[Term]] | list[Capture]] | None = [] if accumulate else None
            reduced = check and reduced_precision(per_sample_loss, self._params, captures)
            with full_precision(per_sample_loss.device):
                totals, scales, checker = self._norms(per_sample_loss, captures, batch_grads, check, kept, reduced)
            del batch_grads
            totals, bound = reported_norms(totals, scales, self.norm, self._rounding_epsilon, self._loss_scale)
            group_norms = (totals.sqrt() if self.norm == 2 else totals).detach()  # [G, B]
            # over all parameters: sqrt(sum_g n_g^2) (groups are l2 only)
            norms = group_norms[0] if self.groups is None else totals.sum(0).sqrt().detach()
            self.last_group_norms = None if self.groups is None else group_norms
            keep = self._finite_samples(norms, per_sample_loss)  # on the device: read only by a due sum check
            all_finite = checker is None or bool(keep.all())  # the sum check's batch syncs anyway (scheduled)
            if checker is not None and all_finite:
                failures = checker.failures()
                if failures:
                    raise self._outside_use_error(failures)
            if checker is not None:
                self.sum_check_postponed = not all_finite
            self._count_check(all_finite)  # a check over non-finite samples says nothing: due again next batch
            if kept is not None:  # accumulate
                bound = unscale_linear(bound, self._loss_scale)
                # a dropped sample gets factor 0, non-finite entries are zeroed: always, so that no step reads keep
                factors = clip_factors(bound, self._group_bounds(), self.clipping_fn, self.automatic_clipping_gamma)
                factors = torch.where(keep, factors, 0)  # [G, B]
                with full_precision(per_sample_loss.device):
                    writable = output_gradients(captures + self._past)
                    self._add_clipped_sum(kept, batch, unscale_linear(factors, self._loss_scale), writable)
        finally:
            self._hooks.clear()
            self.discard_past_iterates()
        return norms

    def output_targets(self) -> dict[str, tuple[GradientEdge, torch.Size]]:
        """The autograd edges and shapes of the hooked outputs captured since the last clipped batch, keyed by a
        description (for :mod:`lightning_dp.checks.independence`).
        """
        targets: dict[str, tuple[GradientEdge, torch.Size]] = {}
        for capture in self._hooks.captures:
            name = f"output of module '{capture.name}'"
            calls = sum(key.startswith(name) for key in targets)
            targets[name + (f" (call {calls + 1})" if calls else "")] = (capture.edge, capture.output_shape)
        return targets

    def probe(self, per_sample_loss: torch.Tensor) -> None:
        """Clip a forward on example inputs without counting it (:mod:`lightning_dp.checks.attach_probe`): what the
        first clipped batch checks (the sum check, the fallback's reruns, folded rows) runs now, and again on the first
        training batch. Nothing is written to ``.grad``.

        Raises:
            MisplacedParametersError: parameters read outside their module's forward (every one with a gradient), or
                modules whose calls had rows that are not examples (every one).
            ValueError, UnsupportedModuleError: as :meth:`per_sample_norms`.
        """
        kept = (self._checked_batches, set(self._rows_verified), dict(self._hooks.confirmed_inputs), copy(self._slot))
        flags = (self._dropped, self.sum_check_postponed)
        try:
            self._clip(per_sample_loss, accumulate=False, probing=True)
        finally:
            self._checked_batches, self._rows_verified, self._hooks.confirmed_inputs, self._slot = kept
            self.dropped_nonfinite, self.sum_check_postponed = flags

    def discard_captures(self) -> None:
        """Forget what the hooks captured since the last clip (a forward that will not be clipped)."""
        self._hooks.clear()

    def per_sample_norms(self, per_sample_loss: torch.Tensor) -> torch.Tensor:
        """Per-sample gradient norms over all trainable parameters jointly, without touching ``p.grad``.

        Consumes the captures and the autograd graph of the forward that produced ``per_sample_loss``.

        Args:
            per_sample_loss: ``[B]``, one loss per sample.

        Returns:
            ``n_i``, detached, ``[B]``, float32 (float64 for float64 parameters); ``hutch``/``hutchpp``: the square root
            of an unbiased estimate of the squared norm; ``inf`` where the rounding bound ``nu_i`` overflows
            (docs/design.md section 4.10).

        Raises:
            ValueError: ``per_sample_loss`` not ``[B]`` or not requiring grad, a hooked layer with another row count
                than ``B`` (``B K``), a changed trainable set, or layers under reentrant activation checkpointing
                (non-reentrant checkpointing is exact: :mod:`~.recomputation`).
            UnsupportedModuleError: a gradient outside a hooked forward, found by the sum check.
            RuntimeError: after :meth:`detach`.
        """
        return self._clip(per_sample_loss, accumulate=False)

    def backward(self, per_sample_loss: torch.Tensor, *, weight: float = 1.0) -> torch.Tensor:
        """Add the clipped sum ``sum_i c_i grad(loss_i)`` into ``p.grad`` (docs/design.md sections 2.2 and 4.4).

        ``c_i = min(1, C / (nu_i + 1e-6))``, or ``C / (nu_i + gamma)`` with automatic clipping (per group with
        ``clipping_groups``); with past iterates ``grad(loss_i)`` is
        the per-sample momentum (section 7). ``p.grad`` accumulates over micro-batches; every trainable parameter
        without a ``.grad`` afterwards gets zeros. A sample whose loss or norm is not finite, or whose rounding bound
        ``nu_i`` overflows (its norm is then ``inf``; section 4.10), gets factor 0, silently (:attr:`dropped_nonfinite`;
        section 9.2).

        Args:
            per_sample_loss: ``[B]``, from the forward the hooks captured.
            weight: the current iterate's weight in the per-sample momentum (1 without momentum).

        Returns:
            The per-sample norms ``n_i`` before clipping, detached, ``[B]``.

        Raises:
            ValueError, UnsupportedModuleError, RuntimeError: as :meth:`per_sample_norms`.
        """
        norms = self._clip(per_sample_loss, accumulate=True, weight=weight)
        for param in self._params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        return norms

    def detach(self) -> None:
        """Remove all hooks and undo the module swaps."""
        self._hooks.remove()
        restore_modules(self._swaps)
        self._swaps = []
