"""Signal to exit for a Lightning fit: GracefulInterruptCallback vs Lightning's own SIGTERM.

The same small fit (100 ms batches, a validation that takes 2 s and is due every 4 batches)
is sent SIGTERM during a random batch, once with the callback and once with only Lightning's
own SIGTERM handling (its signal connector: finish the batch, run what is due, raise
SIGTERMException). Reported: time from SIGTERM to process exit, median of --repeats, and
whether a checkpoint to resume from was written. Side by side, interleaved.

    .venv/bin/python benchmarks/bench_lightning_exit.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine, median, table

CHILD = r"""
import sys, time, torch, lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
use_callback, save_dir = sys.argv[1] == "1", sys.argv[2]

class M(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.net = torch.nn.Linear(8, 1)
    def training_step(self, b, i):
        print(f"batch {i}", flush=True); time.sleep(0.1)
        return torch.nn.functional.mse_loss(self.net(b[0]), b[1])
    def validation_step(self, b, i):
        time.sleep(1.0)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = DataLoader(TensorDataset(torch.randn(640, 8), torch.randn(640, 1)), batch_size=8)
callbacks = []
if use_callback:
    from preemptible.lightning import GracefulInterruptCallback
    callbacks.append(GracefulInterruptCallback(save_dir))
trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                     val_check_interval=4, num_sanity_val_steps=0, limit_val_batches=2)
trainer.fit(M(), data, data)
"""


def one(use_callback: bool, rng: random.Random) -> tuple[float, bool]:
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, "1" if use_callback else "0", d],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert proc.stdout is not None
        target = f"batch {rng.choice([3, 7, 11])}"  # a batch after which validation is due
        for line in proc.stdout:
            if line.strip() == target:
                time.sleep(0.05)
                break
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        return time.monotonic() - sent, (Path(d) / "resume.ckpt").exists()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    rng = random.Random(0)
    results: dict[bool, list[tuple[float, bool]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for use in (True, False):
            results[use].append(one(use, rng))
    rows = []
    for use, label in ((True, "GracefulInterruptCallback"), (False, "Lightning's own SIGTERM")):
        times = [t for t, _ in results[use]]
        saved = sum(s for _, s in results[use])
        rows.append(
            [label, f"{median(times):.2f} s", f"{max(times):.2f} s", f"{saved}/{args.repeats}"]
        )
    print(f"machine: {machine()}; median of {args.repeats}, interleaved\n")
    print(table(["handling", "SIGTERM → exit (median)", "worst", "resume checkpoint"], rows))


if __name__ == "__main__":
    main()
