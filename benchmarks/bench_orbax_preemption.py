"""A Flax NNX loop stopped by a signal and run again: Orbax's own preemption path against
``preemptible.jax.PreemptibleLoop``, on the same loop (CPU, one process).

The loop: an MLP (256 → 1024 → 1024 → 1, dropout drawing from the model's ``nnx.Rngs``; 15 MiB
of weights and Adam state), 50 steps of batches shuffled per epoch, each step about 50 ms of
sleep after the jitted update, periodic checkpoints every ``--every`` steps in both variants:

- **Orbax**: as Orbax's preemption guide and MaxText do it. ``jax.distributed.initialize`` with
  one process and a coordinator on localhost (Orbax's preemption support is JAX's preemption
  sync manager, which lives in the coordination service), an ``ocp.CheckpointManager`` with
  ``save_interval_steps``, ``manager.save(step, ...)`` after every step (it saves on the
  interval, and at the preemption sync point), then ``if manager.reached_preemption(step):
  manager.wait_until_finished(); sys.exit()``. A resume restores ``manager.latest_step()``.
  The data position is the step (each epoch's order is seeded by the epoch).
- **PreemptibleLoop**: ``PreemptibleLoop(dir, state=..., save_every_steps=...)`` around the
  same epochs and batches; no ``jax.distributed``.
- ``--variants orbax-nodist`` (not run by default): the Orbax loop without
  ``jax.distributed.initialize``, as the guide's example is written; ``reached_preemption``
  is then always False and a SIGTERM kills the process.

Each variant is sent each signal 20 ms after a random step's line (the same steps for both
variants, the variants interleaved); the same command then runs to the end. ``TERM+TERM``: a
second SIGTERM 0.6 s after the first, if the process is still there (an impatient operator, a
supervisor's second notice). Reported per variant and signal, over --repeats:

- exit code: what the parent's waitpid saw (what a scheduler sees; ``killed by X``: the signal's
  default action ended the process);
- signal → gone: seconds from ``send_signal`` to the parent's waitpid (median and range);
- trained after: steps the process trained after the signal reached it (median and range);
- replayed: steps the resumed run trained again (the last step trained before the exit minus
  the step the resume starts from; median and range);
- exact: whether the resumed run ends with every array (weights, Adam moments and count, the
  dropout's key and count) equal, bit for bit, to an uninterrupted run of the same variant.

    .venv/bin/python benchmarks/bench_orbax_preemption.py [--repeats 2] [--every 5]
        [--signals TERM,USR1,INT,TERM+TERM] [--variants orbax,ours,orbax-nodist]
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import machine, median, table

STEPS = 50
BATCHES = 10  # per epoch
CHILD = r"""
import os, sys, time
how, d, out, every, total, pause, port = sys.argv[1:8]
every, total, pause = int(every), int(total), float(pause)
import jax
if how == "orbax":  # Orbax's preemption path is JAX's, in the coordination service
    jax.distributed.initialize(f"localhost:{port}", num_processes=1, process_id=0)
import numpy as np, optax
import orbax.checkpoint as ocp
from flax import nnx

