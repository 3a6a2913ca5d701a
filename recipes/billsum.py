"""BillSum summarisation with DP (ROUGE-1/2/L); see lightning_dp/recipes/billsum.py and docs/recipes/billsum.md.

accelerate launch recipes/billsum.py --config configs/billsum_offline.yaml --data_dir ROOT   # local data under ROOT
python recipes/billsum.py --config configs/billsum_offline.yaml --target_epsilon 8       # ROOT from LIGHTNING_DP_DATA
accelerate launch recipes/billsum.py --config configs/billsum_hub.yaml                   # Hub data (GPU)
"""

from lightning_dp.recipes.billsum import main
from lightning_dp.recipes.run import script_main

if __name__ == "__main__":
    raise SystemExit(script_main(main))
