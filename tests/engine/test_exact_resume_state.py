"""The pieces of ``exact_resume``: :meth:`DPRandomness.state_dict` continues every noise stream where it was saved
(on each device the run uses), the sampler keyed by the step draws step ``t``'s batch from ``t`` alone, and a noise
stream read back onto the CPU continues on the device of the next draw."""

from __future__ import annotations

import copy
import functools
from types import SimpleNamespace

import pytest
import torch

from lightning_dp.accounting.banded_mf import BandedMFAccountant
from lightning_dp.correlated_noise import BandedNoise, optimize_banded
from lightning_dp.data.cyclic_poisson import CyclicPoissonBatchSampler, cyclic_groups
from lightning_dp.data.poisson import PoissonBatchSampler
from lightning_dp.engine.exact_resume import (
    check_draw_schedule,
    continued_stream,
    finish_restore,
    restore_secret_state,
    secret_state,
)
from lightning_dp.runtime.randomness import DPRandomness
from lightning_dp.runtime.sharding import gathered_part, part_like

#: the refusal of a start after a load that no start of training followed
REFUSED = "A checkpoint loaded into this run was not trained from"

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_a_restored_randomness_continues_every_stream(device):
    saved = DPRandomness(seed=3)
    for purpose in (saved.noise_generator, saved.projection_generator):
        torch.randn(5, device=device, generator=purpose(device))
    torch.randn(4, device=device, generator=saved.noise_generator(device, shard=(1, 0)))
    state = saved.state_dict()
    restored = DPRandomness(seed=99)  # another seed: the state replaces it
    restored.load_state_dict(state)
    for draw in (
        lambda r: r.noise_generator(device),
        lambda r: r.projection_generator(device),
        lambda r: r.noise_generator(device, shard=(1, 0)),
    ):
        assert torch.equal(
            torch.randn(7, device=device, generator=draw(restored)),
            torch.randn(7, device=device, generator=draw(saved)),
        )
    assert restored.base_seed == 3 and restored.step_sampling_seed(5) == saved.step_sampling_seed(5)


def test_a_restored_stream_not_used_yet_is_saved_again():
    """A checkpoint written after a resume but before the first draw (a crash on the resumed run's first step) must
    keep the restored states: without them a resume from it would start the streams afresh and replay their draws."""
    saved = DPRandomness(seed=3)
    torch.randn(5, generator=saved.noise_generator("cpu"))
    restored = DPRandomness(seed=3)
    restored.load_state_dict(saved.state_dict())
    again = DPRandomness(seed=3)
    again.load_state_dict(restored.state_dict())
    assert torch.equal(
        torch.randn(4, generator=again.noise_generator("cpu")), torch.randn(4, generator=saved.noise_generator("cpu"))
    )


def test_the_cyclic_partition_is_read_as_each_pass_starts():
    """A sampler built before the run's randomness is restored (or shared from rank 0) samples the restored
    partition."""
    randomness = DPRandomness(seed=None)
    sampler = CyclicPoissonBatchSampler(
        64,
        0.1,
        num_groups=4,
        key=functools.partial(randomness.stream_seed, "cyclic groups"),
        next_step=lambda: 0,
        generator=randomness.sampling,
    )
    before = sampler.groups.clone()
    checkpoint = DPRandomness(seed=11)
    randomness.load_state_dict(checkpoint.state_dict())
    assert torch.equal(sampler.groups, cyclic_groups(64, 4, checkpoint.stream_seed("cyclic groups")))
    assert not torch.equal(sampler.groups, before)
    for t, batch in enumerate(list(sampler)[:4]):
        assert set(sampler.groups[batch].tolist()) <= {t % 4}


def test_a_stream_the_checkpoint_drew_on_another_device_is_refused():
    """Seeding it afresh would replay the draws the checkpoint's run already added on that other device."""
    state = DPRandomness(seed=3).state_dict()
    state["generators"] = {"noise/cuda/0/": torch.Generator().get_state()}  # as a checkpoint of a run on cuda:0
    restored = DPRandomness(seed=3)
    restored.load_state_dict(state)
    restored.projection_generator("cpu")  # a stream the checkpoint does not hold starts from its seed
    with pytest.raises(RuntimeError, match="noise stream was drawn as \\['noise/cuda/0/'\\].*another device"):
        restored.noise_generator("cpu")