BATCHES, B, D, H = 10, 32, 256, 1024
rs = np.random.RandomState(1)
x = rs.randn(BATCHES * B, D).astype("float32")
y = 2 * x[:, :1] + 0.1


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(D, H, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(H, H, rngs=rngs)
        self.l3 = nnx.Linear(H, 1, rngs=rngs)

    def __call__(self, v):
        return self.l3(nnx.relu(self.l2(self.drop(nnx.relu(self.l1(v))))))


model = MLP(nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, xb, yb):
    loss, grads = nnx.value_and_grad(lambda m: ((m(xb) - yb) ** 2).mean())(model)
    optimizer.update(model, grads)
    return loss


def epoch_batches(epoch):
    order = np.random.RandomState(100 + epoch).permutation(len(x))
    for i in range(BATCHES):
        idx = order[i * B : (i + 1) * B]
        yield x[idx], y[idx]


def trained(step, loss):
    loss.block_until_ready()
    print(f"step {step}", flush=True)
    time.sleep(pause)


if how.startswith("orbax"):
    options = ocp.CheckpointManagerOptions(save_interval_steps=every, max_to_keep=2)
    manager = ocp.CheckpointManager(os.path.abspath(d), options=options)
    start = manager.latest_step() or 0
    if start:
        live = nnx.state((model, optimizer))
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, live)
        restored = manager.restore(start, args=ocp.args.StandardRestore(abstract))
        nnx.update((model, optimizer), restored)
    print(f"start {start}", flush=True)
    for step in range(start, total):  # step: the steps trained before this one
        xb, yb = list(epoch_batches(step // BATCHES))[step % BATCHES]
        trained(step + 1, train_step(model, optimizer, xb, yb))
        manager.save(step + 1, args=ocp.args.StandardSave(nnx.state((model, optimizer))))
        if manager.reached_preemption(step + 1):
            manager.wait_until_finished()
            print(f"preempted {step + 1}", flush=True)
            sys.exit()
    manager.wait_until_finished()
else:
    from preemptible.jax import PreemptibleLoop

    state = {"model": model, "optimizer": optimizer}
    loop = PreemptibleLoop(d, state=state, save_every_steps=every)
    print(f"start {loop.step}", flush=True)
    for epoch in loop.epochs(total // BATCHES):
        for xb, yb in loop.batches(epoch_batches(epoch)):
            trained(loop.step + 1, train_step(model, optimizer, xb, yb))


def plain(v):
    return jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v


leaves = jax.tree.leaves(nnx.state((model, optimizer)))
np.savez(out, *[np.asarray(plain(v)) for v in leaves])
"""
VARIANTS = {
    "orbax": "Orbax CheckpointManager + reached_preemption",
    "ours": "preemptible.jax.PreemptibleLoop",
    # the same Orbax loop without jax.distributed.initialize (the preemption guide's example
    # calls none): reached_preemption is then always False
    "orbax-nodist": "the same Orbax loop, no jax.distributed",
}
DEFAULT_VARIANTS = "orbax,ours"
SIGNALS = {
    "TERM": (signal.SIGTERM,),
    "USR1": (signal.SIGUSR1,),
    "INT": (signal.SIGINT,),
    "TERM+TERM": (signal.SIGTERM, signal.SIGTERM),
}
# JAX's preemption notifier (XLA) logs when it sees the SIGTERM
CAUGHT = re.compile(r"SIGTERM caught at (\d{4}-\d\d-\d\dT[\d:]+)(?:\.(\d+))?([+-]\d\d:\d\d)")
SECOND_AFTER = 0.6  # s; preemptible ignores a repeat within 0.5 s (one keypress, one notice)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Run:
    """One child: its ``step N`` lines, the step it started from, its exit code, seconds from
    the first signal to its exit, and the tail of its stderr."""

    def __init__(self, how: str, d: Path, every: int, pause: float) -> None:
        self.args = [sys.executable, "-c", CHILD, how, str(d), str(d) + ".npz", str(every)]
        self.args += [str(STEPS), str(pause), str(free_port())]
        self.steps: list[int] = []
        self.start = -1
        self.rc = 0
        self.seconds = 0.0
        self.err = ""
        self.noticed: float | None = None  # s from the signal to JAX's "SIGTERM caught"
        self.second_sent = False
        self.at = 0  # the step after whose line the first signal was sent

    def go(self, signals: tuple[int, ...] = (), at: int = 0) -> Run:
        self.at = at
        with tempfile.TemporaryFile("w+") as err:
            child = subprocess.Popen(
                self.args,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env={**os.environ, "JAX_PLATFORMS": "cpu"},
            )
            assert child.stdout is not None
            sent = sent_at = 0.0
            for line in child.stdout:
                word, _, n = line.strip().partition(" ")
                if word == "start":
                    self.start = int(n)
                elif word == "step":
                    self.steps.append(int(n))
                    if signals and not sent and int(n) == at:
                        time.sleep(0.02)  # into the step's pause
                        sent, sent_at = time.monotonic(), time.time()
                        child.send_signal(signals[0])
                        if len(signals) > 1:
                            self._again(child, signals[1], sent)
            self.rc = child.wait(timeout=300)
            self.seconds = time.monotonic() - sent if sent else 0.0
            err.seek(0)
            text = err.read()
            self.err = text[-2000:]
        if caught := CAUGHT.search(text):
            self.noticed = caught_at(caught) - sent_at
        if signals:
            assert sent, f"the run ended before step {at}: {self.err}"
        return self

    def _again(self, child: subprocess.Popen[str], sig: int, sent: float) -> None:
        """The second signal ``SECOND_AFTER`` s after the first, from a thread: the parent keeps
        reading the child's lines meanwhile."""

        def later() -> None:
            time.sleep(max(0.0, sent + SECOND_AFTER - time.monotonic()))
            if child.poll() is None:
                child.send_signal(sig)
                self.second_sent = True

        threading.Thread(target=later, daemon=True).start()


def caught_at(m: re.Match[str]) -> float:
    """The notifier's timestamp (nanoseconds, which ``fromisoformat`` does not take) as epoch
    seconds."""
    whole = datetime.datetime.fromisoformat(m.group(1) + m.group(3)).timestamp()
    return whole + float("0." + (m.group(2) or "0"))


def same(a: Path, b: Path) -> bool:
    import numpy as np

    with np.load(a) as wa, np.load(b) as wb:
        return wa.files == wb.files and all(np.array_equal(wa[k], wb[k]) for k in wa.files)


def code(rc: int) -> str:
    return str(rc) if rc >= 0 else f"killed by {signal.Signals(-rc).name}"


def spread(values: list[float], fmt: str) -> str:
    if min(values) == max(values):
        return format(values[0], fmt)
    return f"{format(median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--every", type=int, default=5, help="periodic checkpoints, steps")
    p.add_argument("--pause", type=float, default=0.05, help="sleep after each step, s")
    p.add_argument("--signals", default=",".join(SIGNALS), help=f"of {', '.join(SIGNALS)}")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"of {', '.join(VARIANTS)}")
    args = p.parse_args()
    names, variants = args.signals.split(","), args.variants.split(",")
    if unknown := [n for n in names if n not in SIGNALS]:
        p.error(f"--signals: {', '.join(unknown)} not known; use some of {', '.join(SIGNALS)}")
    if unknown := [v for v in variants if v not in VARIANTS]:
        p.error(f"--variants: {', '.join(unknown)} not known; use some of {', '.join(VARIANTS)}")
    # a shell's background job ignores SIGINT, and so would the children: default action
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng = random.Random(0)
    # per variant and signal: the stopped run, the steps replayed, exact or not
    results: dict[tuple[str, str], list[tuple[Run, int, str]]] = {}
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        refs = {}
        for how in variants:
            ref = Run(how, base / f"ref-{how}", args.every, args.pause).go()
            assert ref.rc == 0, (how, ref.rc, ref.err)
            refs[how] = base / f"ref-{how}.npz"
        n = 0
        for r in range(args.repeats):
            for name in names:
                # early enough that Orbax's sync point (it trains on for a second) comes
                # before the run's end
                at = rng.randint(6, 16)
                for how in variants if r % 2 == 0 else variants[::-1]:
                    n += 1
                    d = base / f"{how}-{n}"
                    stopped = Run(how, d, args.every, args.pause).go(SIGNALS[name], at)
                    again = Run(how, d, args.every, args.pause).go()
                    if again.rc != 0:
                        exact = f"resume failed ({code(again.rc)}): {again.err[-300:]}"
                    else:
                        exact = "exact" if same(refs[how], Path(f"{d}.npz")) else "differs"
                    replayed = max(stopped.steps) - again.start
                    results.setdefault((how, name), []).append((stopped, replayed, exact))
    rows = []
    noticed = []
    for (how, name), got in sorted(results.items(), key=lambda kv: names.index(kv[0][1])):
        exacts = sorted({e for *_, e in got})
        runs = [run for run, *_ in got]
        noticed += [run.noticed for run in runs if run.noticed is not None]
        if len(SIGNALS[name]) > 1:
            name += f" (2nd sent {sum(run.second_sent for run in runs)}/{len(runs)})"
        rows.append(
            [
                VARIANTS[how],
                name,
                ", ".join(sorted({code(run.rc) for run in runs})),
                spread([run.seconds for run in runs], ".2f") + " s",
                spread([float(max(run.steps) - run.at) for run in runs], "g"),
                spread([float(rep) for _, rep, _ in got], "g"),
                f"{', '.join(exacts)} ({sum(e == 'exact' for *_, e in got)}/{len(got)})",
            ]
        )
    print(machine())
    print(
        f"{args.repeats} repeats per cell; {STEPS} steps of ~{args.pause * 1000:.0f} ms + the "
        f"update, periodic checkpoints every {args.every} steps; {time.monotonic() - began:.0f} s"
    )
    print(
        table(
            [
                "variant",
                "signal",
                "exit code",
                "signal → gone",
                "trained after",
                "replayed",
                "exact",
            ],
            rows,
        )
    )
    if noticed:
        print(
            f"JAX's preemption notifier logged 'SIGTERM caught' {spread(noticed, '.2f')} s after "
            f"the signal (median (range) of {len(noticed)})"
        )


if __name__ == "__main__":
    main()
