"""Private hyper-parameter search: a random number of candidate DP runs, the best one released, one epsilon for the
whole search (Liu & Talwar 2019; Papernot & Steinke 2022). See docs/tuning.md.

- :mod:`~lightning_dp.tuning.repetitions`: the law of the number of candidates ``K``;
- :mod:`~lightning_dp.tuning.randomness`: the search's dedicated random stream;
- :mod:`~lightning_dp.tuning.accounting`: :class:`SearchPlan`, the candidates' shared privacy and the search's epsilon;
- :mod:`~lightning_dp.tuning.space`: the search space and the uniform draw of a candidate;
- :mod:`~lightning_dp.tuning.state`: the search's files (resumable state, winner, result);
- :mod:`~lightning_dp.tuning.search`: :func:`private_search`, the runner, and :func:`silenced`, the quiet its
  candidates run in.
"""

from lightning_dp.tuning.accounting import SearchPlan
from lightning_dp.tuning.repetitions import RepetitionDistribution
from lightning_dp.tuning.search import Candidate, PlanMismatchError, SearchResult, private_search, silenced

__all__ = [
    "Candidate",
    "PlanMismatchError",
    "RepetitionDistribution",
    "SearchPlan",
    "SearchResult",
    "private_search",
    "silenced",
]
