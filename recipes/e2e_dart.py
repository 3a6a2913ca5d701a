"""E2E / DART table-to-text fine-tuning with DP (lightning_dp.recipes.e2e_dart; docs/recipes.md)::

python recipes/e2e_dart.py --config configs/e2e_dart_offline.yaml --data_dir ROOT   # offline docs run (CPU)
accelerate launch recipes/e2e_dart.py --config configs/e2e_dart_hub.yaml             # GPT-2, Hub data (GPU)
"""

from lightning_dp.recipes.e2e_dart import main
from lightning_dp.recipes.run import script_main

if __name__ == "__main__":
    raise SystemExit(script_main(main))
