"""HotpotQA (distractor) answer generation with DP (exact match, F1); see lightning_dp/recipes/hotpotqa.py and
docs/recipes/hotpotqa.md.

    accelerate launch recipes/hotpotqa.py --config configs/hotpotqa.yaml
    python recipes/hotpotqa.py --config configs/hotpotqa.yaml --target_epsilon 8
"""

from lightning_dp.recipes.hotpotqa import main

if __name__ == "__main__":
    main()
