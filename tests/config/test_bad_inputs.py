"""Every rejected input of tests/bad_inputs.py fails with its message (the registry also generates the docs)."""

from __future__ import annotations

import re

import pytest
from bad_inputs import CASES, BadInput, failure


def test_at_least_30_cases_over_every_surface():
    assert len(CASES) >= 30
    surfaces = {case.surface for case in CASES}
    assert {"DPStrategy", "Lightning fit", "HF PrivacyArguments", "HF DPTrainer", "CLI", "YAML config"} <= surfaces


@pytest.mark.parametrize("case", CASES, ids=[f"{c.surface}: {c.value}" for c in CASES])
def test_bad_input_is_rejected_with_its_message(case: BadInput):
    message, where = failure(case)
    assert re.search(case.match, message, re.DOTALL), f"{message!r} does not match {case.match!r}"
    assert where != "(outside lightning_dp)" or case.surface in ("CLI", "YAML config"), message
