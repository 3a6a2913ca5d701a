"""Shared oracles and tiny models of the clipping tests: per-sample gradients through ``torch.func`` (the oracle every
exact engine is checked against), the check of an engine's norms and clipped sum against it, float64 random models
and inputs, and the tied-weight models several test files use."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from lightning_dp.clipping import PerSampleClipper

ENGINES = ("flat", "ghost", "fgc", "mixed")
RTOL = 1e-4

Forward = Callable[..., torch.Tensor]
LossFn = Callable[[Forward, tuple[torch.Tensor, ...]], torch.Tensor]


def sin_loss(forward: Forward, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A nonlinear per-sample loss ``[B]`` of the model output."""
    return forward(*inputs).flatten(1).sin().sum(1)


def oracle_grads(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: LossFn = sin_loss
) -> dict[str, torch.Tensor]:
    """Per-sample gradients ``{name: [B, *shape]}`` of the trainable parameters via vmap(grad(functional_call))."""
    trainable = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    fixed = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    fixed.update(dict(model.named_buffers()))

    def one(params: dict[str, torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
        def forward(*batched: torch.Tensor) -> torch.Tensor:
            return functional_call(model, {**params, **fixed}, batched)

        return loss_fn(forward, tuple(x.unsqueeze(0) for x in xs)).sum()

    return vmap(grad(one), in_dims=(None, *([0] * len(inputs))))(trainable, *inputs)


def oracle_norms(grads: dict[str, torch.Tensor], norm: int = 2) -> torch.Tensor:
    flat = torch.cat([g.flatten(1) for g in grads.values()], dim=1)
    return flat.abs().sum(1) if norm == 1 else flat.norm(dim=1)


def check_against_oracle(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    clipping: str,
    loss_fn: LossFn = sin_loss,
    norm: int = 2,
    atol: float = 1e-10,
    oracle: Callable[[nn.Module, tuple[torch.Tensor, ...], LossFn], dict[str, torch.Tensor]] | None = None,
    attach: Callable[[PerSampleClipper], object] | None = None,
) -> PerSampleClipper:
    """Per-sample norms and the clipped sum (threshold = median norm, so some samples are clipped) vs the oracle
    (``oracle_grads`` unless another is given); ``attach`` is called on the new clipper first (the attach probe)."""
    grads = (oracle or oracle_grads)(model, inputs, loss_fn)
    ref_norms = oracle_norms(grads, norm)
    max_grad_norm = ref_norms.median().item()
    factors = (max_grad_norm / (ref_norms + 1e-6)).clamp(max=1.0)
    clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=max_grad_norm, norm=norm, sum_check_every=1)
    if attach is not None:
        attach(clipper)

    norms = clipper.per_sample_norms(loss_fn(model, inputs))
    torch.testing.assert_close(norms, ref_norms, rtol=RTOL, atol=1e-10)
    assert all(p.grad is None for p in model.parameters()), "per_sample_norms must not touch .grad"

    returned = clipper.backward(loss_fn(model, inputs))
    torch.testing.assert_close(returned, ref_norms, rtol=RTOL, atol=1e-10)
    named = dict(model.named_parameters())
    for name, per_sample in grads.items():
        expected = torch.einsum("b,b...->...", factors, per_sample)
        torch.testing.assert_close(named[name].grad, expected, rtol=RTOL, atol=atol, msg=name)
    return clipper


def check_against_batch_graph(
    model: nn.Module,
    per_sample_loss: Callable[[], torch.Tensor],
    clipping: str,
    attach: Callable[[PerSampleClipper], object] | None = None,
) -> PerSampleClipper:
    """Per-sample norms and the clipped sum (threshold = median norm) vs each example's loss differentiated through
    the batch's own graph: the oracle of a per-sample model whatever its randomness (the same dropout masks).
    ``per_sample_loss()`` runs the forward (after ``attach``, called on the new clipper)."""
    clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=1.0, sum_check_every=1)
    if attach is not None:
        attach(clipper)
    loss = per_sample_loss()
    named = {name: p for name, p in model.named_parameters() if p.requires_grad}
    rows = [
        torch.autograd.grad(loss[i], list(named.values()), retain_graph=True, materialize_grads=True)
        for i in range(loss.shape[0])
    ]
    grads = {name: torch.stack([row[k] for row in rows]) for k, name in enumerate(named)}
    norms = torch.stack([g.flatten(1).square().sum(1) for g in grads.values()]).sum(0).sqrt()
    assert (norms > 0).all()
    clipper.max_grad_norm = bound = norms.median().item()
    torch.testing.assert_close(clipper.backward(loss), norms, rtol=RTOL, atol=1e-12)
    factors = (bound / (norms + 1e-6)).clamp(max=1.0)
    for name, per_example in grads.items():
        torch.testing.assert_close(named[name].grad, torch.einsum("b,b...->...", factors, per_example), msg=name)
    return clipper


