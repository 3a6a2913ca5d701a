"""``max_physical_batch_size`` on 2 CPU processes over gloo: each rank runs its Poisson micro-batches in passes of at
most the cap, and the update is the uncapped run's.

``cap_fit_script.py`` (Lightning's own launcher) trains an FSDP2-sharded tiny Llama under DPModelParallelStrategy
(seeded noise) and TinyRegressor under DPDDPStrategy (zero noise, 2 micro-batches per step), each without and with a
cap; ``hf_cap_script.py`` (``accelerate launch``) trains a tiny GPT-2, and an FSDP2-sharded tiny Llama, under
DPTrainer (seeded noise, 2 micro-batches) without and with a cap of 1. Checked: the parameters equal the uncapped
run's to float tolerance (with seeded noise: one noise draw per logical step, as without the cap) and are identical
on both ranks; the passes hold at most the cap and the examples of the uncapped batches; on a sharded model every rank
ran the same number of passes per micro-batch, the rank with fewer padding with stand-in batches.
"""

from __future__ import annotations

import pytest
import torch
from process_helpers import SCRIPTS, accelerate_launch, fit_on_two_processes

pytest.importorskip("transformers")


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.fixture(scope="module")
def lightning_ranks(tmp_path_factory) -> list[dict]:
    """Run cap_fit_script.py once (about a minute on 2 busy cores) and load what each rank wrote."""
    return fit_on_two_processes(tmp_path_factory.mktemp("cap_lightning"), script="cap_fit_script.py")


def test_sharded_ranks_pad_to_the_same_pass_count_and_match_the_uncapped_update(lightning_ranks) -> None:
    cap = 3
    for rank in lightning_ranks:
        plain, capped = rank["sharded"], rank["sharded, cap 3"]
        assert plain["steps"] == capped["steps"] == 3 and plain["epsilon"] == capped["epsilon"]
        _close(plain["params"], capped["params"])
        assert max(capped["batch_sizes"]) <= cap
        # the real passes hold exactly the uncapped micro-batches' examples, in passes of at most the cap
        real = [-(-size // cap) for size in plain["batch_sizes"]]  # an empty batch: stand-ins only
        assert [passes for passes, _ in capped["passes"]] == real
    a, b = (rank["sharded, cap 3"] for rank in lightning_ranks)
    for key in a["params"]:
        assert torch.equal(a["params"][key], b["params"][key]), key
    totals = [[sum(passes) for passes in rank["sharded, cap 3"]["passes"]] for rank in lightning_ranks]
    assert totals[0] == totals[1]  # the same forward/backward count on every rank, every micro-batch
    assert any(stand_ins for rank in lightning_ranks for _, stand_ins in rank["sharded, cap 3"]["passes"])


def test_replicated_ranks_run_their_own_pass_counts_under_accumulation(lightning_ranks) -> None:
    cap = 2
    for rank in lightning_ranks:
        plain, capped = rank["replicated"], rank["replicated, cap 2"]
        assert plain["steps"] == capped["steps"] == 3
        _close(plain["params"], capped["params"])
        assert max(capped["batch_sizes"]) <= cap
        assert all(stand_ins == 0 for _, stand_ins in capped["passes"])  # no padding without sharding
        assert len(capped["passes"]) == 6  # 3 steps of 2 micro-batches
    a, b = (rank["replicated, cap 2"] for rank in lightning_ranks)
    for key in a["params"]:
        assert torch.equal(a["params"][key], b["params"][key]), key


def test_dp_trainer_on_two_processes_matches_the_uncapped_update(tmp_path) -> None:
    accelerate_launch(SCRIPTS / "hf_cap_script.py", str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank in ranks:
        plain, capped = rank["uncapped"], rank["capped"]
        assert plain["steps"] == capped["steps"] == 3 and plain["epsilon"] == capped["epsilon"]
        _close(plain["params"], capped["params"])
        assert set(capped["sizes"]) == {1} and len(capped["sizes"]) == sum(plain["sizes"])
    a, b = (rank["capped"]["params"] for rank in ranks)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # sharded: every rank runs the largest pass count of the ranks (stand-in batches of one example pad the others)
    for rank in ranks:
        plain, capped = rank["sharded"], rank["sharded, capped"]
        assert plain["steps"] == capped["steps"] == 3 and plain["epsilon"] == capped["epsilon"]
        _close(plain["params"], capped["params"])
        assert set(capped["sizes"]) == {1} and len(capped["sizes"]) >= sum(plain["sizes"])
    counts = [len(rank["sharded, capped"]["sizes"]) for rank in ranks]
    assert counts[0] == counts[1]
    assert counts[0] > min(sum(rank["sharded"]["sizes"]) for rank in ranks)  # some passes were stand-ins
