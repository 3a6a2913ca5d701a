"""Correlated noise on an FSDP2-sharded model (``DPModelParallelStrategy``, 2 CPU processes over gloo, launched as
``fsdp_correlated_script.py``): each rank correlates the noise of its own shards, drawn from its shard-keyed noise
streams, so with zero gradients the noise of every coordinate at step ``t`` must be ``(C^{-1} s Z)_t`` where ``Z`` is
what the independent-noise run of the same seed adds to that coordinate (the same streams, the same draws), for banded
and BLT strategies alike; both ranks hold the same gathered parameters, and the reported epsilon is the plan's.
With ``exact_resume=True`` a run resumed mid-stream from a sharded checkpoint equals the uninterrupted one bit for
bit, on a 1-D mesh and on an HSDP mesh: the checkpoint holds every rank's shard-keyed generator states, the BLT
buffers at their full values and the draw schedule, each rank takes back its own, and the resumed run's next
checkpoint is the uninterrupted run's."""

from __future__ import annotations

import pytest
import torch
from correlation_helpers import noise_per_step
from helpers import nested_equal
from process_helpers import fit_on_two_processes


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return fit_on_two_processes(tmp_path_factory.mktemp("fsdp_correlated"), script="fsdp_correlated_script.py")


@pytest.mark.parametrize("kind", ["banded", "blt"])
def test_each_shard_streams_the_strategy_over_its_own_draws(ranks, kind):
    for rank in ranks:
        run, independent = rank[kind], rank["independent"]
        assert run["sharded"] and independent["sharded"]
        noise, draws = noise_per_step(run), noise_per_step(independent)
        steps = noise.shape[0]
        inverse = torch.as_tensor(run["strategy"].inverse_dense(steps))
        expected = inverse @ (run["scale"] * draws)
        assert not torch.allclose(noise, run["scale"] * draws, atol=1e-3)  # correlated, not independent
        torch.testing.assert_close(noise, expected, rtol=1e-4, atol=1e-4 * float(draws.abs().max()))
    assert all(torch.equal(ranks[0][kind]["params"], ranks[1][kind]["params"]) for kind in ("banded", "blt"))


@pytest.mark.parametrize("kind", ["banded", "blt"])
def test_the_sharded_run_reports_its_plans_epsilon(ranks, kind):
    summary = ranks[0][kind]["summary"]
    assert (
        summary["noise_correlation"] == kind
        and summary["accountant"] == {"banded": "banded-mf", "blt": "blt-minsep"}[kind]
    )
    assert ranks[0][kind]["epsilon"] == ranks[1][kind]["epsilon"] == summary["epsilon"]


#: per mesh: the streams of the shards the two ranks hold (mesh ndim and shape, then sharded dimension and coordinate;
#: HSDP replicas hold one shard), and the meshes the checkpoint's draw schedule records.
MESHES = {
    "fsdp": ({"1,2,0,0", "1,2,0,1"}, [[1, 2]]),
    "hsdp": ({"2,2,1,1,0"}, [[2, 2, 1]]),
}


@pytest.mark.parametrize("mesh", MESHES)
def test_an_exact_resume_of_a_sharded_run_equals_the_uninterrupted_run(ranks, mesh):
    for rank in ranks:
        run = rank["exact"][mesh]
        whole, resumed = run["whole"], run["resumed"]
        assert len(whole) == 7 and len(resumed) == 3 and run["steps"] == 6
        assert all(torch.equal(got, want) for got, want in zip(resumed, whole[4:], strict=True))
        assert not torch.equal(whole[5] - whole[4], whole[6] - whole[5])  # the noise moved the parameters
    secrets = ranks[0]["exact"][mesh]["checkpoints"]
    cut = secrets["cut"]
    shards, meshes = MESHES[mesh]
    assert {name.split("/")[-1] for name in cut["randomness"]["generators"]} == shards
    (stream,) = cut["noise_streams"]
    shapes = [tuple(t.shape) for t in stream["state"][0]]
    assert stream["step"] == 4 and shapes == [(24, 24), (24,), (24, 24), (24,), (3, 24), (3,)]  # full, not shards
    schedule = cut["draw_schedule"]
    assert (schedule["world_size"], schedule["devices"], schedule["meshes"]) == (2, ["cpu"], meshes)
    assert [tuple(shape) for _, shape, _, _ in schedule["params"][0]] == shapes  # global shapes, sharded placements
    assert all(["Shard", 0] in placements for *_, placements in schedule["params"][0])
    # the resumed run's next checkpoint holds what the uninterrupted run's holds: each rank's drawn streams, never the
    # stale restored copy of the other rank's
    assert nested_equal(secrets["resumed end"], secrets["whole end"])
    assert not nested_equal(secrets["whole end"]["randomness"], cut["randomness"])
