"""Per-sample gradient clipping of a module through layer hooks (DESIGN.md sections 2 and 4).

Data flow: per-sample loss ``[B]`` -> first backward (output gradients captured by hooks, nothing written to
``.grad``) -> per-parameter norm contributions from the engine -> per-sample norms ``n_i`` -> clip factors
``c_i = min(1, C / (n_i + 1e-6))`` -> second backward of ``sum_i c_i loss_i`` that adds the clipped sum
``sum_i c_i grad(loss_i)`` into ``p.grad`` (Abadi et al. 2016, "Deep learning with differential privacy",
Algorithm 1; norms per Li et al. 2022 for ``ghost``).

Memory: the hooks keep each hooked layer's input (which autograd keeps anyway for these layers) until
:meth:`PerSampleClipper.backward`; engine memory is per group of captures sharing a parameter (see the engines).
Forward calls made with gradients enabled but never passed to :meth:`PerSampleClipper.backward` are kept until the
next call of it, then dropped (their outputs get no gradient, so they do not contribute). Activation checkpointing
is not supported.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase

from lightning_dp.clipping.engine import ENGINES, ClippingEngine
from lightning_dp.clipping.hooks import Capture, CaptureHooks
from lightning_dp.clipping.registry import LayerFamily, UnsupportedModuleError, find_layer_family
from lightning_dp.clipping.terms import Term

_EPS = 1e-6
#: Relative tolerance of the per-step sum check in float32/float64 arithmetic.
_VERIFY_RTOL = 1e-3
#: Relative tolerance under reduced-precision arithmetic (fp16/bf16 autocast or parameters, TF32 on CUDA).
_VERIFY_RTOL_REDUCED = 5e-2
_REDUCED_DTYPES = (torch.float16, torch.bfloat16)

_LOSS_SHAPE_MESSAGE = (
    "training_step must return a per-sample loss of shape [B] (use reduction='none' and reduce over tokens per sample)"
)


def _hooked_modules(module: nn.Module) -> dict[str, tuple[nn.Module, LayerFamily]]:
    """Validate ``module`` and return the modules to hook, ``{path: (module, family)}``.

    Raises:
        UnsupportedModuleError: for BatchNorm anywhere, any other norm layer with ``track_running_stats=True``
            (InstanceNorm), a supported layer in a sample-mixing configuration, or a trainable parameter owned by a
            module no registered family covers.
    """
    hooked: dict[str, tuple[nn.Module, LayerFamily]] = {}
    for path, sub in module.named_modules():
        where = path or "<root>"
        if isinstance(sub, _BatchNorm):
            raise UnsupportedModuleError(
                f"module '{where}' ({type(sub).__name__}) mixes samples through batch statistics, so per-sample "
                "gradients are undefined under differential privacy; replace it with nn.GroupNorm (or nn.LayerNorm)"
            )
        if isinstance(sub, _NormBase) and sub.track_running_stats:
            raise UnsupportedModuleError(
                f"module '{where}' ({type(sub).__name__}) has track_running_stats=True: its running_mean/running_var "
                "buffers are updated from the training data without noise and saved in the state_dict, which "
                "leaks private data; set track_running_stats=False, or use nn.GroupNorm / nn.LayerNorm"
            )
        trainable = [name for name, p in sub.named_parameters(recurse=False) if p.requires_grad]
        if not trainable:
            continue
        family = find_layer_family(sub)
        if family is None:
            names = ", ".join(f"'{path + '.' if path else ''}{name}'" for name in trainable)
            raise UnsupportedModuleError(
                f"trainable parameter(s) {names} of module '{where}' ({type(sub).__name__}) are not covered by any "
                "registered per-sample gradient layer; freeze them (requires_grad=False) or build the model from "
                "supported layers (Linear, Conv1d/2d, Embedding, LayerNorm, GroupNorm, RMSNorm, HF Conv1D)"
            )
        problem = family.check(sub) if family.check is not None else None
        if problem is not None:
            raise UnsupportedModuleError(f"module '{where}' ({type(sub).__name__}): {problem}")
        hooked[path] = (sub, family)
    return hooked


def _shared_parameter_groups(captures: list[Capture]) -> list[list[Capture]]:
    """Split captures into groups closed under sharing a parameter (a module called twice, tied weights).

    The terms of one group are formed, reduced to norm contributions and freed before the next group, so that peak
    memory is one group's terms (e.g. one convolution's unfolded input) rather than the whole model's.
    """
    groups: list[tuple[set[int], list[Capture]]] = []
    for capture in captures:
        params = {id(p) for p in capture.module.parameters(recurse=False) if p.requires_grad}
        joined = [group for group in groups if group[0] & params]
        for group in joined:
            groups.remove(group)
            params |= group[0]
        groups.append((params, [c for group in joined for c in group[1]] + [capture]))
    return [members for _, members in groups]


def _reduced_precision(per_sample_loss: torch.Tensor, params: list[nn.Parameter], captures: list[Capture]) -> bool:
    """Whether this step's gradients were computed in reduced precision (10 or fewer mantissa bits somewhere).

    True under fp16/bf16 autocast (active now, or seen in the captured activations, output gradients or loss), for
    fp16/bf16 parameters, and for float32 CUDA parameters when TF32 is allowed for matmuls, or for convolutions
    (cuDNN's default) and the model has a hooked convolution.
    """
    if per_sample_loss.dtype in _REDUCED_DTYPES or torch.is_autocast_enabled(per_sample_loss.device.type):
        return True
    if any(p.dtype in _REDUCED_DTYPES for p in params):
        return True
    if any(c.activation.dtype in _REDUCED_DTYPES or c.output_grad.dtype in _REDUCED_DTYPES for c in captures):
        return True
    if any(p.is_cuda and p.dtype == torch.float32 for p in params):
        if torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest":
            return True
        if torch.backends.cudnn.allow_tf32 and any(isinstance(c.module, nn.modules.conv._ConvNd) for c in captures):
            return True
    return False


class _SumCheck:
    """Per-step check that each parameter's per-sample gradients sum to its autograd gradient (see ``verify``).

    Parameter ``p`` fails when ``||ours_p - ref_p|| > rtol * (max(||ours_p||, ||ref_p||) + G / sqrt(k))``, with
    ``ours_p`` the batch sum of its per-sample terms, ``ref_p`` the gradient of ``sum_i loss_i`` from the first
    backward, ``G`` the joint norm of all ``max(||ours_p||, ||ref_p||)`` over the ``k`` checked parameters. The
    absolute floor ``rtol * G / sqrt(k)`` keeps parameters whose gradient is exactly zero in exact arithmetic (a
    conv bias before ``GroupNorm(C, C)``) from failing on rounding noise, while the mismatch tolerated over all
    parameters together stays below ``2 * rtol * G``. Norms stay on the device; :meth:`failures` syncs once.
    """

    def __init__(self, rtol: float) -> None:
        self.rtol = rtol
        self.params: list[nn.Parameter] = []
        self.diffs: list[torch.Tensor] = []
        self.scales: list[torch.Tensor] = []

    def add(self, param: nn.Parameter, terms: list[Term], grad: torch.Tensor | None) -> None:
        """Record the mismatch of one parameter (one batch sum of its terms, ``[*param.shape]``, freed here)."""
        ours = terms[0].batch_sum()
        for term in terms[1:]:
            ours = ours + term.batch_sum()
        reference = torch.zeros_like(ours) if grad is None else grad.to(ours.dtype)
        device = self.diffs[0].device if self.diffs else ours.device
        self.params.append(param)
        self.diffs.append((ours - reference).norm().float().to(device))
        self.scales.append(torch.maximum(ours.norm(), reference.norm()).float().to(device))

    def failures(self) -> list[tuple[nn.Parameter, float, float]]:
        """``(param, mismatch, tolerance)`` for each failing parameter (one host sync)."""
        if not self.params:
            return []
        diffs, scales = torch.stack(self.diffs), torch.stack(self.scales)
        floor = scales.square().sum().sqrt() / len(self.params) ** 0.5
        tolerance = self.rtol * (scales + floor)
        bad = diffs > tolerance
        if not bool(bad.any()):
            return []
        return [
            (param, diff, tol)
            for param, is_bad, diff, tol in zip(
                self.params, bad.tolist(), diffs.tolist(), tolerance.tolist(), strict=True
            )
            if is_bad
        ]


class PerSampleClipper:
    """Clips per-sample gradients of ``module`` and accumulates their sum into ``p.grad``.

    Hooks are attached in place (no wrapping; ``state_dict`` keys, HF ``generate()``/``save_pretrained`` and
    Lightning checkpoints are unaffected); :meth:`detach` removes them. Frozen parameters are ignored. The
    per-sample norm is taken over all trainable parameters jointly; a parameter used several times (tied weights,
    a module called twice) contributes the norm of its summed gradient. The set of trainable parameters is fixed
    at construction: freezing or unfreezing a parameter afterwards (e.g. Lightning's ``BackboneFinetuning``) makes
    the next :meth:`backward` raise.

    Args:
        module: the model; the first dimension of every hooked layer's input/output is the sample dimension.
        clipping: engine name, one of :attr:`CLIPPING_ENGINES`.
        max_grad_norm: clipping threshold ``C > 0`` (same units as the gradient norm).
        norm: 2 (l2 clipping, Gaussian and l2 mechanisms) or 1 (l1 clipping for the Laplace mechanism; ``flat``
            only).
        verify: on every non-empty batch, check that each trainable parameter's per-sample gradients sum to its
            gradient from the first backward (which the clipper computes anyway). Guards against a hooked
            parameter that is also used outside its layer's forward (functional reuse, an L2 penalty on the
            weights in the loss, ``nn.MultiheadAttention``'s ``out_proj``): that use is missing from the per-sample
            norms, so its gradient would reach ``p.grad`` unclipped. Tolerance: relative ``1e-3`` in float32/64,
            ``5e-2`` under reduced precision (fp16/bf16 autocast or parameters, TF32 on CUDA), plus an absolute
            floor tied to the model's gradient norm (see :class:`_SumCheck`). Cost per step: one batch-summed
            gradient per parameter from its terms (for a linear/conv weight one ``P x Q`` matmul over the ``B * T``
            rows, the FLOPs of its weight gradient; for materialised terms a sum over ``B``), one parameter-sized
            temporary at a time, and one host sync (measured: +15-18% per step for a 4-layer GPT-2, ``B=16``,
            ``T=64``, on CPU); the first-pass gradients are kept until each parameter is checked instead of being
            freed at once. A sum check cannot see an outside use whose per-sample
            contributions cancel over the batch. With ``verify=False`` only a parameter with no per-sample term at
            all is caught.

    Raises:
        ValueError: unknown engine, ``norm`` not in {1, 2}, ``norm=1`` with an engine other than ``flat``, or
            ``max_grad_norm <= 0``.
        UnsupportedModuleError: BatchNorm anywhere in ``module`` (trainable or not), another norm layer with
            ``track_running_stats=True`` (InstanceNorm), or a trainable parameter not covered by a registered
            layer (see :mod:`lightning_dp.clipping.registry`).
    """

    CLIPPING_ENGINES: tuple[str, ...] = ("flat", "ghost")

    def __init__(
        self,
        module: nn.Module,
        *,
        clipping: str = "flat",
        max_grad_norm: float,
        norm: int = 2,
        verify: bool = True,
    ) -> None:
        if clipping not in self.CLIPPING_ENGINES:
            raise ValueError(f"clipping must be one of {self.CLIPPING_ENGINES}, got {clipping!r}")
        if norm not in (1, 2):
            raise ValueError(f"norm must be 1 or 2, got {norm!r}")
        self._engine: ClippingEngine = ENGINES[clipping]
        if norm == 1 and not self._engine.supports_l1:
            raise ValueError(f"norm=1 (l1 clipping) requires clipping='flat', got clipping={clipping!r}")
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm!r}")
        self.module = module
        self.clipping = clipping
        self.max_grad_norm = float(max_grad_norm)
        self.norm = norm
        self.verify = verify
        hooked = _hooked_modules(module)
        self._names = {p: name for name, p in module.named_parameters() if p.requires_grad}
        self._params = list(self._names)
        self._trainable_ids = frozenset(id(p) for p in self._params)
        self._hooks = CaptureHooks(hooked)

    @property
    def trainable_parameters(self) -> list[nn.Parameter]:
        """The trainable parameters (``requires_grad`` at construction), each once, in ``module.parameters()`` order."""
        return list(self._params)

    def _check_trainable_set(self) -> None:
        """Raise if the parameters with ``requires_grad`` differ from those at construction (one pass over them).

        A parameter frozen since would make the second backward fail; one unfrozen (or added) since would get no
        clipped gradient, only noise, and is not hooked.

        Raises:
            ValueError: naming the parameters whose status changed.
        """
        current = {id(p): name for name, p in self.module.named_parameters() if p.requires_grad}
        if current.keys() == self._trainable_ids:
            return
        frozen = [f"'{self._names[p]}'" for p in self._params if id(p) not in current]
        unfrozen = [f"'{name}'" for key, name in current.items() if key not in self._trainable_ids]
        changes = []
        if frozen:
            changes.append(f"no longer trainable (frozen or removed): {', '.join(frozen)}")
        if unfrozen:
            changes.append(f"newly trainable (unfrozen or added): {', '.join(unfrozen)}")
        raise ValueError(
            f"the set of trainable parameters changed after the PerSampleClipper was created; {'; '.join(changes)}. "
            "DP training needs the trainable set fixed before fit: freeze/unfreeze parameters before creating the "
            "trainer (not in a callback such as BackboneFinetuning), or create a new clipper after the change"
        )

    def _batch_size(self, per_sample_loss: torch.Tensor) -> int:
        if not isinstance(per_sample_loss, torch.Tensor) or per_sample_loss.ndim != 1:
            shape = tuple(per_sample_loss.shape) if isinstance(per_sample_loss, torch.Tensor) else "not a tensor"
            raise ValueError(f"{_LOSS_SHAPE_MESSAGE}; got shape {shape}")
        return per_sample_loss.shape[0]

    def _first_pass(
        self, per_sample_loss: torch.Tensor
    ) -> tuple[list[Capture], dict[nn.Parameter, torch.Tensor | None]]:
        """Backward of ``sum_i loss_i`` capturing output gradients; returns the captures and the batch gradients.

        The parameter gradients (None for a parameter the loss does not reach) are returned, never written to
        ``.grad``; they serve the per-step sum check.

        Raises:
            UnsupportedModuleError: a parameter got a gradient but no hooked call of its module did.
        """
        if not per_sample_loss.requires_grad:
            raise ValueError("the per-sample loss does not require grad: it does not depend on trainable parameters")
        with self._hooks.capturing_grads():
            grads = torch.autograd.grad(per_sample_loss.sum(), self._params, retain_graph=True, allow_unused=True)
        captures = [c for c in self._hooks.captures if c.output_grad is not None]
        captured = {id(p) for c in captures for _, p in c.module.named_parameters(recurse=False)}
        for param, grad in zip(self._params, grads, strict=True):
            if grad is not None and id(param) not in captured:
                raise UnsupportedModuleError(
                    f"parameter '{self._names[param]}' received a gradient but no hooked call of its module did: it "
                    "is used outside its module's forward (e.g. functionally by a parent module, as "
                    "nn.MultiheadAttention does with out_proj); freeze it or use supported layers"
                )
        return captures, dict(zip(self._params, grads, strict=True))

    def _outside_use_error(self, failures: list[tuple[nn.Parameter, float, float]]) -> UnsupportedModuleError:
        details = ", ".join(
            f"'{self._names[p]}' (mismatch {diff:.3g} > tolerance {tol:.3g})" for p, diff, tol in failures
        )
        return UnsupportedModuleError(
            f"the per-sample gradients of parameter(s) {details} do not sum to their batch gradient: each is also "
            "used outside the forward of its module (e.g. functionally, as F.linear(x, module.weight), or in an L2 "
            "penalty added to the loss), and that use would reach .grad unclipped; route every use through the "
            "module, or freeze the parameter (requires_grad=False); for weight regularisation use the optimizer's "
            "weight_decay instead of a penalty term in the loss"
        )

    def _terms(self, captures: list[Capture], batch: int) -> dict[nn.Parameter, list[Term]]:
        """Group the terms of all captures by parameter (one term per use)."""
        terms: dict[nn.Parameter, list[Term]] = {}
        with self._hooks.suspended():
            for capture in captures:
                if capture.output_grad.shape[0] != batch:
                    raise ValueError(
                        f"module '{capture.name}' saw a batch dimension of {capture.output_grad.shape[0]} but the "
                        f"per-sample loss has {batch} samples; the first dimension of every layer input must be the "
                        "sample dimension (expand broadcast inputs to the batch)"
                    )
                for name, term in capture.family.terms(capture.module, capture.activation, capture.output_grad).items():
                    terms.setdefault(getattr(capture.module, name), []).append(term)
        return terms

    def per_sample_norms(self, per_sample_loss: torch.Tensor) -> torch.Tensor:
        """Per-sample gradient norms over all trainable parameters jointly, without touching ``p.grad``.

        Consumes the activations captured in the forward pass that produced ``per_sample_loss``.

        Args:
            per_sample_loss: ``[B]``, one loss per sample.

        Returns:
            ``n_i`` (l2 or l1 per ``norm``), detached, ``[B]``, float32 (float64 for float64 parameters).

        Raises:
            ValueError: ``per_sample_loss`` not of shape ``[B]``, not requiring grad, or a batch size different from
                the one the hooks captured; or the set of trainable parameters changed since construction.
            UnsupportedModuleError: a trainable parameter got a gradient outside its module's hooked forward: always
                checked when it has no hooked use or no per-sample term; on every non-empty batch by the sum check
                when ``verify`` (see the class docstring).
            RuntimeError: after :meth:`detach`.
        """
        if not self._hooks.attached:
            raise RuntimeError("this PerSampleClipper was detached; create a new one to clip again")
        self._check_trainable_set()
        batch = self._batch_size(per_sample_loss)
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in self._params) else torch.float32
        try:
            if batch == 0:
                return torch.zeros(0, dtype=dtype, device=per_sample_loss.device)
            captures, grads = self._first_pass(per_sample_loss)
            reached = {id(p) for p, g in grads.items() if g is not None}
            check = None
            if self.verify:
                reduced = _reduced_precision(per_sample_loss, self._params, captures)
                check = _SumCheck(_VERIFY_RTOL_REDUCED if reduced else _VERIFY_RTOL)
            else:
                grads = {}  # free the batch gradients now
            with_terms: set[int] = set()
            total = torch.zeros(batch, dtype=dtype, device=per_sample_loss.device)
            for group in _shared_parameter_groups(captures):
                for param, param_terms in self._terms(group, batch).items():
                    with_terms.add(id(param))
                    if check is not None:
                        check.add(param, param_terms, grads.pop(param, None))
                    total = total + self._engine.contribution(param_terms, self.norm).to(dtype)
            missing = [f"'{self._names[p]}'" for p in self._params if id(p) in reached and id(p) not in with_terms]
            if missing:
                raise UnsupportedModuleError(
                    f"parameter(s) {', '.join(missing)} received a gradient but their layer family produced no "
                    "per-sample gradient for them (e.g. an extra parameter of a subclass of a supported layer, used "
                    "outside its forward), so it would reach .grad unclipped; freeze them or use supported layers"
                )
            failures = check.failures() if check is not None else []
            if failures:
                raise self._outside_use_error(failures)
        finally:
            self._hooks.clear()
        return (total.sqrt() if self.norm == 2 else total).detach()

    def backward(self, per_sample_loss: torch.Tensor) -> torch.Tensor:
        """Add the clipped sum ``sum_i c_i grad(loss_i)``, ``c_i = min(1, C / (n_i + 1e-6))``, into ``p.grad``.

        ``p.grad`` may already hold an earlier micro-batch's clipped sum (gradient accumulation); it is created when
        None. With ``B == 0`` (empty Poisson batch) no backward runs and every trainable parameter without a
        ``.grad`` gets zeros. Trainable parameters the loss does not reach get zeros too, so that noise is added to
        every parameter downstream. Nothing is written to ``.grad`` when a check raises.

        Args:
            per_sample_loss: ``[B]``, one loss per sample, from the forward pass the hooks captured.

        Returns:
            The per-sample norms ``n_i`` before clipping, detached, ``[B]``.

        Raises:
            ValueError, UnsupportedModuleError, RuntimeError: as :meth:`per_sample_norms`.
        """
        norms = self.per_sample_norms(per_sample_loss)
        if norms.numel() > 0:
            factors = (self.max_grad_norm / (norms + _EPS)).clamp(max=1.0)
            with self._hooks.suspended():
                torch.autograd.backward(
                    (factors.to(per_sample_loss.dtype) * per_sample_loss).sum(), inputs=self._params
                )
        for param in self._params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        return norms

    def detach(self) -> None:
        """Remove all hooks; the module is left exactly as before the clipper was attached."""
        self._hooks.remove()
