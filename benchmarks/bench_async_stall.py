"""Training-loop stall per save: synchronous saves against ``async_save=True``.

A model and its Adam state (parameters + two moments, float32, in several tensors) of about
100 MB and 1 GB, trained with cheap steps (small matmuls on one torch thread, so that the
background writer competes for the CPU the way it would) through ``handler.run()``, with a
save every ``--every`` steps through the real ``PreemptionCheckpointHandler``. Three modes,
each in a fresh process (so that memory peaks do not mix), the order rotated each round:

  none   no saves (the loop alone)
  sync   save_every_steps, synchronous
  async  save_every_steps, async_save=True

``--sharded``: the same with ``sharded=True`` (torch.distributed.checkpoint in one process, a
real ``torch.optim.Adam`` so that its state goes through DCP too): ``sync`` is ``dcp.save``,
``async`` is ``dcp.async_save`` with preemptible's reused staging (DCP's ``DefaultStager``).

``--device cuda``: the state lives on the GPU (the staging is page-locked host memory).

Beside each stall the *limit*, measured in the same process just before each save point: a
copy of the same tensors into host buffers allocated once and reused (on the CPU a memcpy; on a
GPU non-blocking copies into pinned buffers on a side stream, one event waited for at the end).
``--src DIR``: run the children with DIR first on PYTHONPATH (another version, for before/after).

Per save: the *stall*, the time the save point takes on the training thread (the copy to host
memory, and any wait for the previous write: *waited* counts the save points that found one
still in flight); the first save apart (async: it allocates the staging buffers); the *write*,
the save itself (sync) or the background write (async). Per run: the whole run time for the
same number of steps, up to the last checkpoint committed; peak memory (VmHWM) above the
process with its state built, and the bytes held in staging buffers.

    .venv/bin/python benchmarks/bench_async_stall.py [--sizes 100 1000] [--repeats 3] [--quick]
        [--sharded] [--device cpu|cuda] [--src DIR]
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
from typing import Any

from _common import disk_of, machine, median, table

MODES = ("none", "sync", "async")
MATMULS = 8  # per step: a few ms on one core


def vm(field: str) -> int:
    """A VmXXX line of /proc/self/status, in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


class AdamState:
    """Adam's two moments per parameter, with torch.optim.Adam's state_dict layout (what a save
    writes); not the class itself, whose constructor imports torch._dynamo (3-6 s here)."""

    def __init__(self, params: list[Any]) -> None:
        import torch

        self.state: dict[int, Any] = {
            i: {"step": torch.tensor(1.0), "exp_avg": p.detach() / 2, "exp_avg_sq": p.detach() ** 2}
            for i, p in enumerate(params)
        }
        self.group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.state, "param_groups": [{**self.group, "params": list(self.state)}]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state["state"]


def tensors_of(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in tensors_of(v)]
    return []


