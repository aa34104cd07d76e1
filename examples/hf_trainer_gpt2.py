"""Train a tiny GPT-2 with ``transformers.Trainer``'s API, through ortrain.

    python examples/hf_trainer_gpt2.py [--steps 60] [--fp16]
    torchrun --nproc_per_node 2 examples/hf_trainer_gpt2.py [--zero1]

The model is built from a config and the text is below (characters are the tokens): nothing
is downloaded. The only change from a plain Trainer script is ``ORTHFTrainer`` in place of
``Trainer`` (and, optionally, ``ortrain_options``).
"""

from __future__ import annotations

import argparse
import math
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from ortrain import ORTHFTrainer, TrainerOptions

TEXT = """\
It was the best of times, it was the worst of times, it was the age of wisdom, it was the
age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the
season of Light, it was the season of Darkness, it was the spring of hope, it was the winter
of despair, we had everything before us, we had nothing before us, we were all going direct
to Heaven, we were all going direct the other way. There were a king with a large jaw and a
queen with a plain face, on the throne of England; there were a king with a large jaw and a
queen with a fair face, on the throne of France. In both countries it was clearer than
crystal to the lords of the State preserves of loaves and fishes, that things in general
were settled for ever.
"""


class CharChunks(torch.utils.data.Dataset):
    """Fixed-length windows of the text's character ids; labels are the inputs (the model
    shifts them)."""

    def __init__(self, ids: torch.Tensor, seq: int, stride: int):
        self.ids, self.seq = ids, seq
        self.starts = list(range(0, len(ids) - seq, stride))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.ids[self.starts[i] : self.starts[i] + self.seq]
        return {"input_ids": window, "labels": window}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--fp16", action="store_true", help="ortrain's fp16 mixed precision")
    parser.add_argument("--zero1", action="store_true", help="ZeRO-1 under torchrun")
    parser.add_argument("--output-dir", default=None)
    opts = parser.parse_args()

    vocab = sorted(set(TEXT))
    ids = torch.tensor([vocab.index(c) for c in TEXT])
    split = int(len(ids) * 0.9)
    train, test = CharChunks(ids[:split], 32, 4), CharChunks(ids[split - 32 :], 32, 16)

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(vocab), n_positions=64, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)

    args = TrainingArguments(
        output_dir=opts.output_dir or tempfile.mkdtemp(prefix="ortrain-hf-"),
        max_steps=opts.steps,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        warmup_steps=opts.steps // 10,
        lr_scheduler_type="cosine",
        weight_decay=0.01,
        max_grad_norm=1.0,
        logging_steps=10,
        eval_strategy="steps",
        eval_steps=opts.steps // 2,
        save_strategy="no",
        fp16=opts.fp16,
        use_cpu=True,
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = ORTHFTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=test,
        ortrain_options=TrainerOptions(zero_stage=1 if opts.zero1 else 0),
    )
    trainer.train()
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        loss = metrics["eval_loss"]
        print(f"eval loss {loss:.3f}, perplexity {math.exp(loss):.2f}")


if __name__ == "__main__":
    main()
