"""Models and data shared by the demo, the examples, the recipes, the audit and the benches; imports nothing from
``examples/``, ``recipes/``, ``audit/`` or ``cli/``.

Layering: library core < tasks < entry points (demo, examples, recipes, audit setups, CLI, bench). The core (the
engine, clipping, mechanisms, accounting, the Lightning and HF integrations) imports neither tasks nor entry points;
entry points import tasks, never each other, except through the command line (``lightning-dp demo`` / ``audit``
load the demo and the audit setups, the demo is a ``cli`` module, the CIFAR recipe runs ``lightning-dp fit``).
``tests/structure/test_layering.py`` checks it.

- :mod:`~lightning_dp.tasks.digits`: the demo's small CNN on scikit-learn's digits (offline).
- :mod:`~lightning_dp.tasks.pretrained`: pretrained model and tokenizer loading (Hub or ``package:NAME``), LoRA.
- :mod:`~lightning_dp.tasks.encoders`: the mean-pooling BERT classifier and freezing of lower encoder layers.
- :mod:`~lightning_dp.tasks.prompt_target`: causal-LM prompt/target examples, their truncation rule, the collator.
- :mod:`~lightning_dp.tasks.local_data`: where the local copies of public datasets are (a data root given by a flag
  or ``LIGHTNING_DP_DATA``).
"""
