"""CIFAR-10 with DP-SGD through Lightning (WRN with GroupNorm from scratch, or a ViT fine-tune).

    python recipes/cifar.py --config configs/cifar10_offline.yaml --data_dir ROOT         # local data under ROOT
    accelerate launch recipes/cifar.py --config configs/cifar10_offline.yaml   # ROOT from LIGHTNING_DP_DATA
    lightning-dp fit --config configs/cifar10_offline.yaml --data.data_dir ROOT   # the same LightningCLI
    lightning-dp fit --config configs/cifar10_hub.yaml                           # Hub data (GPU)

Any option of the config is settable on the command line, e.g. ``--trainer.strategy.init_args.target_epsilon 8``.
See lightning_dp/recipes/cifar.py and docs/recipes/cifar.md.
"""

from lightning_dp.recipes.cifar import main

if __name__ == "__main__":
    raise SystemExit(main())
