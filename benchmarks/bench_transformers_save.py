"""What a Hugging Face Trainer checkpoint costs with ``PreemptionCallback``, beside the raw
write of its bytes and the Trainer's own save, side by side in one run (issue 33).

One child per figure and round, the variants interleaved (the order rotated each round): a
GPT-2 from a config (``--hidden``, ``--layers``; AdamW, so the optimizer's state is twice the
weights) trains ``--saves`` steps on the CPU with ``save_steps=1``. A save is timed from the
step's end to the Trainer's next step (``_maybe_log_save_evaluate``: the Trainer's writing, the
callbacks' ``on_save``, the callback's commit; logging and evaluation off). Beside it, in the
same child after training, the *raw write*: the checkpoint's number of bytes written 16 MiB a
call and fsynced into one file on the same disk. Saves after the first are the figure (the
first pays one-time costs of both); medians.

  trainer    the Trainer's own save, no callback (no fsync, no commit: not crash-safe)
  callback   ``PreemptionCallback``: the same save staged, fsynced and committed
  before     the callback from ``--before DIR`` (another version of preemptible, for
             before/after), when given

    .venv/bin/python benchmarks/bench_transformers_save.py [--hidden 768] [--layers 4]
        [--saves 4] [--repeats 3] [--dir DIR] [--before DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import disk_of, machine, median, table, write_and_fsync

SRC = Path(__file__).resolve().parent.parent / "src"


def child(directory: str, variant: str, saves: int, hidden: int, layers: int) -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = (torch.arange(16) * (i + 1)) % 512
            return {"input_ids": ids, "labels": ids}

    times: list[float] = []

    class Timed(Trainer):  # type: ignore[misc]
        saved = False

        def _save_checkpoint(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.saved = True
            return super()._save_checkpoint(*args, **kwargs)

        def _maybe_log_save_evaluate(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.saved, started = False, time.perf_counter()
            result = super()._maybe_log_save_evaluate(*args, **kwargs)
            if self.saved:  # not the epoch's end after the last step's save
                times.append(time.perf_counter() - started)
            return result

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=16, n_embd=hidden, n_layer=layers, n_head=8)
    out = Path(directory) / "out"
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=saves,
        save_steps=1,
        per_device_train_batch_size=2,
        logging_strategy="no",
        eval_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
    )
    callbacks = []
    if variant != "trainer":
        from preemptible.transformers import PreemptionCallback

        callbacks.append(PreemptionCallback())
    trainer = Timed(
        model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(), callbacks=callbacks
    )
    trainer.train()
    last = out / f"checkpoint-{saves}"
    nbytes = sum(p.stat().st_size for p in last.rglob("*") if p.is_file())
    raws = []
    for _ in times:
        raw = Path(directory) / "raw"
        started = time.perf_counter()
        write_and_fsync(raw, nbytes)
        raws.append(time.perf_counter() - started)
        raw.unlink()
    print(json.dumps({"saves": times, "raw": raws, "bytes": nbytes}))


def run_child(
    variant: str, src: str | None, args: argparse.Namespace, base: Path
) -> dict[str, object]:
    env = dict(os.environ)
    env["PYTHONPATH"] = src or str(SRC)
    with tempfile.TemporaryDirectory(dir=base) as d:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            d,
            "callback" if variant == "before" else variant,
            str(args.saves),
            str(args.hidden),
            str(args.layers),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if done.returncode != 0:
            sys.exit(f"{variant}: the child failed:\n{done.stderr[-4000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        directory, variant, saves, hidden, layers = sys.argv[2:7]
        child(directory, variant, int(saves), int(hidden), int(layers))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=768, help="GPT-2's n_embd")
    p.add_argument("--layers", type=int, default=4, help="GPT-2's n_layer")
    p.add_argument("--saves", type=int, default=4, help="steps, each saved")
    p.add_argument("--repeats", type=int, default=3, help="rounds")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: the temp dir)")
    p.add_argument("--before", default=None, help="src directory of another preemptible")
    args = p.parse_args()
    if args.saves < 2:
        p.error(f"--saves {args.saves}: at least 2 (the first save is not a figure)")
    base = Path(args.dir or tempfile.gettempdir())
    variants = ["trainer", "callback"] + (["before"] if args.before else [])
    got: dict[str, dict[str, list[float]]] = {v: {"save": [], "ratio": []} for v in variants}
    nbytes = 0
    for r in range(args.repeats):
        for variant in variants[r % len(variants) :] + variants[: r % len(variants)]:
            src = args.before if variant == "before" else None
            res = run_child(variant, src, args, base)
            saves, raws = res["saves"][1:], res["raw"][1:]  # type: ignore[index]
            got[variant]["save"].extend(saves)
            got[variant]["ratio"].extend(s / w for s, w in zip(saves, raws, strict=True))
            got[variant].setdefault("raw", []).extend(raws)
            nbytes = int(res["bytes"])  # type: ignore[call-overload]
    rows = [
        [
            variant,
            ms(median(got[variant]["save"])),
            ms(median(got[variant]["raw"])),
            f"{median(got[variant]['ratio']):.2f}",
        ]
        for variant in variants
    ]
    print(
        f"{machine()}; checkpoints on {disk_of(str(base))}; GPT-2 n_embd={args.hidden} "
        f"n_layer={args.layers}, AdamW: {nbytes / 2**20:.0f} MiB a checkpoint; "
        f"{args.repeats} rounds of {args.saves - 1} timed saves (medians)"
    )
    print(table(["variant", "save", "raw write", "save / raw write"], rows))


if __name__ == "__main__":
    main()
