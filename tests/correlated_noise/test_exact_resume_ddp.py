"""``exact_resume=True`` on 2 CPU processes (gloo) through ``DPDDPStrategy`` (``ddp_fit_script.py --exact-resume``):
rank 0's checkpoint holds the secret state the ranks share (the base seed, the noise generators' states and the
banded noise stream, identical on every rank), each rank keys its sampling by the step and its rank, so a run resumed
from the end of its first epoch (mid-stream for band 2) equals the uninterrupted 2-process run: every rank's batches,
parameters bit for bit, and one segment of the ledger. Unseeded, with the training loader built in the module's
``setup`` (it reads ``estimated_stepping_batches``), before Lightning restores the checkpoint: each rank still samples
its own shard at the global rate, from rank 0's partition, restored. The checkpoint holds both ranks' global random
states (dropout's generators)."""

from __future__ import annotations

import torch
from process_helpers import fit_on_two_processes


def test_an_exact_resume_on_two_processes_equals_the_uninterrupted_run(tmp_path):
    options = ["--banded", "2", "--exact-resume", "--estimate-steps", "--unseeded", "--max-epochs", "2"]
    whole = fit_on_two_processes(tmp_path / "whole", *options)
    (cut,) = (tmp_path / "whole" / "ckpt").glob("epoch=0-*.ckpt")
    resumed = fit_on_two_processes(tmp_path / "resumed", *options, "--resume", str(cut))
    states = torch.load(cut, weights_only=True)["lightning_dp"]["exact_resume"]["global_randomness"]
    assert len(states) == 2  # each rank's global random state, gathered into rank 0's checkpoint
    per_epoch = 4  # ceil(1 / q)
    for got, want in zip(resumed, whole, strict=True):
        assert got["steps"] == want["steps"] == 2 * per_epoch
        assert got["batches"] == want["batches"][per_epoch:] and any(got["batches"])
        assert all(torch.equal(p, q) for p, q in zip(got["params"], want["params"], strict=True))
        assert got["ledger"] == want["ledger"]
        assert [event["segment"] for event, _ in got["ledger"]["ledger"]] == [0]
        assert got["sample_rate"] == 8 * 2 / 64  # batch 8 on each of 2 processes, N = 64: not a one-process rate
        groups = whole[0]["groups"]  # the run's one partition (an exact resume keeps its key)
        for t, batch in enumerate(got["batches"], start=per_epoch):
            assert all(i % 2 == got["rank"] and groups[i] == t % 2 for i in batch)
