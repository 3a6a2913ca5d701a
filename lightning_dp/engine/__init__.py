"""The privacy engine and the glue the trainer adapters share (docs/design.md section 2.2).

- ``privacy_engine``: :class:`PrivacyEngine`, the framework-agnostic DP state of one run: it owns the run state
  and the parts below, each a class that receives the state, and is what the adapters call.
- ``run_state``: :class:`~lightning_dp.engine.run_state.RunState`, the typed state the parts share.
- ``steps``: the run sequence every adapter drives (start of the run, the training loader's sampling, start of
  training, per micro-batch the per-sample loss with its checks and the clip, the end-of-run flags).
- ``attachment``: the per-sample clipping hooks on the model and the checks around its forward.
- ``noise_setup``: delta, the noise (calibrated for ``target_epsilon`` when asked) and the accountant.
- ``clip_bound``: the clipping bound, fixed or moved by adaptive clipping.
- ``end_of_run``: the end-of-run warnings about the private data (dropped examples, postponed or inconclusive
  checks).
- ``accounting``: the event of one step, the ledger, epsilon, the budget and the run's summary.
- ``checkpoint``: the privacy state a resumed run needs (never a seed or a generator state).
- ``startup``: the start-up block logged once when training starts.
- ``adapter``: :class:`~lightning_dp.engine.adapter.TrainerAdapter`, the contract every trainer adapter implements,
  and the glue the adapters share (batch size and stand-in batch, framework clipping, rank-0 logging, the budget).
- ``queries``: the calls users make to read the privacy spent, the same on the Lightning strategies and ``DPTrainer``.
"""

from lightning_dp.engine.privacy_engine import PrivacyEngine

__all__ = ["PrivacyEngine"]
