"""The privacy options of a run, defined, documented and validated once (``privacy_config``), handed to the adapters
(``options``), and the one-line report of a bad option in a config file or on the command line (``errors``)."""

from lightning_dp.config.options import OPTION_NAMES, REMOVED_OPTIONS, option_docs, option_parameters, pop_options
from lightning_dp.config.privacy_config import HF_NAMES, PrivacyConfig

__all__ = [
    "HF_NAMES",
    "OPTION_NAMES",
    "REMOVED_OPTIONS",
    "PrivacyConfig",
    "option_docs",
    "option_parameters",
    "pop_options",
]
