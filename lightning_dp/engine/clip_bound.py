"""The clipping bound of a run: fixed, or under adaptive clipping moved after each step by a noisy count of the
unclipped examples (Andrew et al., 2021, Algorithm 1; :mod:`lightning_dp.optim.adaptive_clipping`)."""

from __future__ import annotations

import torch

from lightning_dp.engine.run_state import RunState
from lightning_dp.mechanisms import NoiseMechanism
from lightning_dp.mechanisms.gaussian import GaussianMechanism
from lightning_dp.mechanisms.secure import secure_sample
from lightning_dp.optim.adaptive_clipping import DEFAULT_COUNT_NOISE_FRACTION, AdaptiveClipping, sum_noise_multiplier


class ClipBound:
    """Sets, moves and restores the bound that the clipper clips at and the clipped sum's noise is scaled to, in the
    run's :class:`~lightning_dp.engine.run_state.RunState` (``current_max_grad_norm``, ``adaptive``,
    ``sum_mechanism``)."""

    def __init__(self, state: RunState) -> None:
        self.state = state

    def setup_adaptive(self) -> NoiseMechanism:
        """Set up ``state.adaptive`` (bound restored from a checkpoint if loaded) and return the clipped sum's mechanism
        ``GaussianMechanism(sigma_sum, C_t)``, shared by every wrapped optimizer and updated by :meth:`set`.

        Raises:
            ValueError: ``unclipped_num_std <= noise_multiplier / 2``.
        """
        state = self.state
        config = state.config
        assert config.target_unclipped_quantile is not None  # adaptive clipping is on
        assert state.sample_rate is not None and state.num_samples is not None
        expected_batch_size = state.sample_rate * state.num_samples
        count_std = config.unclipped_num_std
        if count_std is None:
            count_std = expected_batch_size * DEFAULT_COUNT_NOISE_FRACTION
            default = f"unclipped_num_std = q N / 20 = {count_std:.4g} (adaptive clipping's count noise, Andrew et al.)"
            if default not in state.defaults_applied:
                state.defaults_applied.append(default)
        sum_sigma = sum_noise_multiplier(state.noise_multiplier, count_std)
        state.adaptive = AdaptiveClipping(
            initial_bound=state.restored_clip_bound or state.current_max_grad_norm,
            target_unclipped_quantile=config.target_unclipped_quantile,
            clipbound_learning_rate=config.clipbound_learning_rate,
            unclipped_num_std=count_std,
            expected_batch_size=expected_batch_size,
            min_clipbound=config.min_clipbound,
            max_clipbound=config.max_clipbound,
        )
        state.restored_clip_bound = None
        if isinstance(state.sum_mechanism, GaussianMechanism) and state.sum_mechanism is not state.mechanism:
            # prepared again (another fit): the optimizer wrapped before holds this object, so it is updated in place
            state.sum_mechanism.noise_multiplier = sum_sigma
        else:
            state.sum_mechanism = GaussianMechanism(sum_sigma, state.adaptive.bound)
        self.set(state.adaptive.bound)
        return state.sum_mechanism

    def set(self, bound: float) -> None:
        """Clip at ``bound`` from the next micro-batch on, and noise the next sum for it."""
        state = self.state
        state.current_max_grad_norm = bound
        if state.clipper is not None:
            state.clipper.max_grad_norm = bound
        if state.sum_mechanism is not None and state.sum_mechanism is not state.mechanism:
            state.sum_mechanism.max_grad_norm = bound

    def move(self) -> None:
        """Adaptive clipping, after a step: release the step's centred count of unclipped examples (summed over
        the ranks, noised once from the shared noise stream) and move the bound for the next step."""
        state = self.state
        assert state.adaptive is not None and state.clipper is not None
        params = state.clipper.trainable_parameters
        count = state.adaptive.count_tensor(params[0].device if params else torch.device("cpu"))
        if state.distributed is not None:
            state.distributed.reduce_clipped_sum([count])
        count_noise = GaussianMechanism(state.adaptive.unclipped_num_std, 1.0)
        generator = state.randomness.noise_generator(count.device)
        noise = (
            secure_sample(count_noise, count, generator)
            if state.config.secure_mode
            else count_noise.sample(count, generator)
        )
        self.set(state.adaptive.update(noise))

    def restore(self, bound: float | None) -> None:
        """Continue adaptive clipping from a checkpoint's ``bound`` (``None``: no adaptive state): at once when the
        run is already prepared, else when :meth:`setup_adaptive` runs."""
        if bound is None:
            return
        if self.state.adaptive is None:
            self.state.restored_clip_bound = bound
        else:  # restored after the run was prepared
            self.state.adaptive.restore(bound)
            self.set(bound)
