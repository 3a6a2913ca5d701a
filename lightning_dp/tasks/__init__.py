"""Models and data shared by the demo, the examples, the recipes, the audit and the benches (layering: docs/design.md
section 2.1).

- :mod:`~lightning_dp.tasks.digits`: the demo's small CNN on scikit-learn's digits.
- :mod:`~lightning_dp.tasks.pretrained`: pretrained model and tokenizer loading (Hub or ``package:NAME``), LoRA.
- :mod:`~lightning_dp.tasks.encoders`: the mean-pooling BERT classifier, freezing lower encoder layers.
- :mod:`~lightning_dp.tasks.prompt_target`: causal-LM prompt/target examples, truncation, collator.
- :mod:`~lightning_dp.tasks.local_data`: local copies of public datasets (``--data_dir`` or ``LIGHTNING_DP_DATA``).
"""
