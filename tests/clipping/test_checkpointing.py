"""Per-sample clipping under activation checkpointing: non-reentrant checkpointing is exact, each hooked call's input
is taken from the recomputed forward once (the forward keeps none), reentrant checkpointing is refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import checkpoint
from transformers.pytorch_utils import Conv1D

from lightning_dp.clipping import PerSampleClipper
from lightning_dp.clipping.hooks import Capture
from tests.clipping.test_random_replay import DropPath, DroppedScale
from tests.clipping_helpers import (
    ENGINES,
    check_against_batch_graph,
    check_against_oracle,
    oracle_grads,
    rand,
    randomise,
)
from tests.hf_helpers import VOCAB, lora_llama, tiny_gpt2, tiny_llama


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the same Linear used twice: two captures, two uses
        return x + self.down(torch.tanh(self.up(self.norm(x)))) + 0.5 * self.down(self.up(x).relu())


class Stack(nn.Module):
    """A Linear, then three blocks, each checkpointed (``mode``: ``"checkpoint"``, ``"reentrant"``), offloaded
    (``"offload"``) or neither (None)."""

    def __init__(self, dim: int = 4, mode: str | None = "checkpoint") -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(3)])
        self.head = nn.Linear(dim, 3)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            if self.mode in ("checkpoint", "reentrant") and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=self.mode == "reentrant")
            elif self.mode == "offload" and torch.is_grad_enabled():
                with save_on_cpu():
                    x = block(x)
            else:
                x = block(x)
        return self.head(x)


def _counting(model: nn.Module) -> list[str]:
    calls: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, Conv1D)):
            module.register_forward_hook(lambda *_, name=name: calls.append(name))
    return calls


@pytest.mark.parametrize("clipping", ENGINES)
def test_checkpointed_blocks_match_the_oracle_from_the_recomputed_forward(clipping) -> None:
    torch.manual_seed(0)
    model = Stack().double()
    x = torch.randn(5, 6, 4, dtype=torch.float64)
    plain = copy.deepcopy(model)
    plain.mode = None
    calls = _counting(model)
    check_against_oracle(model, (x,), clipping, oracle=lambda m, i, f: oracle_grads(plain, i, f))
    # two clipped forwards, each block recomputed once in each backward: its first Linear ran twice per use
    # (the recomputation stops at the last tensor saved, before the later forward hooks of its last call)
    assert [calls.count(f"blocks.{i}.up") for i in range(3)] == [8, 8, 8]
    assert calls.count("head") == calls.count("embed") == 2


def test_the_forward_keeps_no_checkpointed_input_and_each_use_is_captured_once(monkeypatch) -> None:
    torch.manual_seed(0)
    model = Stack().double()
    plain = copy.deepcopy(model)
    plain.mode = None
    x = torch.randn(4, 3, 4, dtype=torch.float64)
    clipper = PerSampleClipper(model, clipping="ghost", max_grad_norm=1.0)
    reference = PerSampleClipper(plain, clipping="ghost", max_grad_norm=1.0)
    handed: list[str] = []
    take = Capture.recomputed
    monkeypatch.setattr(Capture, "recomputed", lambda self, t: (handed.append(self.name), take(self, t))[1])
    loss, plain_loss = model(x).sum((1, 2)), plain(x).sum((1, 2))
    captures = list(clipper._hooks.captures)
    names = [c.name for c in reference._hooks.captures]
    assert [c.name for c in captures] == names
    kept = [c.name for c in captures if c.activation is not None]
    assert kept == ["embed", "head"]  # the blocks' inputs are not kept
    torch.testing.assert_close(clipper.per_sample_norms(loss), reference.per_sample_norms(plain_loss))
    assert sorted(handed) == sorted(name for name in names if name not in kept)  # each use's input handed over once
    assert all(c.activation is not None for c in captures)


def test_offloaded_activations_are_exact() -> None:
    torch.manual_seed(0)
    model = Stack(mode="offload").double()
    plain = copy.deepcopy(model)
    plain.mode = None
    x = torch.randn(4, 3, 4, dtype=torch.float64)
    check_against_oracle(model, (x,), "mixed", oracle=lambda m, i, f: oracle_grads(plain, i, f))


def test_reentrant_checkpointing_is_refused_naming_use_reentrant_false() -> None:
    model = Stack(mode="reentrant").double()
    clipper = PerSampleClipper(model, clipping="mixed", max_grad_norm=1.0)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        clipper.backward(model(torch.randn(3, 2, 4, dtype=torch.float64)).sum((1, 2)))


def _token_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(len(ids), -1).mean(1)


@pytest.mark.parametrize(
    ("build", "clipping"),
    [
        (lambda: tiny_llama(layers=2), "mixed"),
        (lambda: tiny_llama(layers=2), "ghost"),
        (tiny_gpt2, "flat"),  # with GPT-2's dropout: the recomputation replays the forward's masks
        (lora_llama, "mixed"),
    ],
    ids=["llama-mixed", "llama-ghost", "gpt2-dropout-flat", "llama-lora-mixed"],
)
def test_hf_gradient_checkpointing_is_exact_and_recomputes(build, clipping) -> None:
    model = build().double().train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    calls = _counting(model)
    check_against_batch_graph(model, lambda: _token_loss(model, ids), clipping)
    linears = sum(isinstance(m, (nn.Linear, Conv1D)) for m in model.modules())
    # the forward once, then recomputations in the oracle's four backward passes and in the clipper's
    assert len(calls) > 2 * linears


class Checkpointed(nn.Module):
    """Runs ``inner`` under non-reentrant checkpointing."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.parametrize("clipping", ["flat", "ghost"])
