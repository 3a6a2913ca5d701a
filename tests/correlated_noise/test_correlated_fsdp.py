"""Correlated noise on an FSDP2-sharded model (``DPModelParallelStrategy``, 2 CPU processes over gloo, launched as
``fsdp_correlated_script.py``): each rank correlates the noise of its own shards, drawn from its shard-keyed noise
streams, so with zero gradients the noise of every coordinate at step ``t`` must be ``(C^{-1} s Z)_t`` where ``Z`` is
what the independent-noise run of the same seed adds to that coordinate (the same streams, the same draws), for banded
and BLT strategies alike; both ranks hold the same gathered parameters, and the reported epsilon is the plan's.
``exact_resume=True`` is refused there on every rank (a checkpoint written by one rank cannot hold every shard's
noise streams)."""

from __future__ import annotations

import pytest
import torch
from correlation_helpers import noise_per_step
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


def test_exact_resume_is_refused_on_sharded_parameters(ranks):
    for rank in ranks:
        assert rank["exact_resume_refused"].startswith("exact_resume=True is not supported on FSDP2-sharded parameters")
