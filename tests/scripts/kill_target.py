"""Saves checkpoints back to back until it is killed (the SIGKILL stress test's victim).

--mode blob: save_fn writes a self-checking file (sha256 of the body first); no torch import,
so the process starts fast and most of its life is spent inside saves.
--mode torch: the default torch.save path with a real model and optimizer.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

import preemptible

sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--mode", choices=["blob", "torch"], default="blob")
    p.add_argument("--size", type=int, default=4 << 20)
    args = p.parse_args()

    if args.mode == "blob":

        def save_fn(path: Path) -> None:
            print("saving", flush=True)
            body = os.urandom(args.size)
            with open(path, "wb") as fh:
                fh.write(hashlib.sha256(body).hexdigest().encode())
                fh.write(body)

        handler = preemptible.PreemptionCheckpointHandler(
            args.ckpt,
            termination_config=preemptible.TerminationConfig(save_fn=save_fn),
            save_every_steps=1,
            keep=2,
        )
        for _ in handler.steps(10**9):
            pass
    else:
        import torch

        model = torch.nn.Linear(512, 512)
        opt = torch.optim.Adam(model.parameters())

        class Announce:
            def state_dict(self) -> dict[str, int]:
                print("saving", flush=True)
                return {}

            def load_state_dict(self, sd: dict[str, int]) -> None:
                pass

        handler = preemptible.PreemptionCheckpointHandler(
            args.ckpt,
            {"model": model, "optimizer": opt, "announce": Announce()},
            save_every_steps=1,
            keep=2,
        )
        for _ in handler.steps(10**9):
            model(torch.randn(4, 512)).sum().backward()
            opt.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