def test_sharing_the_same_seed_again_continues_the_streams():
    """A second ``fit`` on several processes shares rank 0's seed again: the noise and sampling streams continue
    (re-deriving them would replay the first fit's noise and batches)."""
    randomness, reference = DPRandomness(seed=0), DPRandomness(seed=0)
    for r in (randomness, reference):
        r.share(5, rank=1)
        torch.randn(3, generator=r.noise_generator("cpu")), torch.rand(3, generator=r.sampling)
    randomness.share(5, rank=1)
    assert torch.equal(
        torch.randn(3, generator=randomness.noise_generator("cpu")),
        torch.randn(3, generator=reference.noise_generator("cpu")),
    )
    assert torch.equal(torch.rand(3, generator=randomness.sampling), torch.rand(3, generator=reference.sampling))
    randomness.share(6, rank=1)  # another seed (a restart's fresh one): the streams are derived from it
    assert randomness.base_seed == 6


def test_secure_randomness_and_malformed_states_are_refused():
    with pytest.raises(ValueError, match="cannot be saved"):
        DPRandomness(secure=True).state_dict()
    with pytest.raises(ValueError, match="not a saved DPRandomness state"):
        DPRandomness(seed=0).load_state_dict({"base_seed": 0, "restart": -1, "generators": {}})
    with pytest.raises(ValueError, match="not a saved DPRandomness state"):
        DPRandomness(seed=0).load_state_dict({"base_seed": 0, "restart": 0, "generators": {"noise/cpu/0/": [1]}})


def test_the_sampler_keyed_by_the_step_draws_each_step_from_the_step_alone():
    randomness = DPRandomness(seed=0)

    def sampler(first: int) -> PoissonBatchSampler:
        return PoissonBatchSampler(
            100,
            0.1,
            num_steps=6,
            generator=torch.Generator(),
            next_step=lambda: first,
            step_seed=randomness.step_sampling_seed,
        )

    whole = list(sampler(0))
    torch.rand(17, generator=sampler(3).generator)  # whatever the generator drew before
    assert list(sampler(3))[:3] == whole[3:]
    unkeyed = PoissonBatchSampler(100, 0.1, num_steps=6, generator=torch.Generator().manual_seed(0))
    assert list(unkeyed) != whole


@pytest.mark.parametrize("device", DEVICES)
def test_a_noise_stream_read_onto_the_cpu_continues_on_the_draws_device(device):
    strategy = optimize_banded(8, 3, max_participations=1)
    generator = torch.Generator(device=device).manual_seed(0)
    draws = [[torch.randn(4, 2, device=device, generator=generator)] for _ in range(6)]
    whole = BandedNoise(strategy)
    outputs = [whole.correlate(z) for z in draws]
    cut = BandedNoise(strategy)
    for z in draws[:4]:
        cut.correlate(z)
    state = cut.state_dict()
    state["state"] = [[t.cpu() for t in vector] for vector in state["state"]]  # as torch.load(map_location="cpu")
    resumed = BandedNoise(strategy)
    resumed.load_state_dict(state)
    for z, expected in zip(draws[4:], outputs[4:], strict=True):
        (got,) = resumed.correlate(z)
        assert got.device == z[0].device and torch.equal(got, expected[0])


def test_every_restored_noise_stream_goes_to_one_optimizer():
    """A checkpoint's streams and the run's optimizers pair one to one: a stream left over (or an optimizer without
    one) would continue the segment with another correlation than the ledger's."""
    with pytest.raises(ValueError, match="1 noise stream\\(s\\) more than this run has optimizers"):
        finish_restore(SimpleNamespace(restored_noise_streams=[{"step": 3}]))
    plan = SimpleNamespace(noise_stream=lambda: BandedNoise(optimize_banded(8, 2, max_participations=1)))
    run = SimpleNamespace(correlation=plan, restored_noise_streams=[], noise_streams=[])
    with pytest.raises(ValueError, match="fewer noise streams than this run has optimizers"):
        continued_stream(run, [])


def test_a_restored_noise_stream_must_hold_the_optimizers_parameter_shapes():
    """The checkpoint's stream state is one full tensor per parameter; another model or optimizer is refused at the
    restore, before any noise is drawn."""
    stream = BandedNoise(optimize_banded(8, 3, max_participations=1))
    for _ in range(3):
        stream.correlate([torch.randn(4, 2), torch.randn(3)])
    plan = SimpleNamespace(noise_stream=lambda: BandedNoise(stream.strategy))
    params = [torch.zeros(4, 2), torch.zeros(3)]
    run = SimpleNamespace(correlation=plan, restored_noise_streams=[stream.state_dict()], noise_streams=[])
    continued = continued_stream(run, params)
    assert continued is not None and continued.step_index == 3 and run.noise_streams == [(continued, params)]
    run = SimpleNamespace(correlation=plan, restored_noise_streams=[stream.state_dict()], noise_streams=[])
    with pytest.raises(ValueError, match="does not hold one tensor per parameter of this optimizer"):
        continued_stream(run, [torch.zeros(4, 2), torch.zeros(4)])


