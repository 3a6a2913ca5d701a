"""Parameters misplaced at their own module (read outside its forward, or used on rows that are not examples) are
served at attach by the exact fallback on the smallest enclosing module that is per-sample (checks/enclosing.py):
DeBERTa-v2/v3 in full fine-tuning, dropout included, exact against each example's loss through the batch's graph and
trained by DPTrainer; the units found, merged when nested; refusals where no enclosing module is per-sample."""

from __future__ import annotations

import pytest
import torch
from clipping_helpers import check_against_batch_graph, rand, randomise
from torch import nn

from lightning_dp.checks.attach_probe import probe_at_attach
from lightning_dp.checks.enclosing import UseTracker, enclosing_units
from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError
from lightning_dp.clipping.layers.registry import MisplacedParametersError
from lightning_dp.clipping.validation import hooked_modules

transformers = pytest.importorskip("transformers")

#: DeBERTa-v2's per-layer modules on the relative embeddings: enclosed by the encoder with the embeddings' table.
_POSITIONS = tuple(f"layer.{i}.attention.self.pos_{kind}_proj" for i in range(2) for kind in ("key", "query"))


def _deberta(**overrides: object) -> nn.Module:
    settings: dict[str, object] = dict(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        position_buckets=8,
        max_relative_positions=16,
        norm_rel_ebd="layer_norm",
    )
    config = transformers.DebertaV2Config(**{**settings, **overrides})  # dropout: the config's default, 0.1
    torch.manual_seed(0)
    return transformers.DebertaV2ForSequenceClassification(config)


