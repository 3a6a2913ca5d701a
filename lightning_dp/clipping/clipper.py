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
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_dp.clipping.engine import ENGINES, ClippingEngine
from lightning_dp.clipping.hooks import Capture, CaptureHooks
from lightning_dp.clipping.registry import LayerFamily, UnsupportedModuleError, find_layer_family
from lightning_dp.clipping.terms import Term

_EPS = 1e-6
_VERIFY_RTOL = 0.05

_LOSS_SHAPE_MESSAGE = (
    "training_step must return a per-sample loss of shape [B] (use reduction='none' and reduce over tokens per sample)"
)


def _hooked_modules(module: nn.Module) -> dict[str, tuple[nn.Module, LayerFamily]]:
    """Validate ``module`` and return the modules to hook, ``{path: (module, family)}``.

    Raises:
        UnsupportedModuleError: for BatchNorm anywhere, a supported layer in a sample-mixing configuration, or a
            trainable parameter owned by a module no registered family covers.
    """
    hooked: dict[str, tuple[nn.Module, LayerFamily]] = {}
    for path, sub in module.named_modules():
        where = path or "<root>"
        if isinstance(sub, _BatchNorm):
            raise UnsupportedModuleError(
                f"module '{where}' ({type(sub).__name__}) mixes samples through batch statistics, so per-sample "
                "gradients are undefined under differential privacy; replace it with nn.GroupNorm (or nn.LayerNorm)"
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


class PerSampleClipper:
    """Clips per-sample gradients of ``module`` and accumulates their sum into ``p.grad``.

    Hooks are attached in place (no wrapping; ``state_dict`` keys, HF ``generate()``/``save_pretrained`` and
    Lightning checkpoints are unaffected); :meth:`detach` removes them. Frozen parameters are ignored. The
    per-sample norm is taken over all trainable parameters jointly; a parameter used several times (tied weights,
    a module called twice) contributes the norm of its summed gradient.

    Args:
        module: the model; the first dimension of every hooked layer's input/output is the sample dimension.
        clipping: engine name, one of :attr:`CLIPPING_ENGINES`.
        max_grad_norm: clipping threshold ``C > 0`` (same units as the gradient norm).
        norm: 2 (l2 clipping, Gaussian and l2 mechanisms) or 1 (l1 clipping for the Laplace mechanism; ``flat``
            only).
        verify_first_batch: on the first non-empty batch, check that the per-sample gradients sum to the autograd
            gradient of every trainable parameter (one extra ``P x Q`` matmul per layer, once); raises
            :class:`UnsupportedModuleError` when a parameter is also used outside its hooked module.

    Raises:
        ValueError: unknown engine, ``norm`` not in {1, 2}, ``norm=1`` with an engine other than ``flat``, or
            ``max_grad_norm <= 0``.
        UnsupportedModuleError: BatchNorm anywhere in ``module`` (trainable or not), or a trainable parameter not
            covered by a registered layer (see :mod:`lightning_dp.clipping.registry`).
    """

    CLIPPING_ENGINES: tuple[str, ...] = ("flat", "ghost")

    def __init__(
        self,
        module: nn.Module,
        *,
        clipping: str = "flat",
        max_grad_norm: float,
        norm: int = 2,
        verify_first_batch: bool = True,
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
        hooked = _hooked_modules(module)
        self._names = {p: name for name, p in module.named_parameters() if p.requires_grad}
        self._params = list(self._names)
        self._hooks = CaptureHooks(hooked)
        self._verify_pending = verify_first_batch

    @property
    def trainable_parameters(self) -> list[nn.Parameter]:
        """The trainable parameters (``requires_grad`` at construction), each once, in ``module.parameters()`` order."""
        return list(self._params)

    def _batch_size(self, per_sample_loss: torch.Tensor) -> int:
        if not isinstance(per_sample_loss, torch.Tensor) or per_sample_loss.ndim != 1:
            shape = tuple(per_sample_loss.shape) if isinstance(per_sample_loss, torch.Tensor) else "not a tensor"
            raise ValueError(f"{_LOSS_SHAPE_MESSAGE}; got shape {shape}")
        return per_sample_loss.shape[0]

    def _first_pass(
        self, per_sample_loss: torch.Tensor
    ) -> tuple[list[Capture], dict[nn.Parameter, torch.Tensor | None]]:
        """Backward of ``sum_i loss_i`` capturing output gradients; returns the captures and the batch gradients.

        The parameter gradients are returned, never written to ``.grad``; they serve the first-batch check only.
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

    def _verify(self, param: nn.Parameter, terms: list[Term], grad: torch.Tensor | None) -> None:
        """First-batch check: the per-sample gradients must sum to the autograd gradient of ``sum_i loss_i``.

        Catches a hooked parameter that is also used outside its module's forward (e.g. ``F.linear(x, m.weight)``),
        which would make the per-sample norms silently wrong. Tolerance: 5% of the gradient norm, loose enough for
        bf16 autocast, tight enough for a missing use.

        Raises:
            UnsupportedModuleError: when the two differ.
        """
        ours = terms[0].batch_sum()
        for term in terms[1:]:
            ours = ours + term.batch_sum()
        reference = torch.zeros_like(ours) if grad is None else grad.to(ours.dtype)
        scale = torch.maximum(reference.norm(), ours.norm())
        if (ours - reference).norm() > _VERIFY_RTOL * scale:
            raise UnsupportedModuleError(
                f"the per-sample gradients of parameter '{self._names[param]}' do not sum to its gradient: it is "
                "also used outside the forward of its module (e.g. functionally, as F.linear(x, module.weight)); "
                "route every use through the module, or freeze the parameter"
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
                the one the hooks captured.
            UnsupportedModuleError: a trainable parameter got a gradient outside its module's hooked forward
                (always checked when it has no hooked use; on the first batch, see ``verify_first_batch``).
            RuntimeError: after :meth:`detach`.
        """
        if not self._hooks.attached:
            raise RuntimeError("this PerSampleClipper was detached; create a new one to clip again")
        batch = self._batch_size(per_sample_loss)
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in self._params) else torch.float32
        try:
            if batch == 0:
                return torch.zeros(0, dtype=dtype, device=per_sample_loss.device)
            captures, grads = self._first_pass(per_sample_loss)
            total = torch.zeros(batch, dtype=dtype, device=per_sample_loss.device)
            for group in _shared_parameter_groups(captures):
                for param, param_terms in self._terms(group, batch).items():
                    if self._verify_pending:
                        self._verify(param, param_terms, grads[param])
                    total = total + self._engine.contribution(param_terms, self.norm).to(dtype)
            self._verify_pending = False
        finally:
            self._hooks.clear()
        return (total.sqrt() if self.norm == 2 else total).detach()

    def backward(self, per_sample_loss: torch.Tensor) -> torch.Tensor:
        """Add the clipped sum ``sum_i c_i grad(loss_i)``, ``c_i = min(1, C / (n_i + 1e-6))``, into ``p.grad``.

        ``p.grad`` may already hold an earlier micro-batch's clipped sum (gradient accumulation); it is created when
        None. With ``B == 0`` (empty Poisson batch) no backward runs and every trainable parameter without a
        ``.grad`` gets zeros. Trainable parameters the loss does not reach get zeros too, so that noise is added to
        every parameter downstream.

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
