"""Models people fine-tune, built from tiny configs (no weights): every trainable parameter is covered and per-sample
norms and clipped sums match the torch.func oracle on a batch of 3 (flat, ghost and mixed, the engine of the default
clipping="auto"; float64)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from clipping_helpers import Forward, LossFn, check_against_oracle, lm_loss, randomise
from torch import nn
from torch.func import functional_call, grad

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")

transformers = pytest.importorskip("transformers")

BATCH, SEQ, VOCAB = 3, 8, 50
TEXT = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def func_loop_oracle(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: LossFn) -> dict[str, torch.Tensor]:
    """Per-sample gradients ``{name: [B, *shape]}`` by ``torch.func.grad`` of ``functional_call``, one sample at a
    time (HF attention-mask code has data-dependent branches that ``vmap`` rejects)."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    fixed = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}

    def one(trainable: dict[str, torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
        return loss_fn(lambda *a: functional_call(model, {**trainable, **fixed}, a), xs).sum()

    per_sample = [grad(one)(params, *(x[i : i + 1] for x in inputs)) for i in range(inputs[0].shape[0])]
    return {n: torch.stack([g[n] for g in per_sample]) for n in params}


def logits_loss(forward: Forward, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A nonlinear per-sample loss ``[B]`` of the logits."""
    return forward(*inputs).logits.flatten(1).sin().sum(1)


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(2, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _padding_mask() -> torch.Tensor:
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -3:] = 0
    return mask


def bert() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    config = transformers.BertConfig(**TEXT, **NO_DROPOUT, max_position_embeddings=16, num_labels=3)
    return transformers.BertForSequenceClassification(config), (_ids(), _padding_mask())


def roberta() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    config = transformers.RobertaConfig(**TEXT, **NO_DROPOUT, max_position_embeddings=20, num_labels=3)
    return transformers.RobertaForSequenceClassification(config), (_ids(), _padding_mask())


def gpt2() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=16,
        n_layer=1,
        n_head=2,
        n_positions=16,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config), (_ids(),)


def llama() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    config = transformers.LlamaConfig(
        **TEXT, num_key_value_heads=1, max_position_embeddings=16, tie_word_embeddings=True
    )
    return transformers.LlamaForCausalLM(config), (_ids(),)


def hf_vit() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
    )
    images = torch.randn(BATCH, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    return transformers.ViTForImageClassification(config), (images,)


MODELS: dict[str, tuple[Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]], Callable]] = {
    "bert": (bert, logits_loss),
    "roberta": (roberta, logits_loss),
    "gpt2": (gpt2, lm_loss),
    "llama": (llama, lm_loss),
    "hf_vit": (hf_vit, logits_loss),
}


def _check_model(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: Callable, clipping: str) -> None:
    model = randomise(model, seed=3)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # Norm layers that normalise in float32 even for a float64 model (Llama's RMSNorm): float32-level atol.
    clipper = check_against_oracle(model, inputs, clipping, loss_fn=loss_fn, atol=1e-5, oracle=func_loop_oracle)
    assert {id(p) for p in clipper.trainable_parameters} == {id(p) for p in trainable}
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable), "every parameter gets a gradient"


@pytest.mark.parametrize("clipping", ["flat", "ghost", "mixed"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_matches_oracle(name: str, clipping: str) -> None:
    make, loss_fn = MODELS[name]
    model, inputs = make()
    _check_model(model, inputs, loss_fn, clipping)


def test_hf_vit_with_dropout_after_position_embedding_rejected() -> None:
    from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError

    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        hidden_dropout_prob=0.1,
    )
    with pytest.raises(UnsupportedModuleError, match="hidden_dropout_prob=0.0"):
        PerSampleClipper(transformers.ViTModel(config, add_pooling_layer=False), max_grad_norm=1.0)


def _torchvision_vit() -> nn.Module:
    vision_transformer = pytest.importorskip("torchvision.models.vision_transformer")
    return vision_transformer.VisionTransformer(
        image_size=32, patch_size=16, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=3
    )


def _logits(forward: Forward, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return forward(*inputs).flatten(1).sin().sum(1)


@pytest.mark.parametrize("clipping", ["flat", "ghost", "mixed"])
def test_torchvision_vit_matches_oracle(clipping: str) -> None:
    model = _torchvision_vit()
    images = torch.randn(BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    _check_model(model, (images.double(),), _logits, clipping)


def test_torchvision_vit_swap_keeps_state_dict_and_outputs() -> None:
    from lightning_dp.clipping import PerSampleClipper

    torch.manual_seed(0)
    model = _torchvision_vit().eval()
    vit_type = type(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    images = torch.randn(BATCH, 3, 32, 32)
    with torch.no_grad():
        before = model(images)
    clipper = PerSampleClipper(model, clipping="ghost", max_grad_norm=1.0)
    assert isinstance(model, vit_type) and type(model) is not vit_type
    assert dict(model.named_parameters()) == params and list(model.state_dict()) == list(state)
    with torch.no_grad():
        torch.testing.assert_close(model(images), before, rtol=1e-5, atol=1e-6)
    model.load_state_dict(state)
    clipper.detach()
    assert type(model) is vit_type and list(model.state_dict()) == list(state)
