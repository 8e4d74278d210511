"""Signal to exit for a Lightning fit: GracefulInterruptCallback vs Lightning's own SIGTERM.

The same small fit (100 ms batches; a validation of 4 batches x 1 s, due after every 4th
batch) is sent SIGTERM, once with the callback and once with only Lightning's own SIGTERM
handling (its signal connector sets a flag; the loops raise ``SIGTERMException`` at their next
check). Two cases:

- *batch*: 50 ms into a training batch after which validation is due;
- *validation*: at a random moment of the first three batches of that validation (in the
  last one, Lightning's evaluation loop does not check the flag).

Reported for each: time from SIGTERM to process exit (the parent's waitpid), median and worst
of --repeats, the exit code, and whether a checkpoint to resume from was written. All variants
interleaved in one run.

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
from collections import Counter
from pathlib import Path

from _common import machine, median, table

VAL_BATCHES = 4
VAL_SECONDS = 1.0
CHILD = rf"""
import sys, time, torch, lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
use_callback, save_dir = sys.argv[1] == "1", sys.argv[2]

class M(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.net = torch.nn.Linear(8, 1)
    def training_step(self, b, i):
        print(f"batch {{i}}", flush=True); time.sleep(0.1)
        return torch.nn.functional.mse_loss(self.net(b[0]), b[1])
    def validation_step(self, b, i):
        print(f"val {{i}}", flush=True); time.sleep({VAL_SECONDS})
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = DataLoader(TensorDataset(torch.randn(640, 8), torch.randn(640, 1)), batch_size=8)
callbacks = []
if use_callback:
    from preemptible.lightning import GracefulInterruptCallback
    callbacks.append(GracefulInterruptCallback(save_dir))
trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                     val_check_interval=4, num_sanity_val_steps=0,
                     limit_val_batches={VAL_BATCHES})
trainer.fit(M(), data, data)
"""
CASES = ("batch", "validation")
HANDLING = {True: "GracefulInterruptCallback", False: "Lightning's own SIGTERM"}


def one(case: str, use_callback: bool, rng: random.Random) -> tuple[float, int, bool]:
    """Seconds from SIGTERM to exit, the exit code, and whether resume.ckpt was written."""
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, "1" if use_callback else "0", d],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert proc.stdout is not None
        if case == "batch":
            target = f"batch {rng.choice([3, 7, 11])}"  # a batch after which validation is due
            delay = 0.05
        else:  # any moment of a validation batch but the last
            target = f"val {rng.randrange(VAL_BATCHES - 1)}"
            delay = rng.uniform(0.05, VAL_SECONDS - 0.05)
        for line in proc.stdout:
            if line.strip() == target:
                break
        else:
            raise RuntimeError(f"the fit ended before {target!r}")
        time.sleep(delay)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)  # drains stdout while waiting
        return time.monotonic() - sent, proc.returncode, (Path(d) / "resume.ckpt").exists()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    rng = random.Random(0)
    results: dict[tuple[str, bool], list[tuple[float, int, bool]]] = {}
    for _ in range(args.repeats):
        for case in CASES:
            for use in (True, False):
                results.setdefault((case, use), []).append(one(case, use, rng))
    rows = []
    for (case, use), runs in results.items():
        times = [t for t, _, _ in runs]
        codes = Counter(c for _, c, _ in runs)
        rows.append(
            [
                case,
                HANDLING[use],
                f"{median(times):.2f} s",
                f"{max(times):.2f} s",
                ", ".join(str(c) for c in sorted(codes)),
                f"{sum(s for _, _, s in runs)}/{len(runs)}",
            ]
        )
    print(f"machine: {machine()}; median of {args.repeats}, interleaved\n")
    header = ["SIGTERM during", "handling", "→ exit (median)", "worst", "exit code", "checkpoint"]
    print(table(header, rows))


if __name__ == "__main__":
    main()
