"""The names of the built-in clipping engines, noise mechanisms and accountants, written out: a command's ``--help``
lists them without importing the registries, which import torch (the engines) or scipy and dp_accounting (the
mechanisms and accountants). ``tests/cli/test_builtin_names.py`` checks them against the registries, in order.
"""

#: The ``clipping`` value that picks the engine (:data:`lightning_dp.clipping.AUTO`).
AUTO = "auto"
#: :func:`lightning_dp.clipping.clipping_choices`.
CLIPPING = (AUTO, "ghost", "fgc", "flat", "hutch", "hutchpp", "mixed")
#: :data:`lightning_dp.mechanisms.MECHANISMS`.
NOISES = ("gaussian", "laplace", "lap2", "laplace-advanced", "plrv")
#: :data:`lightning_dp.accounting.ACCOUNTANTS`.
ACCOUNTANTS = (
    "banded-mf",
    "blt-minsep",
    "basic",
    "advanced",
    "lap2",
    "lap2-paper",
    "plrv",
    "plrv-paper",
    "rc",
    "rdp",
    "pld",
)
