"""The recipes' task metrics, computed by the libraries the field reports them with; nothing here re-implements one.

Classification: accuracy and binary F1 (``torchmetrics``); generation: corpus BLEU (``sacrebleu``), ROUGE-1/2/L
F-measure (``rouge-score``, Porter stemming), METEOR (``nltk``); QA: SQuAD exact match and F1 (``torchmetrics``).
All in percent (0-100). Without the WordNet corpus METEOR is reported as ``meteor_no_synonyms``, never as
``meteor``. Why not HF ``evaluate``: docs/recipes.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchmetrics.functional.classification import binary_f1_score, multiclass_accuracy
from torchmetrics.functional.text import squad


def classification_metrics(predictions: Sequence[int], labels: Sequence[int], num_classes: int, f1: bool = False):
    """Accuracy (and, with ``f1``, the F1 of class 1, as GLUE reports for QQP and MRPC), in percent.

    Args:
        predictions: ``[N]`` predicted class ids.
        labels: ``[N]`` true class ids.
        num_classes: number of classes (``f1`` needs 2).

    Raises:
        ValueError: different lengths, no examples, or ``f1`` with more than two classes.
    """
    preds, target = torch.as_tensor(list(predictions)), torch.as_tensor(list(labels))
    if preds.shape != target.shape or preds.numel() == 0:
        raise ValueError(f"need as many predictions as labels (>= 1), got {preds.numel()} and {target.numel()}")
    accuracy = multiclass_accuracy(preds, target, num_classes=num_classes, average="micro")
    result = {"accuracy": 100 * float(accuracy)}
    if f1:
        if num_classes != 2:
            raise ValueError(f"F1 is reported for binary tasks only, got {num_classes} classes")
        result["f1"] = 100 * float(binary_f1_score(preds, target))
    return result


def _check_pairs(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> None:
    if len(hypotheses) != len(references) or not hypotheses:
        raise ValueError(f"need one reference list per hypothesis (>= 1), got {len(hypotheses)} and {len(references)}")
    if any(len(refs) == 0 for refs in references):
        raise ValueError("every hypothesis needs at least one reference")


def bleu(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Corpus BLEU (sacrebleu defaults: 13a tokenisation, exponential smoothing off, brevity penalty on the closest
    reference length) of ``hypotheses[i]`` against the references ``references[i]`` (any number per example).

    Raises:
        ValueError: lengths differ, or an example has no reference.
    """
    import sacrebleu

    _check_pairs(hypotheses, references)
    streams = [[refs[k] if k < len(refs) else None for refs in references] for k in range(max(map(len, references)))]
    return float(sacrebleu.corpus_bleu(list(hypotheses), streams).score)


def rouge(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """Mean ROUGE-1, ROUGE-2 and ROUGE-L F-measures (``rouge-score`` with the Porter stemmer), each example scored
    against its best reference.

    Raises:
        ValueError: lengths differ, or an example has no reference.
    """
    from rouge_score import rouge_scorer

    _check_pairs(hypotheses, references)
    keys = ("rouge1", "rouge2", "rougeL")
    scorer = rouge_scorer.RougeScorer(list(keys), use_stemmer=True)
    totals = dict.fromkeys(keys, 0.0)
    for hypothesis, refs in zip(hypotheses, references, strict=True):
        scores = scorer.score_multi(list(refs), hypothesis)
        for key in keys:
            totals[key] += scores[key].fmeasure
    return {key: 100 * total / len(hypotheses) for key, total in totals.items()}


class _NoSynonyms:
    """Stands in for nltk's WordNet reader when its corpus is missing: no synonyms, so METEOR matches exact words
    and stems only."""

    @staticmethod
    def synsets(*_args, **_kwargs) -> list:
        return []


def meteor(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """Mean sentence METEOR (``nltk``: lower-cased whitespace tokens, Porter stems, WordNet synonyms; alpha 0.9,
    beta 3, gamma 0.5) in percent, under ``"meteor"``; under ``"meteor_no_synonyms"`` when the WordNet corpus is
    not installed (see the module docstring).

    Raises:
        ValueError: lengths differ, or an example has no reference.
    """
    from nltk.translate.meteor_score import meteor_score

    _check_pairs(hypotheses, references)
    wordnet, key = _wordnet()
    total = sum(
        meteor_score([r.lower().split() for r in refs], h.lower().split(), wordnet=wordnet)
        for h, refs in zip(hypotheses, references, strict=True)
    )
    return {key: 100 * total / len(hypotheses)}


def _wordnet():
    """nltk's WordNet reader and ``"meteor"``, or the no-synonym stand-in and ``"meteor_no_synonyms"``."""
    from nltk.corpus import wordnet

    try:
        wordnet.ensure_loaded()
    except LookupError:
        return _NoSynonyms(), "meteor_no_synonyms"
    return wordnet, "meteor"


def generation_metrics(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """BLEU, ROUGE-1/2/L and METEOR of generated texts (the E2E / DART table's metrics), in percent."""
    return {"bleu": bleu(hypotheses, references), **rouge(hypotheses, references), **meteor(hypotheses, references)}


def exact_match_f1(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> dict[str, float]:
    """SQuAD exact match and token F1 in percent, each prediction scored against its best gold answer after the
    official normalisation (lower case, no punctuation, no articles ``a``/``an``/``the``, single spaces).

    Raises:
        ValueError: lengths differ, or an example has no gold answer.
    """
    _check_pairs(predictions, answers)
    preds = [{"prediction_text": p, "id": str(i)} for i, p in enumerate(predictions)]
    target = [
        {"answers": {"answer_start": [0] * len(golds), "text": list(golds)}, "id": str(i)}
        for i, golds in enumerate(answers)
    ]
    scores = squad(preds, target)
    return {"exact_match": float(scores["exact_match"]), "f1": float(scores["f1"])}
