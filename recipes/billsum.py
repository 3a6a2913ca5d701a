"""BillSum summarisation with DP (ROUGE-1/2/L); see lightning_dp/recipes/billsum.py and docs/recipes/billsum.md.

accelerate launch recipes/billsum.py --config configs/billsum_offline.yaml
python recipes/billsum.py --config configs/billsum_offline.yaml --target_epsilon 8
"""

from lightning_dp.recipes.billsum import main
from lightning_dp.recipes.run import script_main

if __name__ == "__main__":
    raise SystemExit(script_main(main))
