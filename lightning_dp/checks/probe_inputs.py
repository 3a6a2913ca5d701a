"""The example inputs of the attach probe (:mod:`lightning_dp.checks.attach_probe`, docs/design.md section 9.1).

A model's own inputs come first: Lightning's ``example_input_array`` (on any module), then for an HF
``PreTrainedModel`` its ``dummy_inputs`` when they hold its ``main_input_name`` (text models). For an HF model whose
``dummy_inputs`` do not (HF's generic ``{"input_ids": ...}`` on a vision or audio model), inputs of
:data:`EXAMPLES` examples are built from ``main_input_name`` and the config:

- ``pixel_values``: ``[n, num_channels, H, W]`` from ``image_size`` (an int or ``(H, W)``, 64 when the config has
  none), ``[n, num_frames, num_channels, H, W]`` when the config has ``num_frames`` (video);
- ``input_values``: a waveform ``[n, samples]`` that the convolutional feature extractor (``conv_kernel``,
  ``conv_stride``) maps to at least 32 frames and twice the SpecAugment ``mask_time_length`` (Wav2Vec2, HuBERT,
  WavLM, ...), or a spectrogram ``[n, max_length, num_mel_bins]`` (AST);
- ``input_features``: ``[n, num_mel_bins, 2 max_source_positions]`` (Whisper), ``[n, 64, input_feat_per_channel
  input_channels]`` (Speech2Text).

The settings are read from the config, else from its ``vision_config``, ``audio_config``, ``encoder`` or
``backbone_config``. An encoder-decoder whose forward takes ``decoder_input_ids`` and whose inputs have none gets
them: its ``input_ids`` shifted right after the decoder start token (as BART derives them), else ``[n, 4]`` of the
start token followed by random tokens; the start token is ``decoder_start_token_id`` of the config or generation
config, else ``pad_token_id``, ``bos_token_id``, 0. Random values are drawn from a generator of their
own (seed :data:`SEED`), never the global RNG. Anything else (a multimodal model, an input this module does not
know) has no example inputs, and the probe does not run.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

#: examples in the inputs built for an HF model.
EXAMPLES = 3
#: seed of the generator the built inputs are drawn from.
SEED = 0
#: the side of a built image when the config has no ``image_size``.
DEFAULT_IMAGE_SIZE = 64
#: the least number of frames the built waveform of a convolutional audio encoder yields.
AUDIO_FRAMES = 32
#: the length of built decoder inputs (start token included).
DECODER_LENGTH = 4
_NESTED = ("vision_config", "audio_config", "encoder", "backbone_config")


def probe_target(module: nn.Module) -> tuple[nn.Module, Any] | None:
    """The module the attach probe calls and its inputs: ``module`` with :func:`example_inputs`, or else, for a model
    that wraps an HF model (a LightningModule holding ``self.model``), the outermost HF model inside it with its own;
    None when there is neither."""
    inputs = example_inputs(module)
    if inputs is not None:
        return module, inputs
    inner = next((sub for _, sub in module.named_modules() if sub is not module and _is_hf_model(sub)), None)
    if inner is None:
        return None
    inputs = hf_example_inputs(inner)
    return None if inputs is None else (inner, inputs)


def example_inputs(module: nn.Module) -> Any:
    """The example inputs the attach probe runs ``module`` on.

    Returns:
        ``module.example_input_array`` when set (a tensor, a tuple of positional or a dict of keyword inputs); for an
        HF model, :func:`hf_example_inputs`; else ``module.dummy_inputs`` when set; else None.
    """
    inputs = _attribute(module, "example_input_array")
    if inputs is not None:
        return inputs
    if _is_hf_model(module):
        return hf_example_inputs(module)
    return _attribute(module, "dummy_inputs")


def hf_example_inputs(model: nn.Module) -> dict[str, Any] | None:
    """Keyword inputs for an HF ``PreTrainedModel`` (or a peft model around one): its ``dummy_inputs`` when they hold
    its ``main_input_name``, else :data:`EXAMPLES` examples built from its config (see the module's docstring); decoder
    inputs added for an encoder-decoder.

    Returns:
        ``{name: [n, ...]}``, or None when the main input cannot be built from the config.
    """
    config = getattr(model, "config", None)
    main = str(getattr(model, "main_input_name", "input_ids"))
    dummy = _attribute(model, "dummy_inputs")
    generator = torch.Generator().manual_seed(SEED)
    if isinstance(dummy, Mapping) and main in dummy:
        inputs = dict(dummy)
    else:
        built = _main_input(main, config, _float_dtype(model), generator)
        if built is None:
            return None
        inputs = {main: built}
    if _needs_decoder_inputs(model, config, inputs):
        start = _decoder_start(model, config)
        ids = inputs.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.ndim == 2:  # as BART derives them: the encoder's ids shifted right
            inputs["decoder_input_ids"] = torch.cat([torch.full_like(ids[:, :1], start), ids[:, :-1]], dim=1)
        else:
            rows = example_rows(inputs) or EXAMPLES
            inputs["decoder_input_ids"] = _decoder_input_ids(config, start, rows, generator)
    return inputs


def example_rows(inputs: Any) -> int | None:
    """The leading dimension of the first tensor in ``inputs`` that has one (the number of examples), or None."""
    return next((t.shape[0] for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.ndim > 0), None)


def _attribute(module: nn.Module, name: str) -> Any:
    try:
        return getattr(module, name, None)
    except Exception:  # a property that cannot build inputs for this model
        return None


def _is_hf_model(module: nn.Module) -> bool:
    """An HF ``PreTrainedModel``, or a wrapper that forwards its attributes (peft): a config and a main input name."""
    return isinstance(_attribute(module, "main_input_name"), str) and _attribute(module, "config") is not None


def _float_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _setting(config: Any, name: str) -> Any:
    """``config.<name>``, else the first nested config's (vision, audio, encoder, backbone) that has it, else None."""
    value = getattr(config, name, None)
    if value is not None:
        return value
    for nested in _NESTED:
        value = getattr(getattr(config, nested, None), name, None)
        if value is not None:
            return value
    return None


def _main_input(name: str, config: Any, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor | None:
    """``[EXAMPLES, ...]`` values for the main input ``name``, or None when the config does not say their shape."""
    shape: tuple[int, ...] | None = None
    if name == "pixel_values":
        shape = _image_shape(config)
    elif name == "input_values":
        shape = _audio_shape(config)
    elif name == "input_features":
        shape = _features_shape(config)
    if shape is None:
        return None
    return torch.randn(EXAMPLES, *shape, generator=generator).to(dtype)


def _image_shape(config: Any) -> tuple[int, ...]:
    """``(C, H, W)``, or ``(frames, C, H, W)`` for a video model."""
    size = _setting(config, "image_size") or DEFAULT_IMAGE_SIZE
    height, width = (int(size[0]), int(size[-1])) if isinstance(size, (list, tuple)) else (int(size), int(size))
    channels = int(_setting(config, "num_channels") or 3)
    frames = _setting(config, "num_frames")
    return (int(frames), channels, height, width) if frames else (channels, height, width)


def _audio_shape(config: Any) -> tuple[int, ...] | None:
    """``(samples,)`` that the feature extractor maps to ``AUDIO_FRAMES`` frames or more (and at least twice the
    SpecAugment mask length), or ``(max_length, num_mel_bins)`` for a spectrogram model."""
    kernels, strides = _setting(config, "conv_kernel"), _setting(config, "conv_stride")
    if kernels and strides and len(kernels) == len(strides):
        length = max(AUDIO_FRAMES, 2 * int(getattr(config, "mask_time_length", 0) or 0))
        for kernel, stride in reversed(list(zip(kernels, strides, strict=True))):
            length = (length - 1) * int(stride) + int(kernel)
        return (length,)
    bins, frames = _setting(config, "num_mel_bins"), _setting(config, "max_length")
    if bins and frames:
        return (int(frames), int(bins))
    return None


def _features_shape(config: Any) -> tuple[int, ...] | None:
    """``(num_mel_bins, 2 max_source_positions)`` (Whisper) or ``(64, features)`` (Speech2Text)."""
    bins, positions = _setting(config, "num_mel_bins"), _setting(config, "max_source_positions")
    if bins and positions:
        return (int(bins), 2 * int(positions))
    per_channel = _setting(config, "input_feat_per_channel")
    if per_channel:
        return (64, int(per_channel) * int(_setting(config, "input_channels") or 1))
    return None


def _accepts(model: nn.Module, name: str) -> bool:
    """Whether ``model.forward`` takes a keyword ``name`` (or any keyword)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _needs_decoder_inputs(model: nn.Module, config: Any, inputs: Mapping[str, Any]) -> bool:
    has_decoder = any(key.startswith("decoder_input") for key in inputs)
    return (
        bool(getattr(config, "is_encoder_decoder", False)) and not has_decoder and _accepts(model, "decoder_input_ids")
    )


def _decoder_start(model: nn.Module, config: Any) -> int:
    """The decoder start token: ``decoder_start_token_id`` of the config or generation config, else ``pad_token_id``,
    ``bos_token_id`` (of the config, then of a nested decoder config), else 0."""
    generation, decoder = _attribute(model, "generation_config"), getattr(config, "decoder", None)
    candidates = (
        getattr(config, "decoder_start_token_id", None),
        getattr(generation, "decoder_start_token_id", None),
        getattr(config, "pad_token_id", None),
        getattr(config, "bos_token_id", None),
        getattr(decoder, "decoder_start_token_id", None),
        getattr(decoder, "bos_token_id", None),
    )
    return next((c for c in candidates if isinstance(c, int)), 0)


def _decoder_input_ids(config: Any, start: int, rows: int, generator: torch.Generator) -> torch.Tensor:
    """``[rows, DECODER_LENGTH]``: the start token, then random tokens below the decoder's vocabulary size (all start
    tokens when the config has no vocabulary size)."""
    vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "decoder", None), "vocab_size", None)
    ids = torch.full((rows, DECODER_LENGTH), start, dtype=torch.long)
    if isinstance(vocab, int) and vocab > 0:
        ids[:, 1:] = torch.randint(0, vocab, (rows, DECODER_LENGTH - 1), generator=generator)
    return ids
