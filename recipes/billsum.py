"""BillSum summarisation with DP (ROUGE-1/2/L); see lightning_dp/recipes/billsum.py and docs/recipes/billsum.md.

accelerate launch recipes/billsum.py --config configs/billsum.yaml
python recipes/billsum.py --config configs/billsum.yaml --target_epsilon 8
"""

from lightning_dp.recipes.billsum import main

if __name__ == "__main__":
    main()
