"""DPTrainer with PEFT/LoRA: only the adapters are clipped and noised, their per-sample norms match a torch.func
oracle, and PeftModel.save_pretrained / generate work after training."""

from __future__ import annotations

import pytest

peft = pytest.importorskip("peft")

import torch  # noqa: E402
from clipping_helpers import oracle_grads, oracle_norms  # noqa: E402
from hf_helpers import TokenDataset, lora_llama, make_trainer, tiny_llama, trainable_snapshot  # noqa: E402

from lightning_dp.clipping import PerSampleClipper  # noqa: E402
from lightning_dp.hf.losses import token_cross_entropy  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def test_lora_adapters_move_frozen_weights_do_not(tmp_path) -> None:
    model = lora_llama()
    before = trainable_snapshot(model)
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    assert lora and all("lora_A" in n or "lora_B" in n for n in lora)
    trainer = make_trainer(model, tmp_path, args=dict(max_steps=3))
    trainer.train()
    assert trainer.privacy_engine.steps == 3
    # noise and clipping cover the adapters only
    assert trainer.privacy_engine.num_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    for name, param in model.named_parameters():
        moved = not torch.equal(before[name], param)
        assert moved == (name in lora), name
    # the PEFT model is left as it was: generate and PeftModel.save_pretrained / from_pretrained work
    assert not any(m._forward_hooks for m in model.modules())
    model.eval()
    out = model.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)
    model.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path / "adapter").eval()
    ids = torch.tensor([[4, 5, 6, 7]])
    assert torch.allclose(model(input_ids=ids).logits, reloaded(input_ids=ids).logits, atol=1e-6)


@pytest.mark.parametrize("clipping", ["flat", "ghost", "fgc", "mixed"])
def test_lora_per_sample_norms_match_torch_func_oracle(clipping: str, tmp_path) -> None:
    model = lora_llama(torch.float64)
    gen = torch.Generator().manual_seed(1)
    for param in model.parameters():  # LoRA B starts at zero: randomise the adapters
        if param.requires_grad:
            param.data = 0.3 * torch.randn(param.shape, generator=gen, dtype=param.dtype)
    dataset = TokenDataset(n=4, t=6)
    ids = dataset.ids
    labels = torch.stack([dataset[i]["labels"] for i in range(len(dataset))])

    def per_example_loss(forward, inputs):
        batch_ids, batch_labels = inputs
        return token_cross_entropy(forward(batch_ids).logits, batch_labels, "mean", shift=True)

    reference = oracle_norms(oracle_grads(model, (ids, labels), per_example_loss))
    trainer = make_trainer(model, tmp_path, dataset)
    clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=1.0)
    norms = clipper.per_sample_norms(trainer.compute_per_example_loss(model, {"input_ids": ids, "labels": labels}))
    clipper.detach()
    # LlamaRMSNorm normalises in float32 even for a float64 model: tolerance at float32 level.
    assert (reference > 0.1).all() and reference.std() > 0
    torch.testing.assert_close(norms, reference.to(norms.dtype), rtol=1e-4, atol=1e-6)
