"""accelerate's ``examples/by_feature/checkpointing.py``, tiny: the same shape (``Accelerator``,
``set_seed``, data loaders, AdamW, a warm-up schedule, ``prepare``, an epoch loop with an
evaluation per epoch through ``gather_for_metrics``) on a small regression model with dropout,
with ``preemptible.accelerate.PreemptibleLoop`` added as its docs page says.

Run by ``accelerate launch --multi_gpu --num_processes 2`` (CPU, gloo). Every process prints
``rank R pid P`` once prepared and ``rank R step N`` as step N starts (``--sleep``: seconds
per step); rank 0 prints the evaluation per epoch and writes the weights to ``--weights``.
``--plain``: the same loop without preemptible (the run never stopped, to compare with).
``--resume_from_checkpoint DIR``: the example's own ``accelerator.load_state(DIR)``, after the
loop's resume.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.optim import AdamW
from torch.utils.data import DataLoader, TensorDataset

sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line


def get_dataloaders(batch_size: int) -> tuple[DataLoader, DataLoader]:
    seeded = torch.Generator().manual_seed(1234)  # the same data in every process
    x = torch.randn(64, 8, generator=seeded)
    y = x.sum(1, keepdim=True)
    train = DataLoader(TensorDataset(x[:48], y[:48]), shuffle=True, batch_size=batch_size)
    evaluation = DataLoader(TensorDataset(x[48:], y[48:]), shuffle=False, batch_size=8)
    return train, evaluation


def training_function(args: argparse.Namespace) -> None:
    accelerator = Accelerator(cpu=True)
    set_seed(42)
    train_dataloader, eval_dataloader = get_dataloaders(batch_size=4)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    )
    optimizer = AdamW(params=model.parameters(), lr=1e-2)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    rank = accelerator.process_index
    sys.stdout.write(f"rank {rank} pid {os.getpid()}\n")

    if args.plain:
        epochs = range(args.epochs)
    else:
        from preemptible.accelerate import PreemptibleLoop

        loop = PreemptibleLoop(  # --output_dir "": the supervisor's (PREEMPTIBLE_CHECKPOINT_DIR)
            accelerator, args.output_dir or None, save_every_steps=args.checkpointing_steps
        )
        epochs = loop.epochs(args.epochs)
    if args.resume_from_checkpoint:  # the example's own resume, kept where the docs say not to
        accelerator.load_state(args.resume_from_checkpoint)
    step = 0
    for epoch in epochs:
        model.train()
        batches = train_dataloader if args.plain else loop.batches(train_dataloader)
        for batch in batches:
            if not args.plain:
                step = loop.step
            sys.stdout.write(f"rank {rank} step {step}\n")
            sys.stdout.flush()
            time.sleep(args.sleep)
            x, y = batch
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            step += 1
        model.eval()
        errors = []
        for x, y in eval_dataloader:
            with torch.no_grad():
                predictions = model(x)
            predictions, references = accelerator.gather_for_metrics((predictions, y))
            errors.append((predictions - references).abs())
        accelerator.print(f"epoch {epoch}: error {torch.cat(errors).mean().item():.6f}")
    if accelerator.is_main_process and args.weights:
        torch.save(accelerator.unwrap_model(model).state_dict(), args.weights)
    # Rank 0 writes the weights while rank 1 would already tear its process group down; with
    # gloo (torch 2.13) a process that destroys its group while its peer is still busy aborts
    # ("terminate called without an active exception") in about one run of four. accelerate's
    # example has no main-only write here, so it needs no barrier; this copy does.
    accelerator.wait_for_everyone()
    accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default="ckpt")
    parser.add_argument("--checkpointing_steps", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--weights", default=None)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--resume_from_checkpoint", default=None)
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
