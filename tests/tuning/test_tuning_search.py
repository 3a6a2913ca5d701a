"""The search runner with a stub ``train_candidate``: K drawn once and written before the first candidate, only the
winner released (a loser's artifact deleted, its score nowhere), a resume that neither draws K again nor accepts
another search, the dedicated (or, in secure mode, OS) randomness, failures scored NaN (only an all-failed winner's
released), candidates that print nothing, the winner's file times, and the refused names."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import lightning_dp.tuning.randomness as search_randomness
from lightning_dp.config import PrivacyConfig
from lightning_dp.tuning import Candidate, PlanMismatchError, RepetitionDistribution, SearchPlan, private_search
from lightning_dp.tuning.repetitions import RepetitionDistribution as Law
from lightning_dp.tuning.space import EVENT_KEEPING, PRIVACY_KEYS, validate_space
from lightning_dp.tuning.state import RESULT_FILE, STATE_FILE, SearchFolder

SPACE = {"lr": [0.01, 0.1, 1.0], "max_grad_norm": [0.5, 1.0], "momentum": [0.0, 0.9]}


def plan(mean: float = 6.0, shape: float = 1.0) -> SearchPlan:
    return SearchPlan(1.0, 0.1, 10, 1e-5, RepetitionDistribution(mean, shape))


class Stub:
    """A ``train_candidate`` whose scores are all distinct and recognisable; each candidate writes its artifact file
    into ``scratch`` and returns its ``Path``. Records every call, and the state file as it was at the call."""

    def __init__(self, scratch: Path, output_dir: Path, fail_at: int | None = None) -> None:
        self.scratch, self.output_dir, self.fail_at = scratch, output_dir, fail_at
        self.calls: list[Candidate] = []
        self.scores: list[float] = []
        self.states: list[dict] = []

    def __call__(self, candidate: Candidate) -> tuple[float, Path]:
        if len(self.calls) == self.fail_at:
            raise KeyboardInterrupt  # a kill mid-candidate
        self.states.append(json.loads((self.output_dir / STATE_FILE).read_text()))
        self.calls.append(candidate)
        score = 0.123456789 + 0.0101 * len(self.calls) * (-1) ** len(self.calls)  # distinct, not monotone
        self.scores.append(score)
        self.scratch.mkdir(exist_ok=True)
        artifact = self.scratch / f"model-{len(self.calls)}.bin"
        artifact.write_text(f"weights of candidate with score {score!r}")
        return score, artifact


def test_k_is_drawn_once_and_written_before_the_first_candidate(tmp_path):
    stub = Stub(tmp_path / "scratch", tmp_path / "out")
    private_search(stub, SPACE, plan(), tmp_path / "out", seed=1)
    k = len(stub.calls)
    assert k >= 1
    assert [len(state["candidates"]) for state in stub.states] == [k] * k
    assert [state["completed"] for state in stub.states] == list(range(k))
    assert [c.hparams for c in stub.calls] == stub.states[0]["candidates"]
    for candidate in stub.calls:
        assert (candidate.noise_multiplier, candidate.sample_rate, candidate.steps) == (1.0, 0.1, 10)
        assert not candidate.secure_mode
        assert all(candidate.hparams[name] in values for name, values in SPACE.items())
    seeds = [c.seed for c in stub.calls]
    assert len(set(seeds)) == k and all(0 <= s < 2**32 for s in seeds)  # independent runs


def test_only_the_winner_is_released(tmp_path, caplog, capsys):
    out = tmp_path / "out"
    with caplog.at_level(logging.DEBUG):
        for seed in range(20):  # a seed with several candidates
            stub = Stub(tmp_path / f"scratch-{seed}", out / str(seed))
            result = private_search(stub, SPACE, plan(), out / str(seed), seed=seed)
            if len(stub.calls) >= 3:
                break
    best = max(range(len(stub.scores)), key=stub.scores.__getitem__)
    assert result.score == stub.scores[best]
    assert result.hparams == stub.calls[best].hparams
    assert result.artifact == out / str(seed) / "winner.bin"
    assert result.artifact.read_text() == f"weights of candidate with score {stub.scores[best]!r}"
    assert sorted(p.name for p in (out / str(seed)).iterdir()) == [RESULT_FILE, STATE_FILE, "winner.bin"]
    assert not any((tmp_path / f"scratch-{seed}").iterdir())  # the losers' artifacts are deleted
    released = json.loads((out / str(seed) / RESULT_FILE).read_text())
    assert set(released) == {"hparams", "score", "epsilon", "delta", "candidate_epsilon", "plan", "artifact", "failure"}
    assert released["failure"] is None and result.failure is None
    state = json.loads((out / str(seed) / STATE_FILE).read_text())
    assert set(state) == {"fingerprint", "finished"}  # K and the drawn candidates are gone
    seen = caplog.text + "".join(capsys.readouterr()) + "".join(p.read_text() for p in (out / str(seed)).iterdir())
    losers = [repr(score) for i, score in enumerate(stub.scores) if i != best]
    assert not any(loser[:8] in seen for loser in losers)
    assert repr(result.score)[:8] in seen


def test_a_resume_reads_k_and_continues_without_training_a_completed_or_interrupted_candidate(tmp_path, monkeypatch):
    out = tmp_path / "out"
    for seed in range(50):
        first = Stub(tmp_path / "scratch", out / str(seed), fail_at=2)
        try:
            private_search(first, SPACE, plan(), out / str(seed), seed=seed)
        except KeyboardInterrupt:
            break
    folder = out / str(seed)
    drawn = json.loads((folder / STATE_FILE).read_text())["candidates"]
    assert len(drawn) > 2 and len(first.calls) == 2

    def no_draw(self, uniform):  # noqa: ARG001
        raise AssertionError("K drawn again")

    monkeypatch.setattr(Law, "sample", no_draw)
    assert json.loads((folder / STATE_FILE).read_text())["running"] == 2  # named before it started
    again = Stub(tmp_path / "scratch", folder)
    result = private_search(again, SPACE, plan(), folder, seed=seed + 1)  # another seed cannot change K
    # the interrupted candidate 2 scores NaN: not trained again with fresh noise (an unaccounted retry)
    assert [c.hparams for c in first.calls + again.calls] == drawn[:2] + drawn[3:]
    assert len(again.calls) == len(drawn) - 3
    scores = first.scores + again.scores
    assert result.score == max(scores)
    assert len(list(folder.glob("candidate-*"))) == 0 and len(list(folder.glob("winner*"))) == 1
    # finished: read back, nothing trained
    later = Stub(tmp_path / "scratch", folder)
    assert private_search(later, SPACE, plan(), folder).hparams == result.hparams and not later.calls


@pytest.mark.parametrize(
    ("space", "search_plan", "higher"),
    [
        ({**SPACE, "lr": [0.01, 0.1]}, plan(), True),
        (SPACE, plan(mean=7.0), True),
        (SPACE, SearchPlan(1.2, 0.1, 10, 1e-5, RepetitionDistribution(6.0, 1.0)), True),
        (SPACE, plan(), False),
    ],
)
def test_a_resume_refuses_another_search(tmp_path, space, search_plan, higher):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        private_search(Stub(tmp_path / "s", out, fail_at=0), SPACE, plan(), out, seed=0)
    with pytest.raises(ValueError, match="holds a search with another search space, plan or direction"):
        private_search(Stub(tmp_path / "s", out), space, search_plan, out, higher_is_better=higher)


def test_the_draws_come_from_a_dedicated_generator_not_the_global_ones(tmp_path):
    random.seed(0), np.random.seed(0), torch.manual_seed(0)  # noqa: NPY002  (the global generators, on purpose)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())  # noqa: NPY002
    calls = []
    private_search(lambda c: (calls.append(c.hparams) or 1.0, None), SPACE, plan(), tmp_path, seed=5)
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1])  # noqa: NPY002
    assert torch.equal(torch.get_rng_state(), before[2])
    repeat = []
    private_search(lambda c: (repeat.append(c.hparams) or 1.0, None), SPACE, plan(), tmp_path / "again", seed=5)
    assert repeat == calls  # the seed alone decides K and the draws


def test_secure_mode_draws_k_and_every_hyper_parameter_from_fresh_os_entropy(tmp_path, monkeypatch):
    entropy = []

    def os_seed() -> int:
        entropy.append(len(entropy))
        return 1234 + len(entropy)

    monkeypatch.setattr(search_randomness, "os_seed", os_seed)
    calls = []
    private_search(lambda c: (calls.append(c) or 1.0, None), SPACE, plan(), tmp_path, secure_mode=True)
    # one for K, then one per hyper-parameter of every candidate
    assert len(entropy) == 1 + len(calls) * len(SPACE)
    assert all(c.seed is None and c.secure_mode for c in calls)  # the runs are told to be secure too
    with pytest.raises(ValueError, match="secure_mode draws from the OS CSPRNG and takes no seed"):
        private_search(lambda c: (1.0, None), SPACE, plan(), tmp_path / "seeded", secure_mode=True, seed=1)


def test_no_candidate_under_the_poisson_law_releases_nothing(tmp_path):
    for seed in range(50):
        calls = []
        result = private_search(
            lambda c, calls=calls: (calls.append(c) or 1.0, None),
            SPACE,
            plan(1.01, math.inf),
            tmp_path / str(seed),
            seed=seed,
        )
        if not calls:
            break
    assert not calls and not result.released
    assert result.hparams is None and result.score is None and result.artifact is None
    assert result.epsilon == plan(1.01, math.inf).epsilon  # the empty output is covered by the same epsilon


def test_object_artifacts_are_saved_and_lower_scores_can_be_better(tmp_path):
    scores = iter([3.0, math.nan, 1.0, 2.0, 0.5, 4.0, 0.25, 5.0] * 10)
    calls = []

    def train(candidate: Candidate) -> tuple[float, dict]:
        score = next(scores)
        calls.append(score)
        return score, {"weights": torch.full((2,), score)}

    result = private_search(train, SPACE, plan(), tmp_path, seed=3, higher_is_better=False)
    best = min(s for s in calls if not math.isnan(s))
    assert result.score == best
    assert torch.equal(result.artifact["weights"], torch.full((2,), best))
    assert (tmp_path / "winner.saved.pt").is_file() and not list(tmp_path.glob("candidate-*"))


@pytest.mark.parametrize("returned", [0.5, ("0.93", None), (torch.ones(3), None)])
def test_a_malformed_return_is_a_failure_that_names_its_type_never_its_value(tmp_path, returned):
    result = private_search(lambda c: returned, SPACE, plan(), tmp_path, seed=0)
    assert result.failure == "TypeError" and math.isnan(result.score) and result.artifact is None
    assert "0.93" not in (tmp_path / RESULT_FILE).read_text()


def test_an_artifact_that_cannot_be_stored_fails_its_candidate_and_the_search_goes_on(tmp_path):
    """A returned path that does not exist (or a disk that is full): the candidate scores NaN as if its training had
    raised, instead of stopping the search before it is completed (a restart would train it again)."""
    calls = []

    def train(candidate: Candidate) -> tuple[float, Path]:
        calls.append(candidate)
        return (2.0, tmp_path / "missing.bin") if len(calls) == 1 else (1.0, None)

    result = private_search(train, SPACE, plan(), tmp_path / "out", seed=2)
    assert len(calls) >= 2 and result.score == 1.0 and result.failure is None
    state = json.loads((tmp_path / "out" / STATE_FILE).read_text())
    assert state == {"fingerprint": state["fingerprint"], "finished": True}


def test_a_plan_mismatch_stops_the_search(tmp_path):
    """The run spent another event than the plan's: the search's epsilon would not hold, so it stops (not a NaN)."""

    def train(candidate: Candidate) -> tuple[float, None]:
        raise PlanMismatchError("a candidate ran with another noise")

    with pytest.raises(PlanMismatchError, match="another noise"):
        private_search(train, SPACE, plan(), tmp_path, seed=0)
    assert not (tmp_path / RESULT_FILE).exists()


class Failing(Stub):
    """:class:`Stub`, raising (after writing its artifact) for ``lr = 0.01``, with a message about its data."""

    def __call__(self, candidate: Candidate) -> tuple[float, Path]:
        score, artifact = super().__call__(candidate)
        if candidate.hparams["lr"] == 0.01:
            raise FloatingPointError(f"the loss of Ada Lovelace's example diverged at score {score!r}")
        return score, artifact


def test_a_failing_candidate_scores_nan_and_nothing_about_it_is_released(tmp_path, caplog, capsys):
    for seed in range(50):  # a search with failing and succeeding candidates
        out = tmp_path / "out" / str(seed)
        stub = Failing(tmp_path / f"scratch-{seed}", out)
        with caplog.at_level(logging.DEBUG):
            result = private_search(stub, SPACE, plan(), out, seed=seed)
        lrs = [c.hparams["lr"] for c in stub.calls]
        if 0.01 in lrs[:-1] and {0.1, 1.0} & set(lrs):
            break
    succeeded = [i for i, lr in enumerate(lrs) if lr != 0.01]
    best = max(succeeded, key=stub.scores.__getitem__)
    assert result.score == stub.scores[best] and result.hparams == stub.calls[best].hparams
    assert result.failure is None
    seen = caplog.text + "".join(capsys.readouterr()) + "".join(p.read_text() for p in out.iterdir())
    assert "FloatingPointError" not in seen and "Lovelace" not in seen and "diverged" not in seen
    losers = [repr(score) for i, score in enumerate(stub.scores) if i != best]
    assert not any(loser[:8] in seen for loser in losers)
    assert sorted(p.name for p in out.iterdir()) == [RESULT_FILE, STATE_FILE, "winner.bin"]


def test_a_failed_candidate_is_completed_and_a_restart_does_not_train_it_again(tmp_path):
    calls: list[Candidate] = []

    def train(candidate: Candidate) -> tuple[float, None]:
        calls.append(candidate)
        if len(calls) == 1:
            raise ValueError("a data-dependent failure")
        if len(calls) == 2:
            raise KeyboardInterrupt  # a kill: stops the search
        return 1.0, None

    with pytest.raises(KeyboardInterrupt):
        private_search(train, SPACE, plan(), tmp_path, seed=2)
    state = json.loads((tmp_path / STATE_FILE).read_text())
    assert state["completed"] == 1 and state["running"] == 1 and len(state["candidates"]) > 2
    result = private_search(train, SPACE, plan(), tmp_path, seed=2)
    # neither the failed candidate nor the interrupted one is trained again
    assert [c.hparams for c in calls[2:]] == state["candidates"][2:]
    assert result.score == 1.0 and result.failure is None


def test_a_candidate_interrupted_when_all_others_fail_is_released_as_interrupted(tmp_path):
    calls = []

    def train(candidate: Candidate) -> tuple[float, None]:
        calls.append(candidate)
        if len(calls) == 1:
            raise KeyboardInterrupt
        raise RuntimeError("out of memory")

    with pytest.raises(KeyboardInterrupt):
        private_search(train, SPACE, plan(), tmp_path, seed=4)
    result = private_search(train, SPACE, plan(), tmp_path, seed=4)
    assert result.hparams == calls[0].hparams and result.failure == "interrupted" and math.isnan(result.score)


def test_when_every_candidate_fails_the_winner_s_failure_is_released(tmp_path):
    calls = []

    def train(candidate: Candidate) -> tuple[float, None]:
        calls.append(candidate)
        raise RuntimeError(f"out of memory at lr {candidate.hparams['lr']}")

    result = private_search(train, SPACE, plan(), tmp_path, seed=4)
    assert len(calls) >= 2  # the first failure did not stop the search
    assert result.hparams == calls[0].hparams  # NaN ties go to the first candidate
    assert result.failure == "RuntimeError"  # the type only: a message may name values of the data
    assert math.isnan(result.score) and result.artifact is None
    released = json.loads((tmp_path / RESULT_FILE).read_text())
    assert released["failure"] == result.failure
    trained = len(calls)
    assert private_search(train, SPACE, plan(), tmp_path).failure == result.failure  # read back, not trained
    assert len(calls) == trained


def test_the_candidates_print_nothing_and_the_output_is_restored_after(tmp_path, caplog, capsys):
    library = logging.getLogger("lightning_dp")

    def train(candidate: Candidate) -> tuple[float, None]:
        library.warning("Some examples had a non-finite loss")
        logging.getLogger("lightning.pytorch").error("a candidate's error")
        warnings.warn("a candidate's warning", UserWarning, stacklevel=1)
        print("a candidate's line")
        print("a candidate's error line", file=sys.stderr)
        return 1.0, None

    with caplog.at_level(logging.DEBUG), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        private_search(train, SPACE, plan(), tmp_path / "quiet", seed=0)
        assert not caplog.records and not warned and capsys.readouterr() == ("", "")
        assert logging.root.manager.disable == logging.NOTSET
        library.warning("after the search")
        warnings.warn("after the search", UserWarning, stacklevel=1)
        print("after the search")
        assert [r.getMessage() for r in caplog.records] == ["after the search"] and len(warned) == 1
        assert capsys.readouterr().out == "after the search\n"
        private_search(train, SPACE, plan(), tmp_path / "loud", seed=0, quiet=False)  # for debugging only
        assert "a candidate's line" in capsys.readouterr().out and len(warned) > 1


def test_the_winner_s_file_times_are_those_of_the_finish(tmp_path):
    """The kept artifact's times would date the winner's training; the gap to result.json's would count the
    candidates trained after it."""
    old = 1_000_000_000.0  # 2001

    def artifact(kind: str, score: float) -> Path:
        path = tmp_path / "scratch" / f"{kind}-{int(100 * score)}{'.bin' if kind == 'file' else ''}"
        if kind == "file":
            path.parent.mkdir(exist_ok=True)
            path.write_text("weights")
            written = [path]
        else:
            (path / "sub").mkdir(parents=True)
            (path / "sub" / "model.bin").write_text("weights")
            (path / "config.json").write_text("{}")
            written = [path / "sub" / "model.bin", path / "config.json", path / "sub", path]
        for item in written:
            os.utime(item, (old, old))
        return path

    for kind in ("file", "folder"):
        scores = iter([3.0, 1.0, 2.0, 0.5] * 20)
        started = time.time()

        def train(candidate: Candidate, kind: str = kind, scores: Iterator[float] = scores) -> tuple[float, Path]:
            score = next(scores)
            return score, artifact(kind, score)

        result = private_search(train, SPACE, plan(), tmp_path / kind, seed=3)
        winner = result.artifact
        assert winner.name == ("winner.bin" if kind == "file" else "winner")
        paths = [winner, *winner.rglob("*")] if kind == "folder" else [winner]
        assert len(paths) == (4 if kind == "folder" else 1)
        for path in paths:
            stat = path.stat()
            assert stat.st_mtime >= started and stat.st_atime >= started and stat.st_ctime >= started, path
        if kind == "folder":
            assert (winner / "sub" / "model.bin").read_text() == "weights"
        assert not list((tmp_path / kind).glob("candidate-*"))


def test_a_crash_in_finish_leaves_a_winner_and_no_candidate_behind(tmp_path, monkeypatch):
    def train(candidate: Candidate) -> tuple[float, dict]:
        return 1.0, {"weights": torch.ones(2)}

    remove = SearchFolder._remove_candidates

    def crash(self):  # noqa: ARG001
        raise KeyboardInterrupt

    monkeypatch.setattr(SearchFolder, "_remove_candidates", crash)
    with pytest.raises(KeyboardInterrupt):  # after the state was reduced, before the candidate was deleted
        private_search(train, SPACE, plan(), tmp_path, seed=0)
    assert list(tmp_path.glob("candidate-*")) and (tmp_path / "winner.saved.pt").is_file()
    monkeypatch.setattr(SearchFolder, "_remove_candidates", remove)
    result = private_search(train, SPACE, plan(), tmp_path, seed=0)
    assert not list(tmp_path.glob("candidate-*")) and torch.equal(result.artifact["weights"], torch.ones(2))


@pytest.mark.parametrize(
    ("space", "message"),
    [
        ({"batch_size": [64, 128]}, "search_space varies 'batch_size', which changes each candidate's privacy event"),
        ({"noise_multiplier": [1.0]}, "search_space varies 'noise_multiplier'"),
        ({}, "search_space must be a non-empty mapping"),
        ({"lr": []}, r"search_space\['lr'\] must be a non-empty list"),
        ({"lr": "0.1"}, r"search_space\['lr'\] must be a non-empty list"),
        ({"lr": [[0.1]]}, "may hold strings, numbers, bools and None only"),
    ],
)
def test_bad_search_spaces_are_refused_before_anything_is_drawn(tmp_path, space, message):
    with pytest.raises(ValueError, match=message):
        private_search(lambda c: (1.0, None), space, plan(), tmp_path / "out", seed=0)
    assert not (tmp_path / "out").exists()


#: names the privacy review listed as changing the event, adding a release or setting a seed
REFUSED = [
    "noise_multiplier", "target_epsilon", "target_delta", "noise", "noise_params", "accountant", "sample_rate",
    "poisson_sampling", "disable_dp", "noise_correlation", "correlation_band", "target_unclipped_quantile",
    "unclipped_num_std", "clipbound_learning_rate", "min_clipbound", "max_clipbound", "user_key", "privacy_unit",
    "examples_per_user", "clipping", "projection_dim", "seed", "dp_seed", "secure_mode", "batch_size",
    "per_device_train_batch_size", "train_batch_size", "gradient_accumulation_steps", "accumulate_grad_batches",
    "limit_train_batches", "epochs", "max_epochs", "num_train_epochs", "steps", "max_steps",
]  # fmt: skip
#: options that keep the event (their documentation in PrivacyConfig says so)
ACCEPTED = [
    "max_grad_norm", "per_sample_max_grad_norm", "clipping_fn", "automatic_clipping_gamma", "clipping_groups",
    "momentum_length", "momentum_beta", "lowpass", "augmentation_multiplicity", "max_physical_batch_size",
    "per_example_reduction", "lr", "momentum", "weight_decay",
]  # fmt: skip


@pytest.mark.parametrize("name", REFUSED)
def test_every_setting_that_changes_the_event_is_refused(name):
    with pytest.raises(ValueError, match=f"search_space varies '{name}', which changes each candidate's privacy"):
        validate_space({name: [1, 2]})


@pytest.mark.parametrize("name", ACCEPTED)
def test_settings_that_keep_the_event_are_accepted(name):
    assert validate_space({name: [1, 2]}) == {name: [1, 2]}


def test_the_refused_set_is_built_from_the_option_classes():
    """Every option of ``PrivacyConfig`` and ``PrivacyArguments`` is refused unless it is allowed by name: a new
    option is refused until it is shown to keep the event."""
    config = {field.name for field in dataclasses.fields(PrivacyConfig)}
    assert config - EVENT_KEEPING <= PRIVACY_KEYS
    assert not EVENT_KEEPING & PRIVACY_KEYS
    pytest.importorskip("transformers")
    from lightning_dp.hf import PrivacyArguments

    hf = {field.name for field in dataclasses.fields(PrivacyArguments)}
    assert hf - EVENT_KEEPING <= PRIVACY_KEYS
    assert EVENT_KEEPING <= config | hf  # no allowed name that is not an option
