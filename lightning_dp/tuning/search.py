"""Private hyper-parameter search: train a random number ``K`` of candidates, each with hyper-parameters drawn
uniformly from the search space, and release only the best (Liu & Talwar 2019; Papernot & Steinke 2022, Theorems 2
and 6). What the guarantee covers and what it does not: docs/tuning.md; the argument: docs/design.md section 3.7.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_dp.accounting.events import GaussianEvent, PoissonSampledEvent
from lightning_dp.tuning.accounting import SearchPlan
from lightning_dp.tuning.randomness import SearchRandomness
from lightning_dp.tuning.space import draw_candidate, validate_space
from lightning_dp.tuning.state import SearchFolder, SearchState, remove

if TYPE_CHECKING:
    from lightning_dp.engine.privacy_engine import PrivacyEngine

#: The failure of a candidate whose process stopped while it trained (a kill, a crash, ``KeyboardInterrupt``): the
#: restart scores it NaN.
INTERRUPTED = "interrupted"


class PlanMismatchError(RuntimeError):
    """Raised by a ``train_candidate`` whose run spent another privacy event than the plan's: the search's epsilon
    would not hold, so :func:`private_search` stops instead of scoring it NaN (the check depends on the configuration,
    not on the data)."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What one candidate trains with: its drawn hyper-parameters and the privacy every candidate shares.

    Attributes:
        hparams: one value per name of the search space.
        noise_multiplier: ``sigma`` to train with (``DPStrategy(noise_multiplier=...)``, ``PrivacyArguments``).
        sample_rate: the Poisson rate ``q`` to train with.
        steps: the number of optimizer steps ``T`` to train for.
        seed: the seed of the candidate's own run (derived per candidate from a seeded search), or ``None`` (OS
            entropy; always in secure mode).
        secure_mode: the search's ``secure_mode``, for the run's own (``DPStrategy(secure_mode=...)``).
    """

    hparams: dict[str, Any]
    noise_multiplier: float
    sample_rate: float
    steps: int
    seed: int | None
    secure_mode: bool = False

    def check_spent(self, privacy_engine: PrivacyEngine) -> None:
        """Check that the candidate's finished run spent what the plan accounts for: Poisson sampling
        (``poisson_sampling=True``) and an accountant ledger of exactly ``steps`` optimizer steps of
        ``PoissonSampledEvent(sample_rate, GaussianEvent(noise_multiplier))``, DP-SGD with independent Gaussian noise
        (:meth:`SearchPlan.candidate_event <lightning_dp.tuning.accounting.SearchPlan.candidate_event>`). Call it after
        the training in ``train_candidate`` with the run's ``privacy_engine`` (``DPStrategy``'s or ``DPTrainer``'s
        attribute). A run with another noise, correlated noise, a randomized clipping engine, the framework's shuffled
        batches, a test callback that breaks the mechanism, another rate or another number of steps fails, whatever
        its three numbers say.

        Raises:
            PlanMismatchError: what the run spent differs (the search's epsilon would not hold for it), or the run
                never started.
        """
        accountant = privacy_engine.accountant
        ledger = [] if accountant is None else accountant.ledger  # [[event, count], ...]
        planned = [[PoissonSampledEvent(self.sample_rate, GaussianEvent(self.noise_multiplier)), self.steps]]
        if not privacy_engine.config.poisson_sampling:
            spent = "shuffled fixed-size batches (poisson_sampling=False)"
        elif privacy_engine.broken_for_testing:
            spent = f"a mechanism broken for testing ({privacy_engine.broken_for_testing})"
        elif ledger != planned:
            spent = str(ledger)
        else:
            return
        raise PlanMismatchError(
            f"the candidate's run spent {spent}, not the plan's {planned} (steps of DP-SGD with Poisson sampling and "
            "independent Gaussian noise at the candidate's noise_multiplier and sample_rate): the search's epsilon "
            "would not hold for it"
        )


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """What a search releases.

    Attributes:
        hparams: the winner's hyper-parameters (``None`` when no candidate ran, ``K = 0`` under the Poisson law).
        score: the winner's score (``None`` likewise).
        artifact: the winner's artifact in the output folder: the object, or the ``Path`` it was moved to.
        epsilon: epsilon of the whole search at ``delta``.
        delta: the plan's ``target_delta``.
        candidate_epsilon: epsilon of one candidate alone (for comparison only).
        output_dir: the search's folder (``result.json``, the winner).
        failure: the name of the exception type when the winner's ``train_candidate`` raised or its artifact could
            not be stored, or ``"interrupted"`` when its process stopped during it (it wins only when every candidate
            failed or scored NaN), else ``None``. A loser's failure is never released, nor any failure's message.
    """

    hparams: dict[str, Any] | None
    score: float | None
    artifact: Any
    epsilon: float
    delta: float
    candidate_epsilon: float
    output_dir: Path
    failure: str | None = None

    @property
    def released(self) -> bool:
        """Whether a winner was released (False when ``K = 0``)."""
        return self.hparams is not None


def _score(returned: Any) -> tuple[float, Any]:
    """``(score, artifact)`` from what ``train_candidate`` returned. The messages name types, never values: a
    loser's score must not reach the output."""
    if not (isinstance(returned, tuple) and len(returned) == 2):
        raise TypeError(f"train_candidate must return a (score, artifact) pair, got a {type(returned).__name__}")
    score, artifact = returned
    if isinstance(score, str | bytes | bool):
        raise TypeError(f"train_candidate's score must be a real number, got a {type(score).__name__}")
    try:
        return float(score), artifact
    except (TypeError, ValueError):
        raise TypeError(f"train_candidate's score must be a real number, got a {type(score).__name__}") from None


@contextlib.contextmanager
def silenced() -> Iterator[None]:
    """Nothing printed while the block runs: every logging record is discarded (``logging.disable``: the library's,
    Lightning's, HF's and the caller's own loggers), Python warnings are ignored, and ``sys.stdout`` and
    ``sys.stderr`` write to ``os.devnull``; all restored afterwards. :func:`private_search` trains its candidates
    inside it unless ``quiet=False``: a line printed per candidate (a non-finite loss, a diverged run, a framework
    warning) would show that a loser existed and what it did, and their number would bound ``K``."""
    disabled = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with (
            warnings.catch_warnings(),
            open(os.devnull, "w", encoding="utf-8") as null,
            contextlib.redirect_stdout(null),
            contextlib.redirect_stderr(null),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(disabled)


def _better(score: float, best: float, higher_is_better: bool) -> bool:
    """Strictly better (the first of equal scores wins); NaN ranks below every number."""
    if math.isnan(score):
        return False
    return math.isnan(best) or (score > best if higher_is_better else score < best)


def private_search(
    train_candidate: Callable[[Candidate], tuple[float, Any]],
    search_space: Mapping[str, Sequence[Any]],
    plan: SearchPlan,
    output_dir: str | Path,
    *,
    seed: int | None = None,
    secure_mode: bool = False,
    higher_is_better: bool = True,
    quiet: bool = True,
) -> SearchResult:
    """Run a private search, or resume or read back the one in ``output_dir``.

    ``K`` is drawn once from ``plan.repetitions`` and the ``K`` candidates' hyper-parameters uniformly from
    ``search_space``, all from a dedicated generator, and written to ``output_dir`` before the first candidate runs.
    Each call ``train_candidate(candidate)`` must be one DP run of this library with ``candidate.noise_multiplier``,
    ``candidate.sample_rate`` and ``candidate.steps``, its model initialised from ``candidate.seed`` or, when that is
    ``None``, from fresh OS entropy (the candidates must be independent runs: not from the global RNG state the last
    one left), and return ``(score, artifact)``: the score on data the caller declares public (a held-out split),
    higher better unless ``higher_is_better=False``, and the trained model (any object, saved with ``torch.save``, or
    a ``Path`` the run wrote, moved into ``output_dir``; ``None`` for none). Only the best is kept: a beaten artifact is
    deleted, and no loser's score is written, logged or returned. A candidate whose ``train_candidate`` raises an
    ``Exception`` (a diverged run, out of memory, a malformed return) or whose artifact cannot be stored scores NaN,
    so it wins only when every candidate does: its exception type is released only then, as
    :attr:`SearchResult.failure`. A :class:`PlanMismatchError`, ``KeyboardInterrupt`` and other ``BaseException``
    stop the search. A restart with the same arguments continues where the last one stopped: a candidate whose
    process stopped during it (a kill, a crash, an interrupt) scores NaN, failure ``"interrupted"``, rather than
    train again with fresh noise; a finished search's result is returned without training.

    Args:
        train_candidate: trains one candidate.
        search_space: ``{name: [values]}``, hyper-parameters that keep the privacy event (e.g. learning rate,
            ``max_grad_norm``, momentum); see :func:`~lightning_dp.tuning.space.validate_space`.
        plan: the shared privacy of the candidates and the law of ``K`` (:class:`SearchPlan`, or
            :meth:`SearchPlan.for_target_epsilon`).
        output_dir: the search's folder: its state (private while it runs), the winner and ``result.json``.
        seed: for experiments only: ``K``, the draws and the candidates' seeds become reproducible, and known to whoever
            knows the seed, which voids the guarantee. ``None``: OS entropy.
        secure_mode: draw ``K`` and the hyper-parameters from fresh OS entropy at every draw (no seed), and set
            ``candidate.secure_mode`` for the runs.
        higher_is_better: whether a larger score is better.
        quiet: train the candidates inside :func:`silenced` (no log line, warning or output of any candidate);
            ``False`` lets them print, for debugging: what they print is outside the guarantee.

    Returns:
        The :class:`SearchResult`; nothing is released when ``K = 0`` (Poisson law only).

    Raises:
        ValueError: a bad search space, a seed with ``secure_mode``, or an ``output_dir`` holding another search.
    """
    space = validate_space(search_space)
    randomness = SearchRandomness(seed, secure=secure_mode)
    fingerprint = {"space": space, "plan": plan.describe(), "higher_is_better": bool(higher_is_better)}
    folder = SearchFolder(output_dir, fingerprint)
    released = folder.finished_result()
    if released is None:
        state = folder.load()
        if state is None:
            count = plan.repetitions.sample(randomness.uniform())
            state = SearchState(folder.fingerprint, [draw_candidate(space, randomness) for _ in range(count)])
            folder.save(state)
        elif state.running is not None:  # its process stopped during it: a retry would be unaccounted
            _complete(folder, state, state.running, math.nan, None, INTERRUPTED, higher_is_better)
        with silenced() if quiet else contextlib.nullcontext():
            _train(train_candidate, plan, folder, state, randomness, higher_is_better)
        best = state.best
        released = folder.finish(
            state,
            {
                "hparams": state.candidates[best["candidate"]] if best else None,
                "score": best["score"] if best else None,
                "failure": best.get("failure") if best else None,
                "epsilon": plan.epsilon,
                "delta": plan.target_delta,
                "candidate_epsilon": plan.candidate_epsilon,
                "plan": plan.describe(),
            },
        )
    return SearchResult(
        hparams=released["hparams"],
        score=released["score"],
        artifact=folder.load_artifact(released["artifact"]),
        epsilon=released["epsilon"],
        delta=released["delta"],
        candidate_epsilon=released["candidate_epsilon"],
        output_dir=folder.path,
        failure=released.get("failure"),
    )


def _train(
    train_candidate: Callable[[Candidate], tuple[float, Any]],
    plan: SearchPlan,
    folder: SearchFolder,
    state: SearchState,
    randomness: SearchRandomness,
    higher_is_better: bool,
) -> None:
    """Train the candidates not yet completed, keeping the best's score and artifact in ``state`` and ``folder``; a
    candidate that raises an ``Exception`` scores NaN, its failure kept in ``state`` only while it is the best. The
    state names each candidate before it trains (``running``)."""
    for index in range(state.completed, len(state.candidates)):
        candidate = Candidate(
            dict(state.candidates[index]),
            plan.noise_multiplier,
            plan.sample_rate,
            int(plan.steps),
            randomness.candidate_seed(index),
            randomness.secure,
        )
        state.running = index
        folder.save(state)
        score, artifact, failure = _run(train_candidate, candidate)
        _complete(folder, state, index, score, artifact, failure, higher_is_better)


def _complete(
    folder: SearchFolder,
    state: SearchState,
    index: int,
    score: float,
    artifact: Any,
    failure: str | None,
    higher_is_better: bool,
) -> None:
    """Record candidate ``index`` as completed: the best so far keeps its artifact in ``folder`` (a storage error
    fails the candidate, NaN, like an error of its training), a beaten one's is deleted; then save ``state``."""
    if state.best is None or _better(score, state.best["score"], higher_is_better):
        try:
            kept = folder.keep_artifact(index, artifact)
        except Exception as error:  # a full disk, a missing path, an object that cannot be saved: data may decide
            _discard(artifact)
            score, kept, failure = math.nan, None, type(error).__name__
        if state.best is None or _better(score, state.best["score"], higher_is_better):
            previous = state.best["artifact"] if state.best else None
            state.best = {"candidate": index, "score": score, "artifact": kept}
            if failure is not None:
                state.best["failure"] = failure
            _finish_candidate(folder, state, index)
            if previous is not None:
                remove(folder.path / previous)
            return
    else:
        _discard(artifact)
    _finish_candidate(folder, state, index)


def _finish_candidate(folder: SearchFolder, state: SearchState, index: int) -> None:
    state.completed, state.running = index + 1, None
    folder.save(state)


def _discard(artifact: Any) -> None:
    """Delete an artifact the candidate wrote (a ``Path``); an object needs nothing."""
    if isinstance(artifact, Path):
        remove(artifact)


def _run(
    train_candidate: Callable[[Candidate], tuple[float, Any]], candidate: Candidate
) -> tuple[float, Any, str | None]:
    """``(score, artifact, None)`` of one candidate, or ``(nan, None, "<exception type>")`` when ``train_candidate``
    raised an ``Exception`` or returned something other than ``(real score, artifact)`` (a returned ``Path`` is then
    deleted). Whether a candidate fails may depend on the data, so a failure is a score like any other, not an error
    that would stop the search, show a loser, and make a restart train it again with fresh noise; its message, which
    may name values of the data, is dropped. A :class:`PlanMismatchError` stops the search."""
    returned: Any = None
    try:
        returned = train_candidate(candidate)
        score, artifact = _score(returned)
    except PlanMismatchError:
        raise
    except Exception as error:
        if isinstance(returned, tuple) and len(returned) == 2:
            _discard(returned[1])
        return math.nan, None, type(error).__name__
    return score, artifact, None