def randomise(model: nn.Module, seed: int = 0) -> nn.Module:
    """float64 and random parameters (norm weights away from 1, biases away from 0)."""
    model = model.double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return model


def rand(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


#: a batch of ``B`` token sequences for :class:`TiedLM`.
B = 4
IDS = torch.tensor([[1, 2, 1, 0, 3, 1], [0, 0, 5, 5, 6, 2], [4, 4, 4, 4, 4, 4], [6, 5, 3, 2, 1, 0]])


class TiedLM(nn.Module):
    """Embedding and output projection sharing one weight (as GPT-2's ``lm_head``/``wte``), plus positions."""

    def __init__(self, vocab: int = 7, dim: int = 4, seq: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)  # broadcast [1, T]
        h = self.emb(ids) + self.pos(positions)
        return self.out(torch.tanh(self.mix(h)))


def lm_loss(forward: Forward, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Per-sample mean next-token cross-entropy ``[B]``."""
    (ids,) = inputs
    logits = forward(ids).logits[:, :-1]
    tokens = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return tokens.mean(1)


class FunctionalReuse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + F.linear(x.flip(-1), self.lin.weight)


# ------------------------------------------------------------------------------------------- group-wise clipping
VOCAB, DIM = 7, 5


class TiedModel(nn.Module):
    """Embedding -> Conv1d -> LayerNorm -> Linear head whose weight is the embedding's (one parameter, two names)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.conv = nn.Conv1d(DIM, DIM, 3, padding=1)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.emb(ids).transpose(1, 2)).transpose(1, 2).tanh()
        return self.head(self.norm(h))


#: the group of each parameter of :class:`TiedModel` (``named_parameters()`` names) under ``per_layer``, by hand.
PER_LAYER = {"emb.weight": 0, "conv.weight": 1, "conv.bias": 1, "norm.weight": 2, "norm.bias": 2, "head.bias": 3}


def group_norms(grads: dict[str, torch.Tensor], group_of: dict[str, int]) -> torch.Tensor:
    """``[G, B]`` the norm of each group's part of each per-sample gradient."""
    count = 1 + max(group_of.values())
    return torch.stack(
        [torch.cat([g.flatten(1) for n, g in grads.items() if group_of[n] == k], 1).norm(dim=1) for k in range(count)]
    )


def expected_sum(grads, group_of, bounds, keep=None, gamma: float | None = None) -> dict[str, torch.Tensor]:
    """``sum_i c_gi g_i`` per parameter, ``c_gi = min(1, C_g / (n_gi + 1e-6))``, or with ``gamma`` automatic clipping's
    ``C_g / (n_gi + gamma)`` (zero for a sample not kept)."""
    norms = group_norms(grads, group_of)
    if gamma is None:
        factors = torch.stack([(bound / (n + 1e-6)).clamp(max=1.0) for bound, n in zip(bounds, norms, strict=True)])
    else:
        factors = torch.stack([bound / (n + gamma) for bound, n in zip(bounds, norms, strict=True)])
    if keep is not None:
        factors = factors * keep
    return {n: torch.einsum("b,b...->...", factors[group_of[n]], g.nan_to_num()) for n, g in grads.items()}


def noise_of_one_step(engine) -> torch.Tensor:
    """The noise one SGD step (lr 1) of a prepared ``PrivacyEngine`` adds on zero clipped sums, flattened over its
    model's parameters, divided by the engine's expected batch ``q N`` (multiply by it to get the noise drawn)."""
    model = engine.clipper.module
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    optimizer = engine.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return before - torch.cat([p.detach().flatten() for p in model.parameters()])


@contextlib.contextmanager
def flush_to_zero(enabled: bool) -> Iterator[None]:
    """``torch.set_flush_denormal(enabled)`` on one intra-op thread (the flag is per thread), restored after; skips the
    test on a CPU without it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if not torch.set_flush_denormal(enabled) and enabled:
        torch.set_num_threads(threads)
        pytest.skip("this CPU cannot flush subnormal numbers to zero")
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
