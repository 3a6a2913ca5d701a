"""GLUE (SST-2, QNLI, MNLI, QQP) with DP fine-tuning; see lightning_dp/recipes/glue.py and docs/recipes/glue.md.

python recipes/glue.py --config configs/glue_offline.yaml --data_dir ROOT   # local data under ROOT
accelerate launch recipes/glue.py --config configs/glue_hub.yaml --task mnli
"""

from lightning_dp.recipes.glue import main
from lightning_dp.recipes.run import script_main

if __name__ == "__main__":
    raise SystemExit(script_main(main))
