"""Processes and the machine: what a run needs of its launch, its ranks and its files, whatever the trainer.

- ``distributed``: the collectives of multi-process runs (SUM all-reduce of the clipped sums, shared noise seed).
- ``sharding``: parameters sharded by FSDP2, as the clipper and the optimizer see them.
- ``randomness``: the run's dedicated random streams (noise, projections, Poisson sampling); never in checkpoints.
- ``checkpoints``: checkpoint files a kill cannot leave half-written.
- ``launch_check``: whether the launcher started fewer processes than asked for.
- ``environment``: what a run's numbers depend on besides its command and seed (versions, threads, CPU kernels).
- ``console``: where the ``lightning_dp`` logger's lines go when nobody set up logging.
"""
