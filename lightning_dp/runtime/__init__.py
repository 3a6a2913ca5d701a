"""Processes and the machine: ``distributed``, ``sharding``, ``randomness``, ``checkpoints``, ``launch_check``,
``environment``, ``console`` (docs/design.md section 2.1).
"""
