"""A second ``fit`` of the same trainer on 2 CPU processes (gloo, ``second_fit_script.py``) continues the run's noise
stream and replays none of its batches: rank 0's seed is shared again as the second fit sets up, and sharing it must
not re-derive the streams (that replayed the first fit's noise and batches). The module's updates are pure noise, so
its parameters show the noise itself: those of two fits equal those of one fit of as many steps. (The batches are not
compared with one fit's: the loader may draw a batch past the first fit's last step.)"""

from __future__ import annotations

import torch
from process_helpers import fit_on_two_processes


def test_a_second_fit_on_two_processes_continues_the_noise_and_the_batches(tmp_path):
    ranks = fit_on_two_processes(tmp_path, script="second_fit_script.py")
    for rank in ranks:
        whole, twice = rank["whole"], rank["twice"]
        assert whole["steps"] == twice["steps"] == len(twice["updates"]) == 6
        first, second = twice["updates"][:3], twice["updates"][3:]
        assert all(not torch.equal(a, b) for a, b in zip(first, second, strict=True))  # no noise replayed
        assert all(a != b for a, b in zip(twice["batches"][:3], twice["batches"][3:], strict=True))  # none replayed
        # one 6-step fit and two fits of 3 steps draw the same stream:
        assert all(torch.equal(a, b) for a, b in zip(twice["updates"], whole["updates"], strict=True))
        assert twice["epsilon"] == whole["epsilon"]
    zero, one = ranks[0]["twice"], ranks[1]["twice"]
    assert all(torch.equal(a, b) for a, b in zip(zero["updates"], one["updates"], strict=True))
    assert zero["batches"] != one["batches"]  # each rank samples its own shard
