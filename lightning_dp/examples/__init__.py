"""Runnable ``DPTrainer`` examples (docs/hf.md): SST-2 with a MiniLM encoder, LoRA on SmolLM2 over E2E.

Their models and data helpers come from :mod:`lightning_dp.tasks`; nothing here imports the recipes."""
