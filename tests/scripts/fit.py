"""A small real Lightning fit used by the tests (run as a subprocess).

Prints ``batch E B`` as each training batch starts, ``val B`` (``sanity val B`` in the sanity
check) as each validation batch starts, ``epoch end E`` in the module's ``on_train_epoch_end``
and ``rank R pid P`` at fit start. Dropout and a noise term draw from the global RNGs every
step.

``--model-checkpoint K`` adds a ``ModelCheckpoint`` (top K by ``val_loss``, in ``SAVE_DIR/mc``)
and, when the fit returns, writes what it holds to ``SAVE_DIR/mc.json``: the file names in its
directory, ``best_model_path`` and ``best_k_models`` (file name -> score).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import random
import sys
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from preemptible.lightning import GracefulInterruptCallback

sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line


class Model(pl.LightningModule):
    def __init__(
        self,
        step_sleep: float,
        slow_save: float = 0.0,
        val_sleep: float = 0.0,
        epoch_end_sleep: float = 0.0,
        plateau: bool = False,
        val_sleep_from: int = 0,
    ) -> None:
        super().__init__()
        self.val_sleep_from = val_sleep_from
        self.plateau = plateau
        self.slow_save = slow_save
        self.val_sleep = val_sleep
        self.epoch_end_sleep = epoch_end_sleep
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
        )
        self.step_sleep = step_sleep

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        print(f"batch {self.current_epoch} {batch_idx}", flush=True)
        if os.environ.get("FIT_DEBUG"):
            import hashlib

            state = hashlib.md5(bytes(torch.get_rng_state().numpy())).hexdigest()[:8]
            weights = sum(float(p.sum()) for p in self.parameters())
            print(f"debug rng {state} w {weights:.8f} x {float(batch[0].sum()):.5f}", flush=True)
        x, y = batch
        noise = torch.randn_like(y) * 0.01 + random.random() * 0.0
        loss = torch.nn.functional.mse_loss(self.net(x), y + noise)
        if self.step_sleep:
            time.sleep(self.step_sleep)
        return loss

    def on_save_checkpoint(self, checkpoint):  # type: ignore[no-untyped-def]
        if self.slow_save:
            print("saving", flush=True)
            time.sleep(self.slow_save)

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        print(f"{'sanity ' if self.trainer.sanity_checking else ''}val {batch_idx}", flush=True)
        if self.trainer.global_step >= self.val_sleep_from:
            time.sleep(self.val_sleep)  # a slow validation the stop must not wait for
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def on_train_epoch_end(self) -> None:
        print(f"epoch end {self.current_epoch}", flush=True)
        time.sleep(self.epoch_end_sleep)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        if self.plateau:  # the rate / 10 after each epoch whose val_loss did not fall by half
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, threshold=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)]


class DebugProbe(pl.Callback):
    def _p(self, what):  # type: ignore[no-untyped-def]
        import hashlib

        print(
            f"debug {what} {hashlib.md5(bytes(torch.get_rng_state().numpy())).hexdigest()[:8]}",
            flush=True,
        )

    def on_validation_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self._p("val-start")

    def on_validation_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self._p("val-end")

    def on_train_batch_end(self, trainer, pl_module, *a):  # type: ignore[no-untyped-def]
        self._p("batch-end")

    def on_train_batch_start(self, trainer, pl_module, *a):  # type: ignore[no-untyped-def]
        self._p("batch-start")


class SlowWrite(TorchCheckpointIO):
    """Writes half of the checkpoint, prints ``writing PATH``, waits, writes the rest: a kill
    in between leaves a torn file where the checkpoint is written."""

    def __init__(self, pause: float) -> None:
        self.pause = pause

    def save_checkpoint(self, checkpoint, path, storage_options=None):  # type: ignore[no-untyped-def]
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        data = buffer.getvalue()
        with open(path, "wb") as fh:
            fh.write(data[: len(data) // 2])
            fh.flush()
            print(f"writing {path}", flush=True)
            time.sleep(self.pause)
            fh.write(data[len(data) // 2 :])


def model_checkpoint_summary(mc: ModelCheckpoint) -> dict[str, object]:
    return {
        "files": sorted(os.listdir(mc.dirpath)) if mc.dirpath else [],
        "best_model_path": os.path.basename(mc.best_model_path),
        "best_k_models": {os.path.basename(k): float(v) for k, v in mc.best_k_models.items()},
    }


class TrainEndProbe(pl.Callback):
    def __init__(self, sleep: float = 0.0) -> None:
        self.sleep = sleep

    def on_train_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        print("later train-end hook ran", flush=True)
        if self.sleep:  # a callback after ours still at work: a signal now comes after training
            time.sleep(self.sleep)
            print("later train-end hook done", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--save-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument(
        "--resume-if-saved",
        action="store_true",
        help="the README's recipe: ckpt_path if it exists (says which), else a new fit",
    )
    p.add_argument("--devices", type=int, default=1)
    # the harness keeps the published callback's contract (0) unless told otherwise; "default"
    # passes no exit_code (the callback's own default, 128 + signum), "signal" passes None
    p.add_argument("--exit-code", default="0")
    p.add_argument("--val", action="store_true")
    p.add_argument("--val-size", type=int, default=16, help="validation samples (8 a batch)")
    p.add_argument("--val-sleep", type=float, default=None, help="default: 1 s with --step-sleep")
    p.add_argument(
        "--val-sleep-from",
        type=int,
        default=0,
        metavar="STEP",
        help="--val-sleep only in validations from global step STEP on (the one a test stops "
        "in; the weights do not depend on it)",
    )
    p.add_argument(
        "--val-every",
        default="4",
        help="with --val: validate every N training batches, or 'epoch' (at each epoch's end)",
    )
    p.add_argument("--model-checkpoint", type=int, default=None, metavar="TOP_K")
    p.add_argument("--plateau", action="store_true", help="ReduceLROnPlateau on val_loss")
    p.add_argument("--sanity-steps", type=int, default=0)
    p.add_argument("--epoch-end-sleep", type=float, default=0.0)
    p.add_argument("--train-end-sleep", type=float, default=0.0, help="in a later callback")
    p.add_argument("--slow-write", type=float, default=0.0)
    p.add_argument("--slow-finally", type=float, default=0.0, help="the owner's finally block")
    p.add_argument("--slow-save", type=float, default=0.0)
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--tracker", choices=["none", "local", "mlflow", "wandb"], default="none")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if "://" not in args.save_dir:  # a bucket's URL is staged by the callback
        os.makedirs(args.save_dir, exist_ok=True)

    pl.seed_everything(0, workers=True)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(96, 8, generator=gen)
    y = x.sum(1, keepdim=True)
    train = DataLoader(
        TensorDataset(x, y),
        batch_size=8,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )
    n = args.val_size
    val = DataLoader(TensorDataset(x[:n], y[:n]), batch_size=8) if args.val else None

    tracker = None
    if args.tracker == "local":
        from preemptible.trackers import LocalTracker

        tracker = LocalTracker(os.path.join(args.save_dir, "tracker.jsonl"))
    elif args.tracker == "mlflow":
        import mlflow

        from preemptible.trackers import MLflowTracker

        mlflow.set_tracking_uri(f"sqlite:///{args.save_dir}/mlflow.db")
        if mlflow.get_experiment_by_name("fit") is None:
            mlflow.create_experiment("fit", artifact_location=f"{args.save_dir}/artifacts")
        mlflow.set_experiment("fit")
        run = mlflow.start_run()
        print(f"mlflow run {run.info.run_id}", flush=True)
        tracker = MLflowTracker()
    elif args.tracker == "wandb":
        import wandb

        from preemptible.trackers import WandbTracker

        os.environ["WANDB_MODE"] = "offline"
        tracker = WandbTracker(wandb.init(project="fit", dir=args.save_dir))

    if args.exit_code == "default":
        callback = GracefulInterruptCallback(args.save_dir, tracker)
    else:
        exit_code = None if args.exit_code == "signal" else int(args.exit_code)
        callback = GracefulInterruptCallback(args.save_dir, tracker, exit_code=exit_code)
    mc = None
    if args.model_checkpoint is not None:
        mc = ModelCheckpoint(
            dirpath=os.path.join(args.save_dir, "mc"),
            monitor="val_loss",
            save_top_k=args.model_checkpoint,
        )
    val_every = None if args.val_every == "epoch" else int(args.val_every)
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        logger=False,
        enable_checkpointing=mc is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        callbacks=[callback, TrainEndProbe(args.train_end_sleep)]
        + ([mc] if mc is not None else [])
        + ([DebugProbe()] if os.environ.get("FIT_DEBUG") else []),
        val_check_interval=val_every if args.val else None,
        num_sanity_val_steps=args.sanity_steps,
        plugins=[SlowWrite(args.slow_write)] if args.slow_write else None,
    )
    print(f"rank {trainer.global_rank} pid {os.getpid()}", flush=True)
    val_sleep = args.val_sleep if args.val_sleep is not None else (1.0 if args.step_sleep else 0.0)
    model = Model(
        args.step_sleep,
        args.slow_save,
        val_sleep,
        args.epoch_end_sleep,
        args.plateau,
        args.val_sleep_from,
    )
    resume = callback.ckpt_path if args.resume else None
    if args.resume_if_saved:
        resume = callback.ckpt_path if callback.ckpt_path.exists() else None
        print(f"ckpt_path exists {resume is not None}", flush=True)
    try:
        trainer.fit(model, train, val, ckpt_path=resume)
        if trainer.global_rank == 0:
            torch.save(model.state_dict(), args.out)
            if mc is not None:
                with open(os.path.join(args.save_dir, "mc.json"), "w") as fh:
                    json.dump(model_checkpoint_summary(mc), fh)
    finally:
        # the owner's pattern that used to overwrite the truth: "success" in a finally block
        if tracker is not None:
            tracker.finalize("finished")
        if args.slow_finally:
            print("finally", flush=True)
            time.sleep(args.slow_finally)
    print(f"fit done received_sigterm={trainer.received_sigterm}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
