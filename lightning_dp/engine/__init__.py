"""The privacy engine and the glue the trainer adapters share (docs/design.md sections 2.1 and 2.2): ``privacy_engine``,
``run_state``, ``steps``, ``attachment``, ``noise_setup``, ``clip_bound``, ``end_of_run``, ``accounting``,
``checkpoint``, ``startup``, ``adapter``, ``queries``.
"""

from lightning_dp.engine.privacy_engine import PrivacyEngine

__all__ = ["PrivacyEngine"]
