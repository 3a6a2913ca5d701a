"""HotpotQA (distractor) answer generation with DP (exact match, F1); see lightning_dp/recipes/hotpotqa.py and
docs/recipes/hotpotqa.md.

    accelerate launch recipes/hotpotqa.py --config configs/hotpotqa_offline.yaml --data_dir ROOT  # data under ROOT
    python recipes/hotpotqa.py --config configs/hotpotqa_offline.yaml --target_epsilon 8  # ROOT: $LIGHTNING_DP_DATA
    accelerate launch recipes/hotpotqa.py --config configs/hotpotqa_hub.yaml              # Hub data (GPU)
"""

from lightning_dp.recipes.hotpotqa import main
from lightning_dp.recipes.run import script_main

if __name__ == "__main__":
    raise SystemExit(script_main(main))
