"""A Hugging Face Trainer run for the tests: a 2-layer GPT-2 from a config (no download),
dropout 0.1, random tokens, CPU. Prints ``step N`` after each optimizer step and, at its end,
saves the final weights with ``--weights``.

    hf_train.py OUT [--steps N] [--save-steps N] [--workers N] [--sleep S] [--resume]
                    [--weights FILE] [--no-callback] [--jit] [--return] [--limit N]
                    [--slow-at N] [--report mlflow|wandb] [--results] [--mirror URL]
                    [--signal-at N]

``--signal-at N``: the process sends itself SIGTERM as step N begins, a signal that lands
during step N whatever the machine's load.

``--results``: after train(), what ``run_clm.py`` does: ``save_metrics("train", ...)``
(``OUT/train_results.json``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint

sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 64, length: int = 16) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Steps(TrainerCallback):
    """``step N`` on stdout at each step's end; ``--sleep`` seconds at each step's start."""

    def __init__(self, sleep: float, signal_at: int) -> None:
        self.sleep = sleep
        self.signal_at = signal_at

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step + 1 == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if self.sleep:
            time.sleep(self.sleep)

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if "mlflow" in args.report_to:  # the run the Trainer's MLflow integration opened
            import mlflow

            print(f"mlflow run {mlflow.active_run().info.run_id}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        sys.stdout.write(f"step {state.global_step}\n")
        sys.stdout.flush()


class SlowSave(Trainer):
    """``--slow-at N``: a save of step N or later says ``saving step N`` on stdout halfway (the
    model and optimizer written, the RNG states not yet), then takes ``--slow-seconds`` more."""

    slow_at = -1
    slow_seconds = 60.0

    def _save_rng_state(self, output_dir):  # type: ignore[no-untyped-def]
        if 0 <= self.slow_at <= self.state.global_step:
            sys.stdout.write(f"saving step {self.state.global_step}\n")
            sys.stdout.flush()
            time.sleep(self.slow_seconds)
        super()._save_rng_state(output_dir)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="save_total_limit")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--slow-at", type=int, default=-1)
    p.add_argument("--slow-seconds", type=float, default=60.0)
    p.add_argument("--report", default="none", help="report_to: none, mlflow or wandb")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--weights")
    p.add_argument("--no-callback", action="store_true")
    p.add_argument("--jit", action="store_true")
    p.add_argument("--return", dest="returns", action="store_true")
    p.add_argument("--results", action="store_true")
    p.add_argument("--mirror", default=None, help="a bucket's URL the checkpoints go to too")
    p.add_argument("--signal-at", type=int, default=-1)
    a = p.parse_args()

    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=a.out,
        max_steps=a.steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        seed=0,
        data_seed=0,
        save_strategy="steps" if a.save_steps else "no",
        save_steps=a.save_steps or 500,
        save_total_limit=a.limit,
        logging_strategy="no",
        report_to=[] if a.report == "none" else [a.report],
        dataloader_num_workers=a.workers,
        disable_tqdm=True,
        use_cpu=True,
        enable_jit_checkpoint=a.jit,
    )
    callbacks: list[TrainerCallback] = [Steps(a.sleep, a.signal_at)]
    preemption = None
    if not a.no_callback:
        from preemptible.transformers import PreemptionCallback

        mirror = {} if a.mirror is None else {"mirror": a.mirror, "output_dir": a.out}
        preemption = PreemptionCallback(exit=not a.returns, **mirror)
        callbacks.append(preemption)
    SlowSave.slow_at, SlowSave.slow_seconds = a.slow_at, a.slow_seconds
    trainer = SlowSave(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    resume = get_last_checkpoint(a.out) if a.resume and os.path.isdir(a.out) else None
    result = trainer.train(resume_from_checkpoint=resume)
    if preemption is not None and preemption.stopped is not None:
        print(f"returned after a stop, exit code {preemption.exit_code}", flush=True)
        return preemption.exit_code or 0
    if a.results:
        trainer.save_metrics("train", result.metrics)
    if a.weights and trainer.is_world_process_zero():
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, a.weights)
    if torch.distributed.is_initialized():
        # under torchrun the ranks leave together: a rank whose process exits (tearing its gloo
        # group down) while rank 0 is still writing the weights may abort at exit (torch 2.13)
        torch.distributed.barrier()
        # and even then, one in some tens of runs under load, torch's gloo teardown at the
        # interpreter's exit ends rank 0 with "terminate called without an active exception"
        # (SIGABRT) after all is written: everything is on disk and said, so leave without it
        print("done", flush=True)
        sys.stderr.flush()
        os._exit(0)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