def _schedule_run(world_size: int | None, restored: dict | None, module: torch.nn.Module) -> SimpleNamespace:
    distributed = None if world_size is None else SimpleNamespace(world_size=world_size)
    return SimpleNamespace(
        restored_noise_streams=None,
        restored_draw_schedule=restored,
        draw_schedule=None,
        distributed=distributed,
        clipper=SimpleNamespace(module=module),
        num_samples=100,
        resume_started=False,
        load_unfinished=False,
        stale_load=False,
    )


def _optimizer(module: torch.nn.Module, params: list | None = None) -> torch.optim.Optimizer:
    """An optimizer of ``params`` (default: all of ``module``'s parameters, the frozen ones included)."""
    return torch.optim.SGD(list(module.parameters()) if params is None else params, lr=0.1)


def test_an_exact_resume_draws_on_the_schedule_its_checkpoint_drew_on():
    """A checkpoint's streams continued on other processes, devices, sharding, dataset size or trainable parameters
    would add draws the abandoned continuation of the same checkpoint already added, to other gradients: refused when
    training starts, saying what differs; the schedule is fixed for the next checkpoint, and a corrupted one is
    refused at the restore."""
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    run = _schedule_run(None, None, module)
    check_draw_schedule(run, [_optimizer(module)])
    schedule = run.draw_schedule
    assert schedule == {
        "world_size": 1,
        "devices": ["cpu"],
        "meshes": [],
        "num_samples": 100,
        "params": [
            [
                ["0.weight", [2, 3], "torch.float32", None],
                ["0.bias", [2], "torch.float32", None],
                ["1.weight", [2, 2], "torch.float32", None],
                ["1.bias", [2], "torch.float32", None],
            ]
        ],
    }
    run = _schedule_run(None, schedule, module)
    check_draw_schedule(run, [_optimizer(module)])
    finish_restore(run)
    assert run.draw_schedule == schedule and run.restored_draw_schedule is None and not run.resume_started
    run = _schedule_run(None, schedule, module)
    check_draw_schedule(run, [_optimizer(module)])  # then a later check of the start fails: finish_restore never runs
    with pytest.raises(ValueError, match=REFUSED):
        check_draw_schedule(run, [_optimizer(module)])
    frozen = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    frozen[0].bias.requires_grad_(False)
    weight, bias, weight1, bias1 = module.parameters()
    changes = {  # the run that resumes (world size, model, its optimizer's parameters, N), what the refusal names
        "on world size 1, this run draws it on world size 2": (2, module, None, 100),
        "over a dataset of size 100, this run draws it over a dataset of size 99": (None, module, None, 99),
        "\\(0, '0.bias', \\[2\\], 'torch.float32', None\\), this run draws it .*\\(0, '1.weight'": (
            None,
            frozen,
            None,
            100,
        ),
        "\\(0, '0.bias', .*\\(0, '1.bias', \\[2\\]": (None, module, [weight, bias1, weight1, bias], 100),
        "\\(0, '0.weight', \\[2, 3\\], 'torch.float32', None\\), .*'torch.float64'": (
            None,
            copy.deepcopy(module).double(),
            None,
            100,
        ),
    }
    for message, (world_size, resumed, params, num_samples) in changes.items():
        run = _schedule_run(world_size, schedule, resumed)
        run.num_samples = num_samples
        optimizer = _optimizer(resumed, params)
        with pytest.raises(ValueError, match=f"exact_resume: the checkpoint's noise was drawn .*{message}"):
            check_draw_schedule(run, [optimizer])
        # the refusal stays: a later start of the run (a fit without ckpt_path), even on the checkpoint's schedule
        with pytest.raises(ValueError, match=REFUSED):
            check_draw_schedule(run, [_optimizer(module)])
        assert run.restored_draw_schedule == schedule  # what a checkpoint written after the refusal records
    for key, saved, message in (
        ("devices", ["cuda"], "on devices \\['cuda'\\], this run draws it on devices"),
        ("meshes", [[1, 2]], "on meshes \\[\\[1, 2\\]\\], this run draws it on meshes \\[\\]"),
    ):
        run = _schedule_run(None, {**schedule, key: saved}, module)
        with pytest.raises(ValueError, match=message):
            check_draw_schedule(run, [_optimizer(module)])
    module.float()
    drawn = DPRandomness(seed=1)
    torch.randn(2, generator=drawn.noise_generator("cpu"))
    for malformed in ({"world_size": 1, "devices": ["cpu"], "meshes": []}, None):  # not a schedule; none at all
        run = SimpleNamespace(accountant=BandedMFAccountant(), randomness=DPRandomness(0), restored_noise_streams=None)
        saved = {"randomness": drawn.state_dict(), "noise_streams": [], "draw_schedule": malformed}
        with pytest.raises(ValueError, match="entry is corrupted \\(draw schedule"):
            restore_secret_state(run, saved, run.accountant)
    older = {"randomness": drawn.state_dict(), "noise_streams": [], "layout": {"world_size": 1}}  # an earlier version's
    with pytest.raises(ValueError, match="written by an earlier version .* resume it without exact_resume"):
        restore_secret_state(run, older, run.accountant)


