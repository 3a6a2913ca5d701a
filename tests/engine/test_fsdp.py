"""The engine on FSDP2-sharded models (lightning_dp/runtime/sharding.py, docs/design.md section 8.1), 2 CPU processes
over gloo, started with ``torch.multiprocessing.spawn``.

A tiny Llama (float64, tied embeddings, a 1001-token vocabulary so that dim 0 of the embedding splits 501 / 500) is
sharded with ``fully_shard`` on each decoder layer and on the root. Checked:

- norms: the per-sample norms on each rank equal a brute-force oracle (one autograd gradient per example on an
  unsharded copy), for every exact engine with book-keeping, also on a LoRA model;
- update: with zero noise, the gathered parameters after 3 steps equal single-process training on the union of the
  ranks' examples;
- noise: on a sharded weight with a zero clipped sum, every coordinate gets one draw of the mechanism's law (KS test)
  and scale (Gaussian ``sigma * C``, Laplace ``b``), the two ranks' shards come from different streams, and nothing is
  left without noise (Gaussian, Laplace, LAP2 and PLRV-O);
- sharding is real: each rank holds about half of the parameters' bytes, and gradients arrive as shards;
- a rank with an empty micro-batch joins the step on the engine's stand-in batch, which adds nothing;
- the first-step checks run in lockstep (the rank with too few examples to check joins the passes) and mixing found
  on one rank makes every rank raise;
- per-sample momentum (alone and on a LoRA model): with zero noise, 3 steps through the engine equal single-process
  training on the union, with an evaluation forward between the steps (FSDP2 then keeps the root gathered), an
  example whose loss is not finite on one rank (that rank alone drops it) and an empty micro-batch on one rank (its
  stand-in batch, re-run at the stored iterates, adds nothing); the iterates are shards (half the bytes), gathered
  into the engine's state and taken back shard by shard;
- adaptive clipping: the same comparison (the ranks' counts summed, the stand-in batch not counted); and the clipped
  sum with every Linear an FSDP unit of its own; augmentation multiplicity (2 copies per example, also with
  per-sample momentum: the stand-in batch's copies add nothing);
- what is not supported (modules the clipper swaps, an empty batch without the stand-in) fails early.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from process_helpers import free_port
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import PrivacyEngine, WSConv2d, augmentation_mean, repeat_for_multiplicity
from lightning_dp.checks import BatchMixingError
from lightning_dp.checks.buffers import BufferWatch
from lightning_dp.hf.losses import token_cross_entropy
from lightning_dp.mechanisms import make_mechanism
from lightning_dp.optim import DPOptimizer, DPRandomness, distributed_context
from lightning_dp.runtime.sharding import gathered, local_part, reshard_all

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

WORLD = 2
CLIP = 0.05  # below most per-sample norms, so the clip factors matter
VOCAB = 1001
SEQ = 6
EXAMPLES = 8  # per step, over both ranks
EXACT_ENGINES = ("flat", "ghost", "fgc", "mixed")
NOISE_ROWS, NOISE_COLS = 201, 300  # 60,300 coordinates, dim 0 split 101 / 100
NOISE = {
    "gaussian": dict(noise_multiplier=1.3),
    "laplace": dict(noise_scale=0.4),
    "lap2": dict(noise_scale=0.4),
    "plrv": dict(gamma_shape=6.0, gamma_scale=0.4),
}


def _tiny_llama(lora: bool = False) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).double()
    if lora:
        lora_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, lora_config)
        for module in model.modules():  # LoRA B starts at zero: move it so the norms see both factors
            if isinstance(module, nn.Linear) and module.weight.requires_grad:
                nn.init.normal_(module.weight, std=0.2)
    return model


def _ws_convnet() -> nn.Module:
    """Two weight-standardised convolutions (a layer family that reads the parameter values the call used)."""
    torch.manual_seed(0)
    return nn.Sequential(WSConv2d(3, 4, 3), nn.Tanh(), WSConv2d(4, 2, 3, groups=2), nn.Flatten()).double()


def _ws_loss(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    return model(images).sin().sum(1)


def _images(rank: int) -> torch.Tensor:
    return torch.randn(3, 3, 6, 6, generator=torch.Generator().manual_seed(50 + rank), dtype=torch.float64)


def _layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, transformers.models.llama.modeling_llama.LlamaDecoderLayer)]


def _shard(model: nn.Module, mesh, leaves: bool = False) -> nn.Module:
    """``fully_shard`` on each decoder layer and the root; with ``leaves``, first on each Linear of the decoder layers
    too (layers that are FSDP units of their own, as a size-based wrap policy makes them)."""
    from torch.distributed.fsdp import fully_shard

    if leaves:
        for layer in _layers(model):
            for module in layer.modules():
                if isinstance(module, nn.Linear):
                    fully_shard(module, mesh=mesh)
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (EXAMPLES, SEQ), generator=torch.Generator().manual_seed(100 + step))


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return token_cross_entropy(model(input_ids=ids).logits, ids, "mean", shift=True)


def _engine(clipping: str = "mixed", noise_multiplier: float = 1.0, **options) -> PrivacyEngine:
    options = {"check_batch_independence": False, "max_grad_norm": CLIP, **options}
    return PrivacyEngine(noise_multiplier=noise_multiplier, clipping=clipping, **options)


def _subtract_batch_mean(module: nn.Module, args: tuple, output: torch.Tensor | tuple) -> torch.Tensor | tuple:
    """A forward hook that mixes the examples of the batch (a decoder layer's output minus its batch mean)."""
    hidden = output[0] if isinstance(output, tuple) else output
    mixed = hidden - hidden.mean(0, keepdim=True)
    return (mixed, *output[1:]) if isinstance(output, tuple) else mixed


def _local_bytes(tensor: torch.Tensor) -> int:
    """What this rank holds of ``tensor`` (its shard for a sharded one)."""
    local = local_part(tensor)
    return local.numel() * local.element_size()


def _dp_optimizer(optimizer, mechanism, expected_batch_size: float, *, seed: int, context=None) -> DPOptimizer:
    """``optimizer`` privatised from a seeded stream; with ``context`` (several processes), rank 0's seed and the
    ranks' collectives."""
    randomness = DPRandomness(seed)
    collectives = {}
    if context is not None:
        context.synchronize_randomness(randomness)
        collectives = {"reduce_clipped_sum": context.reduce_clipped_sum, "any_rank": context.any_rank}
    return DPOptimizer(
        optimizer, mechanism=mechanism, expected_batch_size=expected_batch_size, randomness=randomness, **collectives
    )


#: the options of the engine runs (zero noise, 3 steps), and whether the model has LoRA adapters.
ENGINE_RUNS = {
    "momentum": (dict(momentum_length=3, momentum_beta=0.8), False),
    "momentum, lora": (dict(momentum_length=2), True),
    # zero noise on the count too, so that the count's draw cannot differ by the stream's position
    "adaptive clipping": (dict(target_unclipped_quantile=0.5, unclipped_num_std=0.0), False),
    # every Linear an FSDP unit of its own (their hooks then run after FSDP2's, which reshards)
    "leaf units": (dict(), False),
    # group-wise clipping: one bound per layer (CLIP split equally), and pattern groups with per-sample momentum
    "clipping groups per layer": (dict(clipping_groups="per_layer"), False),
    "clipping groups, momentum, lora": (
        dict(clipping_groups=[["*lora_A*"], ["*lora_B*"]], max_grad_norm=[0.3 * CLIP, CLIP], momentum_length=2),
        True,
    ),
    # augmentation multiplicity: 2 copies of each sequence (the second rolled by one token), averaged before clipping
    "augmentation multiplicity": (dict(augmentation_multiplicity=2), False),
    "augmentation multiplicity, momentum": (dict(augmentation_multiplicity=2, momentum_length=2), False),
}
ENGINE_STEPS = 3
NONFINITE_STEP, NONFINITE_ROW = 1, 3  # row 3 of the union: rank 1's second example
EMPTY_STEP = 2  # rank 1's micro-batch is empty (it runs the stand-in batch, after 2 stored iterates exist)


def _rows(step: int, rank: int, world: int) -> list[int]:
    """The rows of ``_tokens(step)`` that ``rank`` of ``world`` trains on (``world = 1``: the union); at
    ``EMPTY_STEP`` rank 1 of 2 has none."""
    return [i for i in range(EXAMPLES) if i % world == rank and (step != EMPTY_STEP or i % WORLD == 0)]


def _scaled_loss(model: nn.Module, scale: torch.Tensor, ids: torch.Tensor, copies: int = 1) -> torch.Tensor:
    """The per-example loss times ``scale``; with ``copies > 1``, each example's mean over its copies, copy ``k``
    rolled by ``k`` tokens (an "augmentation" of each row on its own)."""
    if copies == 1:
        return _loss(model, ids) * scale
    rows = repeat_for_multiplicity(ids, copies)
    rows = torch.stack([row.roll(index % copies) for index, row in enumerate(rows)])
    return augmentation_mean(_loss(model, rows), copies) * scale


def _engine_run(model: nn.Module, context, rank: int, world: int, **options) -> tuple[dict, PrivacyEngine]:
    """``ENGINE_STEPS`` zero-noise SGD steps through the engine's run sequence as the adapters drive it (the
    stand-in batch for an empty micro-batch of a sharded model), the loss of row ``NONFINITE_ROW`` infinite at
    ``NONFINITE_STEP``, and an evaluation forward after each step; the gathered parameters, and the engine."""
    engine = _engine(noise_multiplier=0.0, seed=3, **options)
    engine.start_run(model, context)
    batch_size = EXAMPLES // world  # q = 1: the expected batch q N = 8 on any number of processes
    loader = DataLoader(TensorDataset(_tokens(5)), batch_size=batch_size)
    engine.training_loader(loader, batch_size=batch_size, micro_batches=1)
    (optimizer,) = engine.start_training(
        [torch.optim.SGD(model.parameters(), lr=2.0, momentum=0.5)], total_steps=ENGINE_STEPS
    )
    for step in range(ENGINE_STEPS):
        rows = torch.tensor(_rows(step, rank, world), dtype=torch.long)
        ids = _tokens(step)[rows]
        stand_in = len(ids) == 0 and engine.every_rank_runs_every_step
        if stand_in:
            (ids,), rows = engine.stand_in_batch(), torch.tensor([-1])
        nonfinite = (rows == NONFINITE_ROW) & (step == NONFINITE_STEP)
        scale = torch.where(nonfinite, math.inf, 1.0).double()
        step_loss = functools.partial(_scaled_loss, model, scale, copies=options.get("augmentation_multiplicity", 1))
        loss = engine.per_sample_loss(ids, len(ids), step_loss, module=model, stand_in=stand_in)
        engine.clip(loss, stand_in=stand_in)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            model(input_ids=_tokens(9)[:2])  # an evaluation: FSDP2 keeps the root's weights gathered afterwards
    return {name: gathered(p).detach().clone() for name, p in model.named_parameters()}, engine


def _worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        context = distributed_context()
        mesh = init_device_mesh("cpu", (world,))
        result: dict = {}
        mine = _tokens(0)[rank::world]
        # norms, every exact engine; the sum check runs on this first batch (book-keeping)
        for lora in (False, True):
            for clipping in EXACT_ENGINES:
                model = _shard(_tiny_llama(lora), mesh)
                clipper = _engine(clipping).attach(model)
                result[("norms", clipping, lora)] = clipper.backward(_loss(model, mine))
                result[("grad is shard", clipping, lora)] = all(
                    type(p.grad).__name__ == "DTensor" for p in clipper.trainable_parameters
                )
        # weight-standardised convolutions, each its own FSDP unit: the family reads the unsharded weights the call used
        from torch.distributed.fsdp import fully_shard

        for clipping in EXACT_ENGINES:
            model = _ws_convnet()
            for unit in (model[0], model[2], model):
                fully_shard(unit, mesh=mesh)
            clipper = _engine(clipping).attach(model)
            result[("ws norms", clipping)] = clipper.backward(_ws_loss(model, _images(rank)))
        # sharding is real: local bytes of the parameters
        model = _shard(_tiny_llama(), mesh)
        result["local bytes"] = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        # update: zero noise, 3 steps of SGD with momentum, gathered afterwards; attached after a forward, which
        # leaves the root's parameters gathered (the clipper must still send the clipped sums to the shards)
        _loss(model, _tokens(9)[rank::world])
        engine = _engine("mixed")
        clipper = engine.attach(model)
        optimizer = _dp_optimizer(
            torch.optim.SGD(model.parameters(), lr=2.0, momentum=0.5),
            make_mechanism("gaussian", max_grad_norm=CLIP, noise_multiplier=0.0),
            EXAMPLES,
            seed=3,
            context=context,
        )
        for step in range(3):
            optimizer.zero_grad()
            clipper.backward(_loss(model, _tokens(step)[rank::world]))
            optimizer.step()
        result["params"] = {name: p.full_tensor() for name, p in model.named_parameters()}
        # an empty micro-batch on rank 1: the engine's stand-in batch keeps the collectives in step and adds zero
        model = _shard(_tiny_llama(), mesh)
        engine = PrivacyEngine(max_grad_norm=CLIP, noise_multiplier=0.0, check_batch_independence=False, seed=3)
        engine.start_run(model, context)
        data = DataLoader(TensorDataset(_tokens(5)), batch_size=4)
        engine.training_loader(data, batch_size=4, micro_batches=1)
        (optimizer,) = engine.start_training([torch.optim.SGD(model.parameters(), lr=2.0)], total_steps=1)
        batch = _tokens(0)[:3] if rank == 0 else _tokens(0)[:0]
        stand_in = len(batch) == 0 and engine.every_rank_runs_every_step
        if stand_in:
            (batch,) = engine.stand_in_batch()
        loss = engine.per_sample_loss(batch, len(batch), lambda ids: _loss(model, ids), module=model)
        result["stand-in norms"] = engine.clip(loss, stand_in=stand_in)
        optimizer.step()
        result["stand-in params"] = {name: p.full_tensor() for name, p in model.named_parameters()}
        # a restore after the run started (Lightning's ModelParallelStrategy restores after set-up) shares rank 0's
        # fresh seed again: unseeded, each rank's restart draws its own entropy
        engine = PrivacyEngine(max_grad_norm=CLIP, noise_multiplier=1.0, check_batch_independence=False)
        engine.start_run(model, context)
        engine.training_loader(DataLoader(TensorDataset(_tokens(5)), batch_size=4), batch_size=4, micro_batches=1)
        (optimizer,) = engine.start_training([torch.optim.SGD(model.parameters(), lr=2.0)], total_steps=2)
        engine.clip(engine.per_sample_loss(_tokens(1)[rank::world], 4, functools.partial(_loss, model), module=model))
        optimizer.step()
        engine.load_state_dict(engine.state_dict())
        result["restored seed"] = engine.randomness.base_seed
        engine.detach()
        # noise on a sharded weight with a zero clipped sum
        for name, params in NOISE.items():
            layer = nn.Linear(NOISE_COLS, NOISE_ROWS, bias=False).double()
            from torch.distributed.fsdp import fully_shard

            fully_shard(layer, mesh=mesh)
            layer.weight.grad = torch.zeros_like(layer.weight)
            _dp_optimizer(
                torch.optim.SGD(layer.parameters(), lr=1.0),
                make_mechanism(name, max_grad_norm=CLIP, **params),
                1.0,
                seed=7,
                context=context,
            ).privatise()
            result[("noise", name)] = layer.weight.grad.full_tensor()
            result[("local noise", name)] = layer.weight.grad.to_local().clone()
        # the first-step checks in lockstep: rank 0 checks 3 examples, rank 1 has one (it cannot check, but joins the
        # passes); with mixing between examples (a hook subtracting the batch mean) every rank raises
        for mixing in (False, True):
            model = _tiny_llama()
            if mixing:
                model.model.layers[0].register_forward_hook(_subtract_batch_mean)
            model = _shard(model, mesh)
            engine = PrivacyEngine(max_grad_norm=CLIP, noise_multiplier=1.0, seed=3)
            engine.start_run(model, context)
            engine.training_loader(DataLoader(TensorDataset(_tokens(5)), batch_size=4), batch_size=4, micro_batches=1)
            engine.start_training([torch.optim.SGD(model.parameters(), lr=2.0)], total_steps=1)
            batch = _tokens(0)[:3] if rank == 0 else _tokens(0)[:1]
            try:
                loss = engine.per_sample_loss(batch, len(batch), functools.partial(_loss, model), module=model)
                engine.clip(loss)
                result[("checked", mixing)] = "passed"
            except BatchMixingError as error:
                result[("checked", mixing)] = str(error)
        # HSDP: a (2, 1) mesh replicates each parameter over the two ranks (shard dimension of size 1)
        hsdp_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        model = _shard(_tiny_llama(), hsdp_mesh)
        clipper = _engine("ghost").attach(model)
        optimizer = _dp_optimizer(
            torch.optim.SGD(model.parameters(), lr=2.0),
            make_mechanism("gaussian", max_grad_norm=CLIP, noise_multiplier=1.0),
            EXAMPLES,
            seed=4,
            context=context,
        )
        clipper.backward(_loss(model, _tokens(0)[rank::world]))
        optimizer.privatise()
        result["hsdp noisy grads"] = {name: p.grad.to_local().clone() for name, p in model.named_parameters()}
        # refused on sharded models: modules the clipper swaps, an empty batch (without the stand-in)
        attention = nn.Sequential(nn.Linear(4, 8), nn.MultiheadAttention(8, 2, batch_first=True))
        from torch.distributed.fsdp import fully_shard

        fully_shard(attention, mesh=mesh)
        try:
            _engine().attach(attention)
        except ValueError as error:
            result[("refused", "swap")] = str(error)
        model = _shard(_tiny_llama(), mesh)
        try:
            _engine().attach(model).backward(torch.zeros(0, requires_grad=True))  # (a Llama cannot run 0 rows)
        except ValueError as error:
            result[("refused", "empty")] = str(error)
        # the buffer check on a sharded model whose root holds frozen parameters (the embedding and final norm)
        model = _shard(_tiny_llama(), mesh)
        for name, p in model.named_parameters():
            p.requires_grad_("layers" in name)
        watch = BufferWatch(model)
        result["buffer check"] = {}
        for case in ("eval forward, then training forward", "shard written", "buffer written"):
            model.train()
            if case.startswith("eval"):
                with torch.no_grad():
                    model.eval()(input_ids=_tokens(0)[:2])
            watch.start(contents=True)
            shard = model.model.norm.weight
            model(input_ids=_tokens(0)[:2])  # FSDP2 registers the root's gathered copies in place of the shards
            if case == "shard written":
                with torch.no_grad():
                    shard.to_local().add_(1.0)  # what the state_dict holds, as a leak would
            if case == "buffer written":
                model.model.rotary_emb.inv_freq.mul_(1.0)  # a buffer FSDP2 does not shard
            try:
                watch.check()
                result["buffer check"][case] = "passed"
            except ValueError as error:
                result["buffer check"][case] = str(error)
            reshard_all(model)
        # the engine runs: per-sample momentum, adaptive clipping, groups, augmentation multiplicity
        for name, (options, lora) in ENGINE_RUNS.items():
            model = _shard(_tiny_llama(lora), mesh, leaves="leaf units" in name)
            result[("engine run", name)], engine = _engine_run(model, context, rank, world, **options)
            if engine.momentum.enabled:
                iterates = list(engine.momentum.history)
                result[("iterate bytes", name)] = sum(_local_bytes(value) for it in iterates for value in it)
                result[("iterates", name)] = [[gathered(value) for value in it] for it in iterates]
                state = engine.state_dict()  # gathered: every rank holds the full iterates
                result[("iterates saved", name)] = [list(saved.values()) for saved in state["momentum"]["iterates"]]
                restored = _engine(noise_multiplier=0.0, **options)
                restored.attach(_shard(_tiny_llama(lora), mesh))
                restored.load_state_dict(state)
                result[("iterates restored", name)] = [
                    [torch.equal(local_part(a), local_part(b)) for a, b in zip(before, after, strict=True)]
                    for before, after in zip(iterates, restored.momentum.history, strict=True)
                ]
            engine.detach()
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp_spawn")
    mp.spawn(_worker, args=(WORLD, free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _oracle_norms(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Brute force: one autograd gradient per example on the unsharded model, the l2 norm over all trainable
    parameters (a tied weight once, with both uses summed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for i in range(len(ids)):
        grads = torch.autograd.grad(_loss(model, ids[i : i + 1])[0], params)
        norms.append(torch.sqrt(sum((g**2).sum() for g in grads)))
    return torch.stack(norms)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("clipping", EXACT_ENGINES)
def test_norms_on_each_rank_equal_the_single_process_oracle(ranks, clipping, lora):
    model = _tiny_llama(lora)
    for rank, result in enumerate(ranks):
        oracle = _oracle_norms(model, _tokens(0)[rank::WORLD])
        torch.testing.assert_close(result[("norms", clipping, lora)].double(), oracle, rtol=1e-9, atol=1e-12)
        assert result[("grad is shard", clipping, lora)]
    assert (oracle > CLIP).all()  # the clip factors are below 1: the update test below exercises them


@pytest.mark.parametrize("clipping", EXACT_ENGINES)
def test_weight_standardised_convolutions_of_their_own_fsdp_units(ranks, clipping):
    """``WSConv2d``'s per-sample gradients depend on the weight's values: sharded, they are the unsharded weights
    the forward used (copied by the hook), so the norms equal the single-process oracle's."""
    model = _ws_convnet()
    params = [p for p in model.parameters() if p.requires_grad]
    for rank, result in enumerate(ranks):
        images = _images(rank)
        oracle = torch.stack(
            [
                torch.sqrt(sum((g**2).sum() for g in torch.autograd.grad(_ws_loss(model, x[None])[0], params)))
                for x in images
            ]
        )
        torch.testing.assert_close(result[("ws norms", clipping)].double(), oracle, rtol=1e-9, atol=1e-12)


def test_zero_noise_update_equals_single_process_training_on_the_union(ranks):
    model = _tiny_llama()
    clipper = _engine("mixed").attach(model)
    optimizer = _dp_optimizer(
        torch.optim.SGD(model.parameters(), lr=2.0, momentum=0.5),
        make_mechanism("gaussian", max_grad_norm=CLIP, noise_multiplier=0.0),
        EXAMPLES,
        seed=3,
    )
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    for step in range(3):
        optimizer.zero_grad()
        clipper.backward(_loss(model, _tokens(step)))
        optimizer.step()
    for result in ranks:
        for name, p in model.named_parameters():
            torch.testing.assert_close(result["params"][name], p.detach(), rtol=1e-6, atol=1e-10)
            assert not torch.equal(p.detach(), initial[name])


def test_a_rank_with_an_empty_batch_joins_the_step_and_adds_nothing(ranks):
    model = _tiny_llama()
    engine = PrivacyEngine(max_grad_norm=CLIP, noise_multiplier=0.0, check_batch_independence=False, seed=3)
    engine.start_run(model, None)
    engine.training_loader(DataLoader(TensorDataset(_tokens(5)), batch_size=8), batch_size=8, micro_batches=1)
    assert not engine.every_rank_runs_every_step  # one process, unsharded: empty batches are simply empty
    (optimizer,) = engine.start_training([torch.optim.SGD(model.parameters(), lr=2.0)], total_steps=1)
    engine.clip(engine.per_sample_loss(_tokens(0)[:3], 3, lambda ids: _loss(model, ids), module=model))
    optimizer.step()  # the same expected batch size q N = 8: N = 8, q = 4 x 2 ranks / 8 there, 8 / 8 here
    assert ranks[0]["stand-in norms"].numel() == 3 and ranks[1]["stand-in norms"].numel() == 0
    for result in ranks:
        for name, p in model.named_parameters():
            torch.testing.assert_close(result["stand-in params"][name], p.detach(), rtol=1e-6, atol=1e-10)


def test_a_restore_after_the_run_started_shares_the_seed_again(ranks):
    assert ranks[0]["restored seed"] == ranks[1]["restored seed"]


def test_each_rank_holds_about_half_of_the_parameters(ranks):
    total = sum(p.numel() * p.element_size() for p in _tiny_llama().parameters())
    for result in ranks:
        assert result["local bytes"] == pytest.approx(total / WORLD, rel=0.02)


@pytest.mark.parametrize("name", list(NOISE))
def test_every_coordinate_gets_one_draw_of_the_mechanism(ranks, name):
    noise = ranks[0][("noise", name)]
    assert torch.equal(noise, ranks[1][("noise", name)])  # the gathered tensor is one tensor
    assert noise.shape == (NOISE_ROWS, NOISE_COLS) and bool((noise != 0).all())  # nothing skipped
    rows = (NOISE_ROWS + 1) // 2
    torch.testing.assert_close(noise[:rows], ranks[0][("local noise", name)], rtol=0, atol=0)
    torch.testing.assert_close(noise[rows:], ranks[1][("local noise", name)], rtol=0, atol=0)
    flat = noise.flatten().numpy()
    if name == "gaussian":
        scale = NOISE["gaussian"]["noise_multiplier"] * CLIP
        law = stats.norm(scale=scale).cdf
        assert flat.std() == pytest.approx(scale, rel=0.03)  # one draw: neither sqrt(2) times it nor half
    elif name == "plrv":  # per coordinate Lap(1/u), u ~ Gamma(k, theta): compared with an independent numpy sample
        k, theta = NOISE["plrv"]["gamma_shape"], NOISE["plrv"]["gamma_scale"]
        numpy = np.random.default_rng(0)
        law = numpy.laplace(scale=1.0 / numpy.gamma(k, theta, size=flat.size))
        assert flat.std() == pytest.approx(math.sqrt(2.0 / (theta**2 * (k - 1) * (k - 2))), rel=0.05)
    else:  # laplace and lap2: Lap(b) per coordinate
        scale = NOISE[name]["noise_scale"]
        law = stats.laplace(scale=scale).cdf
        assert flat.std() == pytest.approx(math.sqrt(2) * scale, rel=0.03)
    assert stats.kstest(flat, law).pvalue > 1e-3
    # the shards come from different streams: independent, not copies of each other
    first, second = noise[:100].flatten(), noise[rows : rows + 100].flatten()
    assert abs(torch.corrcoef(torch.stack([first, second]))[0, 1].item()) < 0.05


def test_the_first_step_checks_run_in_lockstep_and_every_rank_raises_on_mixing(ranks):
    assert [r[("checked", False)] for r in ranks] == ["passed", "passed"]
    assert "example" in ranks[0][("checked", True)] and "batch-independence check" in ranks[0][("checked", True)]
    assert "another process found examples of its batch mixing" in ranks[1][("checked", True)]


def test_hsdp_replicas_get_the_same_noise_and_the_same_sum(ranks):
    first, second = (r["hsdp noisy grads"] for r in ranks)
    for name in first:  # each rank holds the whole parameter: the replicas must agree to the bit
        assert torch.equal(first[name], second[name]), name
    model = _tiny_llama()
    clipper = _engine("ghost").attach(model)
    clipper.backward(_loss(model, _tokens(0)))
    scale = CLIP * 1.0
    noisy = first["model.layers.0.self_attn.q_proj.weight"] * EXAMPLES  # privatise divided by q N
    noise = noisy - model.model.layers[0].self_attn.q_proj.weight.grad  # the sum over both ranks' examples
    assert noise.std().item() == pytest.approx(scale, rel=0.1)  # one draw, not a sum of the replicas' draws


def test_the_buffer_check_tracks_frozen_shards_through_fsdp2s_swaps(ranks):
    """A frozen root parameter is registered as the gathered copy after the forward: not a write. A write to the
    shard itself, or to a buffer FSDP2 does not shard, is still caught."""
    for result in ranks:
        checks = result["buffer check"]
        assert checks["eval forward, then training forward"] == "passed"
        assert "'weight' of module 'model.norm'" in checks["shard written"]
        assert "'inv_freq' of module 'model.rotary_emb'" in checks["buffer written"]


def test_what_is_not_supported_fails_early_on_every_rank(ranks):
    for result in ranks:
        assert "MultiheadAttention cannot be clipped on an FSDP2-sharded model" in result[("refused", "swap")]
        assert "an empty batch on an FSDP2-sharded model" in result[("refused", "empty")]


@pytest.mark.parametrize("name", list(ENGINE_RUNS))
def test_engine_runs_equal_single_process_training_on_the_union(ranks, name):
    options, lora = ENGINE_RUNS[name]
    assert _rows(EMPTY_STEP, 1, WORLD) == [] and NONFINITE_ROW in _rows(NONFINITE_STEP, 1, WORLD)
    expected, engine = _engine_run(_tiny_llama(lora), None, 0, 1, **options)
    assert engine.dropped_nonfinite or engine.clipper.dropped_nonfinite  # the row was dropped here too
    assert engine.adaptive is None or engine.current_max_grad_norm != CLIP  # the bound moved
    initial = dict(_tiny_llama(lora).named_parameters())
    for result in ranks:
        params = result[("engine run", name)]
        assert params.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(params[key], value, rtol=0, atol=1e-12, msg=key)
            if initial[key].requires_grad:
                assert not torch.equal(value, initial[key].detach()), key


@pytest.mark.parametrize("name", [name for name, (options, _) in ENGINE_RUNS.items() if "momentum_length" in options])
def test_momentum_iterates_are_shards_gathered_into_the_state_and_restored_shard_by_shard(ranks, name):
    options, lora = ENGINE_RUNS[name]
    trainable = [p for p in _tiny_llama(lora).parameters() if p.requires_grad]
    unsharded_bytes = (options["momentum_length"] - 1) * sum(p.numel() * p.element_size() for p in trainable)
    for result in ranks:
        assert result[("iterate bytes", name)] == pytest.approx(unsharded_bytes / WORLD, rel=0.02)
        iterates, saved = result[("iterates", name)], result[("iterates saved", name)]
        assert len(iterates) == options["momentum_length"] - 1
        for full, written in zip(iterates, saved, strict=True):
            assert all(type(t) is torch.Tensor and torch.equal(a, t) for a, t in zip(full, written, strict=True))
        assert all(all(same) for same in result[("iterates restored", name)])
    assert all(torch.equal(a, b) for a, b in zip(*(r[("iterates", name)][0] for r in ranks), strict=True))