class CopyLimit:
    """The physical limit of a snapshot: the same tensors copied into host buffers allocated
    once (pinned for a GPU) and reused, timed at each save point."""

    def __init__(self, tensors: list[Any], device: str) -> None:
        import torch

        self.torch = torch
        self.cuda = device == "cuda"
        self.bufs = [
            torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.cuda) for t in tensors
        ]
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.measure(tensors)  # faults the buffers in

    def measure(self, tensors: list[Any]) -> float:
        torch = self.torch
        t0 = time.perf_counter()
        if self.stream is None:
            for b, t in zip(self.bufs, tensors, strict=True):
                b.copy_(t)
        else:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for b, t in zip(self.bufs, tensors, strict=True):
                    b.copy_(t, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
            done.synchronize()
        return time.perf_counter() - t0


def child(
    size_mb: int,
    mode: str,
    every: int,
    saves: int,
    directory: str,
    threads: int,
    sharded: bool,
    device: str,
) -> None:
    import torch

    from preemptible import PreemptionCheckpointHandler, TerminationConfig

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    n = size_mb * 2**20 // 4 // 3 // 8  # 8 parameter tensors; Adam adds two moments each
    model = torch.nn.ParameterDict(
        {f"w{i}": torch.nn.Parameter(torch.rand(n, device=device)) for i in range(8)}
    )
    opt: Any = AdamState(list(model.parameters()))
    if sharded:  # DCP writes modules and optimizers: a real Adam, its state made by one step
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        for p in model.parameters():
            p.grad = None
    state_bytes = 3 * 8 * n * 4
    rss_state = vm("VmRSS")

    x, w = torch.rand(128, 256, device=device), torch.rand(256, 256, device=device) / 16
    first = next(iter(model.parameters()))
    bodies: list[float] = []

    def step() -> None:
        t0 = time.perf_counter()
        with torch.no_grad():
            y = x
            for _ in range(MATMULS):
                y = torch.tanh(y @ w)
            first[:4096].add_(y[0, 0] * 1e-3)  # the state changes between saves
            if device == "cuda":
                torch.cuda.synchronize()  # a step's time is its kernels' time
        bodies.append(time.perf_counter() - t0)

    handler = PreemptionCheckpointHandler(
        Path(directory) / "ckpt",
        {"model": model, "optimizer": opt},
        termination_config=TerminationConfig(),
        keep=2,
        save_every_steps=None if mode == "none" else every,
        async_save=mode == "async",
        sharded=sharded,
    )
    steps = every * saves

    def everything() -> list[Any]:  # what a save copies: the model's and the optimizer's tensors
        return tensors_of(model.state_dict()) + tensors_of(opt.state_dict())

    limit = None if mode == "none" else CopyLimit(everything(), device)
    limits: list[float] = []
    stalls: list[float] = []
    waits: list[float] = []  # the part of each stall spent waiting for the previous write
    waiting = [0.0]
    # the async saver of this version (the handler's session, its StateSaver, the saver in it)
    saver = getattr(handler._session.saver.inner, "async_saver", None)
    if saver is not None:
        wait = saver.wait

        def timed_wait() -> Any:
            t0 = time.perf_counter()
            try:
                return wait()
            finally:
                waiting[0] += time.perf_counter() - t0

        saver.wait = timed_wait  # type: ignore[method-assign]
    started = time.perf_counter()
    for i in range(steps):
        waiting[0] = 0.0
        if limit is not None and (i + 1) % every == 0:  # the copy limit, here and now
            limits.append(limit.measure(everything()))
        t0 = time.perf_counter()
        handler.run(step)
        if (i + 1) % every == 0 and mode != "none":
            stalls.append(time.perf_counter() - t0 - bodies[-1])
            waits.append(waiting[0])
    staging = 0 if saver is None else saver.snapshot.nbytes  # close() may free them
    t0 = time.perf_counter()
    handler.close()  # async: waits for the last write
    closing = time.perf_counter() - t0
    run = time.perf_counter() - started
    print(
        json.dumps(
            {
                "stalls": stalls,
                "limits": limits,
                "waits": waits,
                "write": handler.save_times.median() if mode != "none" else 0.0,
                "close": closing,
                "run": run,
                "step": median(bodies),
                "state_bytes": state_bytes,
                "peak_over_state": vm("VmHWM") - rss_state,
                "staging": staging,
                "committed": len(list((Path(directory) / "ckpt").glob("step-*.ckpt"))),
            }
        )
    )


def run_child(args: argparse.Namespace, size: int, mode: str, every: int, base: Path) -> Any:
    with tempfile.TemporaryDirectory(dir=base) as d:
        cmd = [sys.executable, __file__, "--child", str(size), mode, str(every)]
        cmd += [str(args.saves), d, str(args.threads), str(int(args.sharded)), args.device]
        env = dict(os.environ)
        if args.src:
            env["PYTHONPATH"] = args.src
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        return json.loads(out.strip().splitlines()[-1])


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        size, mode, every, saves, directory, threads, sharded, device = sys.argv[2:10]
        child(
            int(size), mode, int(every), int(saves), directory, int(threads), sharded == "1", device
        )
        return
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[100, 1000], help="state, MiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--saves", type=int, default=3, help="saves per run; the first allocates")
    p.add_argument(
        "--every", type=int, default=None, help="steps between saves (default 100 + 1 per MiB)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads of the training loop")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: the temp dir)")
    p.add_argument("--quick", action="store_true", help="100 MiB, sync and async, 2 saves")
    p.add_argument("--sharded", action="store_true", help="sharded=True (DCP save, async_save)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the state is")
    p.add_argument("--modes", nargs="+", choices=MODES, default=None, help="default: all")
    p.add_argument("--src", default=None, help="PYTHONPATH of the children (another version)")
    args = p.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA device here; use --device cpu")
    modes = MODES[1:] if args.sharded else MODES
    if args.quick:
        args.sizes, args.repeats, args.saves, modes = [100], 1, 2, ("sync", "async")
        args.every = args.every or 100
    if args.modes:
        modes = tuple(m for m in modes if m in args.modes)
    base = Path(args.dir or tempfile.gettempdir())
    rows, ratios = [], []
    for size in args.sizes:
        every = args.every or 100 + 3 * size  # longer than a write, even on a busy machine
        got: dict[str, list[Any]] = {m: [] for m in modes}
        for r in range(args.repeats):
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:  # rotate the order
                got[mode].append(run_child(args, size, mode, every, base))
        steady: dict[str, float] = {}
        limit: dict[str, float] = {}
        for mode in modes:
            runs = got[mode]
            saves = 0 if mode == "none" else args.saves
            assert all(g["committed"] == min(2, saves) for g in runs), runs
            later = [s for g in runs for s in g["stalls"][1:]]
            steady[mode] = median(later) if later else 0.0
            lim = median([x for g in runs for x in g["limits"]]) if mode != "none" else 0.0
            limit[mode] = lim
            first = median([g["stalls"][0] for g in runs]) if mode != "none" else 0.0
            waits = [w for g in runs for w in g["waits"][1:]] or [0.0]
            waited = sum(w > 0.001 for w in waits)
            dash = mode == "none"
            rows.append(
                [
                    f"{size} MiB",
                    f"sharded {mode}" if args.sharded else mode,
                    "-" if dash else ms(steady[mode]),
                    "-" if dash else ms(limit[mode]),
                    "-" if dash else f"{steady[mode] / limit[mode]:.2f}",
                    "-" if dash else f"{ms(first)} ({first / limit[mode]:.2f})",
                    "-" if dash else ms(median([g["write"] for g in runs])),
                    "-" if dash else f"{waited}/{len(later)}, {ms(median(waits))}",
                    ms(median([g["step"] for g in runs])),
                    f"{median([g['run'] for g in runs]):.2f} s",
                    f"{median([g['peak_over_state'] for g in runs]) / 2**20:.0f} MiB",
                    # DCP's stager keeps its buffers: peak RSS shows them
                    "-"
                    if args.sharded
                    else f"{median([g['staging'] for g in runs]) / 2**20:.0f} MiB",
                ]
            )
        if "async" in steady and "sync" in steady:
            ratios.append(
                f"{size} MiB: async/sync stall = {steady['async'] / steady['sync']:.3f} "
                f"({ms(steady['async'])} / {ms(steady['sync'])}); {every} steps between saves, "
                f"{every * args.saves} steps per run"
            )
    print(
        f"machine: {machine()}; disk {disk_of(str(base))}; {args.saves} saves per run, "
        f"torch threads {args.threads}; state on {args.device}; median of {args.repeats} rounds"
        f"{'; source ' + args.src if args.src else ''}"
        f"{'; sharded (DCP)' if args.sharded else ''}\n"
    )
    header = ["state", "mode", "stall/save", "copy limit", "stall/limit"]
    header += ["first save stall (/limit)", "save or write", "waited"]
    header += ["step", "run", "peak RSS over state", "staging"]
    print(table(header, rows))
    print()
    for line in ratios:
        print(line)


if __name__ == "__main__":
    main()
