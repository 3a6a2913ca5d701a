"""Recipes for the field's standard DP fine-tuning tasks (GLUE, E2E/DART, BillSum, HotpotQA, CIFAR-10): each task
module holds only data, model and metric; the DP training comes from the library. Run them with
``accelerate launch recipes/<task>.py --config configs/<task>.yaml`` (docs/recipes.md)."""