def _rank_state(checkpoint: DPRandomness, coordinate: int) -> DPRandomness:
    """A rank of a sharded run resumed from ``checkpoint`` that has drawn from its own shard's stream only."""
    rank = DPRandomness(seed=0)
    rank.load_state_dict(checkpoint.state_dict())
    torch.randn(2, generator=rank.noise_generator("cpu", (1, 2, 0, coordinate)))
    return rank


def _sharded_run(ranks: list[DPRandomness]) -> SimpleNamespace:
    """A sharded run on rank 0 whose gather returns what ``ranks`` hold."""
    held = [(r.state_dict()["generators"], r.untouched_streams) for r in ranks]
    return SimpleNamespace(
        randomness=ranks[0],
        distributed=SimpleNamespace(gather_objects=lambda mine: held, is_main=True),
        clipper=SimpleNamespace(sharded=True),
        noise_streams=[],
        restored_noise_streams=None,
        restored_draw_schedule=None,
        draw_schedule=None,
    )


def test_a_sharded_checkpoint_holds_each_shards_stream_as_the_rank_that_draws_it_left_it():
    """Each rank of a sharded run draws from its own shard's stream and holds the others' as restored: the
    checkpoint takes every stream from the rank that drew from it, never a stale restored copy; two drawn states of
    one shared stream that differ are a broken run and raise."""
    checkpoint = DPRandomness(seed=5)
    for coordinate in (0, 1):
        torch.randn(3, generator=checkpoint.noise_generator("cpu", (1, 2, 0, coordinate)))
    ranks = [_rank_state(checkpoint, coordinate) for coordinate in (0, 1)]
    assert ranks[0].untouched_streams == {"noise/cpu/0/1,2,0,1"}
    merged = secret_state(_sharded_run(ranks))["randomness"]["generators"]
    for coordinate, rank in enumerate(ranks):
        name = f"noise/cpu/0/1,2,0,{coordinate}"
        assert torch.equal(merged[name], rank.state_dict()["generators"][name])
        assert not torch.equal(merged[name], checkpoint.state_dict()["generators"][name])
    apart = [DPRandomness(seed=7), DPRandomness(seed=8)]
    for randomness in apart:
        torch.randn(1, generator=randomness.noise_generator("cpu"))
    with pytest.raises(RuntimeError, match="different states of the shared noise stream 'noise/cpu/0/'"):
        secret_state(_sharded_run(apart))


def test_a_checkpoint_before_any_correlated_step_has_nothing_to_continue():
    run = SimpleNamespace(accountant=BandedMFAccountant(), randomness=DPRandomness(seed=0), restored_noise_streams=None)
    saved = {"randomness": DPRandomness(seed=1).state_dict(), "noise_streams": [{"step": 0}]}
    restore_secret_state(run, saved, run.accountant)
    assert run.restored_noise_streams is None and run.randomness.base_seed == 1


def test_a_full_tensor_takes_the_place_of_an_unsharded_parameter_only_at_its_shape():
    full, like = torch.arange(6.0).reshape(2, 3), torch.zeros(2, 3, dtype=torch.float64)
    assert torch.equal(part_like(full, like), full) and part_like(full, like).dtype == torch.float32
    assert torch.equal(gathered_part(full, like), full) and gathered_part(full, like, keep=False) is None
    with pytest.raises(ValueError, match=r"a tensor of shape \(2, 3\) cannot take the place of one of \(3, 2\)"):
        part_like(full, torch.zeros(3, 2))
