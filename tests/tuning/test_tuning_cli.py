"""``lightning-dp tune``: one search on digits end to end (two candidates of one epoch), what it prints (the winner and
one epsilon, never a loser's score), and its bad input as one ``error:`` line with exit code 2."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch

import lightning_dp.tuning
from lightning_dp.accounting import make_accountant
from lightning_dp.accounting.events import GaussianEvent, LaplaceEvent, PoissonSampledEvent
from lightning_dp.cli.main import main
from lightning_dp.tuning.randomness import SearchRandomness
from lightning_dp.tuning.repetitions import RepetitionDistribution

#: a seed whose search draws two candidates at mean 1.5 (geometric)
SEED = 3


def test_a_search_on_digits_prints_the_winner_and_one_epsilon(tmp_path, monkeypatch, capsys):
    assert RepetitionDistribution(1.5, 1.0).sample(SearchRandomness(SEED).uniform()) == 2
    scores: list[float] = []
    search = lightning_dp.tuning.private_search

    def recording(train_candidate, *args, **kwargs):
        def train(candidate):
            score, artifact = train_candidate(candidate)
            scores.append(score)
            return score, artifact

        return search(train, *args, **kwargs)

    monkeypatch.setattr(lightning_dp.tuning, "private_search", recording)
    argv = ["tune", "--lr", "0.5,2", "--max-grad-norm", "0.5,1", "--epochs", "1", "--batch-size", "256"]
    argv += ["--mean-repetitions", "1.5", "--target-epsilon", "4", "--seed", str(SEED), "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert len(scores) == 2
    winner = max(scores)
    assert lines[0].startswith("winner: lr ") and f"validation accuracy {winner:.4f}" in lines[0]
    assert lines[1].startswith("the whole search: epsilon ") and "one candidate alone: epsilon " in lines[1]
    loser = min(scores)
    if loser != winner:
        assert f"{loser:.4f}" not in out + err and str(loser) not in out + err
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["score"] == winner and 4 * 0.999 <= result["epsilon"] <= 4
    weights = torch.load(tmp_path / "winner.saved.pt")
    assert "net.0.weight" in weights
    # run again: the finished search is read back, nothing trained
    assert main([*argv, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["val_acc"] == winner and len(scores) == 2


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--shape", "-0.5"], "RepeatAndSelectDpEvent covers shape >= 0 only"),
        (["--mean-repetitions", "1"], "--mean-repetitions must be a finite number above 1"),
        (["--secure-mode", "--seed", "1"], "takes no seed"),
        (["--lr", "0.1,-1"], "error: argument --lr: must be a positive finite number, got -1"),
        (["--momentum", "1"], "error: argument --momentum: must lie in [0, 1), got 1"),
        (["--target-epsilon", "1", "--noise-multiplier", "1"], "not allowed with argument"),
        (["--target-delta", "2"], "--target-delta must lie in (0, 1)"),
    ],
)
def test_bad_input_is_one_error_line(tmp_path, argv, expected, capsys):
    try:
        code = main(["tune", *argv, "--output-dir", str(tmp_path / "out")])
    except SystemExit as stop:
        code = stop.code
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightning-dp tune: error:") and expected in lines[0], lines
    assert not (tmp_path / "out").exists()  # refused before anything was drawn


def test_nothing_is_printed_per_candidate_even_when_one_diverges(tmp_path, caplog, capsys):
    # seed 1 at mean 3 draws two candidates, lr 1 then lr 1e30 (whose loss is not finite: its end-of-run warning and
    # Lightning's would show that a loser existed and diverged)
    argv = ["tune", "--epochs", "1", "--lr", "1,1e30", "--mean-repetitions", "3", "--seed", "1"]
    argv += ["--batch-size", "256", "--output-dir", str(tmp_path)]
    with caplog.at_level(logging.DEBUG), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        assert main(argv) == 0
    out, err = capsys.readouterr()
    # under pytest the records go to caplog, not to a handler on stderr (imports may log at DEBUG: not a candidate's)
    candidates = [r for r in caplog.records if r.name.startswith("lightning") or r.levelno >= logging.WARNING]
    assert err == "" and not candidates and not warned, [r.getMessage() for r in candidates]
    lines = out.strip().splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("winner: lr 1, max_grad_norm 1, momentum 0.5: validation accuracy ")
    assert lines[1].startswith("the whole search: epsilon ") and lines[2].startswith("the winner's weights: ")
    assert logging.root.manager.disable == logging.NOTSET  # restored


def test_when_every_candidate_fails_the_winner_s_failure_is_printed(tmp_path, monkeypatch, capsys):
    search = lightning_dp.tuning.private_search

    def failing(train_candidate, *args, **kwargs):
        def train(candidate):
            raise RuntimeError("out of memory")

        return search(train, *args, **kwargs)

    monkeypatch.setattr(lightning_dp.tuning, "private_search", failing)
    argv = ["tune", "--epochs", "1", "--lr", "1", "--seed", "1", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == (
        "winner: lr 1, max_grad_norm 1, momentum 0.5: its training failed (RuntimeError); every candidate failed or "
        "scored NaN"
    )
    assert len(lines) == 2 and lines[1].startswith("the whole search: epsilon ")
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["failure"] == "RuntimeError"


def test_a_digits_candidate_whose_run_correlated_its_noise_stops_the_search(monkeypatch):
    """A run with BLT-correlated noise at the plan's (sigma, q, T) reports the same three numbers, but spends another
    event (epsilon 11.5 where the plan's candidate spends 1.65, sigma 1, q 0.01, 500 steps, in review):
    ``Candidate.check_spent`` compares the run's ledger with the plan's event and raises PlanMismatchError."""
    import lightning_dp.cli.demo as demo
    from lightning_dp.cli.tune import digits_candidate, digits_schedule
    from lightning_dp.tuning import Candidate, PlanMismatchError

    train_digits, runs = demo.train_digits, []

    def correlated(**options):
        runs.append(train_digits(**options, noise_correlation="blt"))
        return runs[-1]

    monkeypatch.setattr(demo, "train_digits", correlated)
    sample_rate, steps = digits_schedule(256, 1)
    train = digits_candidate(epochs=1, batch_size=256, target_delta=1e-5)
    candidate = Candidate({"lr": 0.5, "max_grad_norm": 1.0, "momentum": 0.5}, 1.0, sample_rate, steps, seed=0)
    with pytest.raises(PlanMismatchError, match=r"BLTMinSepEvent.*not the plan's \[\[PoissonSampledEvent"):
        train(candidate)
    spent = runs[0].privacy
    assert (spent["noise_multiplier"], spent["sample_rate"], spent["steps"]) == (1.0, sample_rate, steps)


def _engine(ledger: list | None, poisson_sampling: bool = True, broken_for_testing: str | None = None):
    """A stand-in for a run's ``PrivacyEngine``: its accountant with ``ledger`` (``None``: never started)."""
    import types

    accountant = None
    if ledger is not None:
        accountant = make_accountant("pld")
        accountant.ledger = ledger
    config = types.SimpleNamespace(poisson_sampling=poisson_sampling)
    return types.SimpleNamespace(accountant=accountant, config=config, broken_for_testing=broken_for_testing)


PLANNED = [[PoissonSampledEvent(0.1, GaussianEvent(1.0)), 10]]


@pytest.mark.parametrize(
    ("engine", "spent"),
    [
        (_engine(None), r"\[\]"),  # never started
        (_engine([[PoissonSampledEvent(0.1, GaussianEvent(1.0)), 9]]), "9]]"),  # a step short
        (
            _engine(
                [[PoissonSampledEvent(0.1, GaussianEvent(1.0)), 5], [PoissonSampledEvent(0.2, GaussianEvent(1.0)), 5]]
            ),
            "sample_rate=0.2",
        ),
        (_engine([[PoissonSampledEvent(0.1, LaplaceEvent(1.0, 1.0)), 10]]), "LaplaceEvent"),
        (_engine(PLANNED, poisson_sampling=False), r"shuffled fixed-size batches \(poisson_sampling=False\)"),
        (_engine(PLANNED, broken_for_testing="noise scaled by 0.5"), "broken for testing \\(noise scaled by 0.5\\)"),
    ],
)
def test_check_spent_accepts_only_poisson_sampled_runs_of_the_plans_steps_of_its_event(engine, spent):
    from lightning_dp.tuning import Candidate, PlanMismatchError

    candidate = Candidate({}, 1.0, 0.1, 10, seed=None)
    candidate.check_spent(_engine(PLANNED))
    with pytest.raises(PlanMismatchError, match=f"spent .*{spent}.*the search's epsilon would not hold"):
        candidate.check_spent(engine)


def test_an_unseeded_digits_run_initialises_its_model_from_fresh_os_entropy(monkeypatch):
    """``train_digits(seed=None)`` (every candidate of an unseeded search) seeds the model's initialisation from OS
    entropy, never from the global RNG state an earlier candidate left."""
    import lightning.pytorch as pl

    import lightning_dp.runtime.randomness as randomness
    from lightning_dp.cli.demo import train_digits

    seeds = []

    class Seeded(Exception):
        pass

    def seed_everything(seed, verbose=True):
        seeds.append(seed)
        raise Seeded

    monkeypatch.setattr(pl, "seed_everything", seed_everything)
    monkeypatch.setattr(randomness, "os_seed", lambda: (7 << 32) + 5)
    for seed in (None, 3):
        with pytest.raises(Seeded):
            train_digits(epochs=1, batch_size=128, max_grad_norm=1.0, lr=1.0, seed=seed, progress_bar=False)
    assert seeds == [7, 3]