def test_fallback_modules_with_dropout_in_a_checkpointed_region_are_exact(clipping) -> None:
    inner = nn.Sequential(nn.Linear(4, 6), DroppedScale(6), DropPath(6), nn.Linear(6, 2))
    model = randomise(nn.Sequential(nn.Linear(4, 4), Checkpointed(inner))).train()
    x = rand(5, 3, 4)

    def loss() -> torch.Tensor:
        torch.manual_seed(7)
        return torch.sin(model(x)).flatten(1).sum(1)

    check_against_batch_graph(model, loss, clipping)


class ModifiedAfterUse(nn.Module):
    """A checkpointed region that modifies ``b``'s input in place after ``b`` ran."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def region(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        out = self.b(h)
        h.mul_(3.0)
        return (out + h).tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.region, x, use_reentrant=False))


def test_an_input_modified_in_place_after_its_call_is_refused_as_without_checkpointing() -> None:
    model = ModifiedAfterUse().double()
    clipper = PerSampleClipper(model, clipping="ghost", max_grad_norm=1.0)
    with pytest.raises(ValueError, match="input of module 'b' was modified in place"):
        clipper.per_sample_norms(model(torch.randn(5, 4, dtype=torch.float64)).sin().sum(1))


class KeepingRouter(nn.Module):
    """A top-1 router (the router family's interface) that also keeps its logits on an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.kept = F.linear(x, self.weight)
        scores, indices = self.kept.softmax(-1).topk(1, dim=-1)
        return self.kept, scores, indices


class ReadsTheKeptLogits(nn.Module):
    """Checkpoints a region that calls the router and returns the logits it kept, none of its call's outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.router = KeepingRouter()

    def region(self, x: torch.Tensor) -> torch.Tensor:
        self.router(x)
        return self.router.kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.region, x, use_reentrant=False)


def test_an_output_gradient_that_bypasses_the_calls_outputs_is_refused_naming_the_module() -> None:
    model = ReadsTheKeptLogits().double()
    clipper = PerSampleClipper(model, clipping="mixed", max_grad_norm=1.0)
    with pytest.raises(ValueError, match="module 'router' .* passed through none of its call's outputs"):
        clipper.per_sample_norms(model(torch.randn(5, 4, dtype=torch.float64)).sin().sum(1))


class PositionsTwice(nn.Module):
    """A checkpointed region calling a position embedding on broadcast positions ``[1, T]`` twice: first before any
    other hooked call (not expanded), then after a linear layer (expanded to the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin = nn.Embedding(3, 4), nn.Linear(4, 4)

    def region(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        first = self.emb(positions)
        return self.lin(x) + first + self.emb(positions)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.region, x, positions, use_reentrant=False)


def test_a_module_whose_calls_expand_differently_in_a_checkpointed_region_is_refused_naming_it() -> None:
    model = PositionsTwice().double()
    clipper = PerSampleClipper(model, clipping="mixed", max_grad_norm=1.0)
    x, positions = torch.randn(4, 3, 4, dtype=torch.float64), torch.arange(3)[None]
    with pytest.raises(ValueError, match=r"module 'emb' \(Embedding\) expands a broadcast .* to \[0, 4\] rows"):
        clipper.per_sample_norms(model(x, positions).sin().sum((1, 2)))
