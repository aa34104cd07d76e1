"""Pretraining recipes on ortrain: GPT-2 (causal LM) and BERT (masked LM + NSP).

``python -m ortrain.recipes.gpt2_pretrain --preset tiny`` (= ``ortrain recipe gpt2 --preset tiny``)
and ``python -m ortrain.recipes.bert_pretrain``. Each recipe is one module with one dataclass
config; ``recipes/loop.py`` holds the training loop they share, with its parts in
``config``, ``processes``, ``task``, ``backends``, ``checkpoints`` and ``metrics``.
"""


class RecipeError(Exception):
    """Bad input to a recipe (data, tokenizer, checkpoint, flags): the CLI prints the
    message on one line and exits with code 1."""
