"""The names a short Hugging Face Trainer example uses without defining them: ``model`` (a
tiny GPT-2), ``args`` (TrainingArguments writing to ``out/``, a few steps) and ``data``.

The whole Trainer recipe, stopped and resumed bit for bit, is a ``trainer`` block
(docs/frontends/transformers.md); a block on this set-up only shows the lines that change,
and runs them uninterrupted. ``finish()`` checks that the fit trained all its steps.
"""

from __future__ import annotations

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, set_seed

torch.set_num_threads(1)
_tokens = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": t, "labels": t} for t in _tokens]
set_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
args = TrainingArguments(
    output_dir="out",
    max_steps=8,
    per_device_train_batch_size=8,
    save_steps=4,
    logging_steps=4,
    seed=0,
    report_to=[],
)


def finish() -> None:
    saved = sorted(os.listdir("out"))
    assert "checkpoint-8" in saved, f"the fit did not reach step 8: out/ has {saved}"