def _inputs(batch: int = 4) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 50, (batch, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _check_deberta(model: nn.Module, clipping: str) -> PerSampleClipper:
    model = randomise(model).train()
    inputs = _inputs()

    def loss() -> torch.Tensor:
        torch.manual_seed(5)
        return torch.sin(model(**inputs).logits).sum(1)

    return check_against_batch_graph(model, loss, clipping, lambda clipper: probe_at_attach(model, clipper))


@pytest.mark.parametrize("clipping", ["flat", "ghost", "mixed"])
def test_deberta_v2_with_dropout_is_exact_by_the_encoder(clipping: str) -> None:
    clipper = _check_deberta(_deberta(), clipping)
    assert clipper.enclosing == {"deberta.encoder": tuple(sorted(("LayerNorm", "rel_embeddings", *_POSITIONS)))}


def test_deberta_v3_sharing_attention_keys_is_exact() -> None:
    """``share_att_key``: the query and key projections also run on the relative embeddings ``[1, 2k, d]``."""
    clipper = _check_deberta(_deberta(share_att_key=True, norm_rel_ebd="none"), "mixed")
    (enclosed,) = clipper.enclosing.values()
    assert "rel_embeddings" in enclosed and "layer.1.attention.self.query_proj" in enclosed


def test_deberta_trains_two_dp_steps_in_dp_trainer(tmp_path) -> None:
    from hf_helpers import TokenDataset, make_trainer

    from lightning_dp.hf import PrivacyArguments

    model = _deberta()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    privacy = PrivacyArguments(noise_multiplier=1.0, dp_seed=0)
    trainer = make_trainer(model, tmp_path, TokenDataset(task="cls"), privacy=privacy, args={"max_steps": 2})
    trainer.train()
    moved = [name for name, p in model.named_parameters() if not torch.equal(p, before[name])]
    assert "deberta.encoder.rel_embeddings.weight" in moved and all(torch.isfinite(p).all() for p in model.parameters())


class Reads(nn.Module):
    """``inner`` reads ``table.weight`` (a grandchild of the root) outside its forward; the root reads ``scale``'s
    weight (a child) outside its forward: two units, nested, merged into the root."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.scale = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) @ self.scale.weight


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.table = nn.Embedding(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x) + self.table.weight[:1])


def test_nested_units_merge_into_the_outer_one() -> None:
    model = randomise(Reads())
    x = rand(3, 4)
    tracker = UseTracker(model)
    with tracker.tracking():
        model(x)
    inner = MisplacedParametersError("", parameters=("inner.table.weight",))
    assert enclosing_units(model, inner, tracker, 3, {}) == {"inner": ("table",)}
    both = MisplacedParametersError("", parameters=("scale.weight",))
    assert enclosing_units(model, both, tracker, 3, {"inner": ("table",)}) == {"": ("inner.table", "scale")}
    model.example_input_array = x
    check_against_batch_graph(model, lambda: torch.sin(model(x)).sum(1), "ghost", lambda c: probe_at_attach(model, c))


def test_the_probe_encloses_with_the_sum_check_off() -> None:
    model = randomise(Reads())
    model.example_input_array = rand(3, 4)
    clipper = PerSampleClipper(model, max_grad_norm=1.0, sum_check_every=None)
    assert probe_at_attach(model, clipper) and clipper.enclosing == {"": ("inner.table", "scale")}


class CallsBorrowed(nn.Module):
    """``user`` calls a module registered under ``owner`` (a reference it holds) on rows that are not examples: the
    unit must run that call and hold the module, so it is the root, not ``owner``."""

    def __init__(self) -> None:
        super().__init__()
        self.owner = nn.ModuleDict({"m": nn.Linear(4, 4), "lin": nn.Linear(4, 4)})
        self.user = nn.Linear(4, 4)
        self.positions = nn.Parameter(torch.randn(5, 4))
        self.example_input_array = torch.randn(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.owner["m"](self.positions).mean(0)  # called from the root on [5, 4]
        return self.user(torch.tanh(self.owner["lin"](x))) + bias


def test_the_unit_runs_every_use_not_only_holds_the_module() -> None:
    model = randomise(CallsBorrowed())
    model.example_input_array = rand(3, 4)
    clipper = check_against_batch_graph(
        model, lambda: torch.sin(model(rand(5, 4))).sum(1), "flat", lambda c: probe_at_attach(model, c)
    )
    assert clipper.enclosing == {"": ("owner.m",)}


def test_an_enclosed_swapped_module_is_varied_once() -> None:
    """A position embedding computing its ids (swapped: a proxy registers its weight again) called on ``[T]`` ids:
    enclosed by the encoder, whose rerun varies the weight under one name."""

    class Positions(nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(torch.arange(ids.shape[1], device=ids.device))  # [T]: no batch dimension

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(10, 4)
            self.positions = Positions(6, 4)
            self.out = nn.Linear(4, 2)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.out(torch.tanh(self.tokens(ids) + self.positions(ids))).sum(1)

    model = randomise(Encoder())
    ids = torch.randint(0, 10, (5, 6), generator=torch.Generator().manual_seed(0))
    model.example_input_array = ids[:3]
    clipper = check_against_batch_graph(
        model, lambda: torch.sin(model(ids)).sum(1), "mixed", lambda c: probe_at_attach(model, c)
    )
    (enclosed,) = clipper.enclosing.values()
    assert "positions" in enclosed


def test_no_enclosing_module_with_a_row_per_example_keeps_the_refusal() -> None:
    class Pooled(nn.Module):  # the root returns one row for the batch: nothing encloses the use per example
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.example_input_array = torch.randn(3, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x @ self.proj.weight).sum(0, keepdim=True).expand(x.shape[0], 4)

    model = Pooled()
    with pytest.raises(UnsupportedModuleError, match=r"'proj\.weight' received a gradient but no hooked call"):
        probe_at_attach(model, PerSampleClipper(model, max_grad_norm=1.0))


def test_an_enclosing_module_that_mixes_samples_is_refused_naming_both() -> None:
    class Centred(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.example_input_array = torch.randn(3, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x - x.mean(0)) @ self.proj.weight

    model = Centred()
    with pytest.raises(UnsupportedModuleError, match=r"'proj\.weight'.*cannot serve it either.*not per-sample"):
        probe_at_attach(model, PerSampleClipper(model, max_grad_norm=1.0))


def test_an_fsdp2_model_cannot_enclose() -> None:
    with pytest.raises(UnsupportedModuleError, match="FSDP2-sharded model; train it unsharded"):
        hooked_modules(Reads(), sharded=True, enclosing={"": ("scale",)})


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_swin_with_stochastic_depth_and_dropout_is_exact_by_its_layers(attention: str) -> None:
    """Swin's window attention folds windows into rows: its output projections are enclosed by their layer, whose
    rerun replays the drop path and dropout of the call (attention dropout under eager attention; the rerun computes
    SDPA in its reference maths)."""
    from hf_helpers import tiny_swin

    torch.manual_seed(0)
    dropout = {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1 if attention == "eager" else 0.0}
    model = randomise(tiny_swin(**dropout, drop_path_rate=0.2, attn_implementation=attention)).train()
    pixels = rand(4, 3, 16, 16)

    def loss() -> torch.Tensor:
        torch.manual_seed(5)
        return torch.sin(model(pixel_values=pixels).logits).sum(1)

    clipper = check_against_batch_graph(model, loss, "mixed", lambda c: probe_at_attach(model, c))
    # the second stage is one window: its rows are the examples'
    assert clipper.enclosing == {"swin.encoder.layers.0.blocks.0": ("attention.o_proj",)}


def test_fused_attention_dropout_in_an_enclosing_module_is_refused_with_the_route() -> None:
    from hf_helpers import tiny_swin

    model = tiny_swin(attention_probs_dropout_prob=0.1)
    with pytest.raises(
        UnsupportedModuleError, match=r"blocks\.0' \(SwinLayer\) runs scaled_dot_product_attention.*'eager'"
    ):
        probe_at_attach(model, PerSampleClipper(model, max_grad_norm=1.0))
