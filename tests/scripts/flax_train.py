"""A Flax NNX training loop shaped like Flax's MNIST tutorial (a module with dropout, an
``nnx.Optimizer``, ``nnx.MultiMetric``, an ``@nnx.jit`` train step, an epoch loop over batches
shuffled by NumPy), tiny, with ``preemptible.jax.PreemptibleLoop`` added as its docs page says.

Run it again with the same arguments and it resumes. Prints ``step N loss L`` after each step
(N: the optimizer's step count, which a batch drawn on resume leaves as it is), ``epoch E
loss=...`` after each epoch, ``done step=N`` at the end, and writes every array of the model and
the optimizer (the dropout's PRNG key among them) to ``--out`` (an ``.npz``). ``--slow-write
S``: each Orbax save of a step >= ``--slow-write-from`` prints ``writing STEP`` and sleeps S s
first (inside the checkpoint's temporary, which exists by then).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--out", required=True)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--save-every", type=int, default=None)
p.add_argument("--slow-write", type=float, default=0.0)
p.add_argument("--slow-write-from", type=int, default=0)
p.add_argument("--distributed", action="store_true")
args = p.parse_args()

if args.distributed:  # one CPU device per process, the processes found as torchrun's ranks
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        num_processes=int(os.environ["WORLD_SIZE"]),
        process_id=int(os.environ["RANK"]),
    )

from preemptible.jax import PreemptibleLoop  # noqa: E402

sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear1 = nnx.Linear(4, 16, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)
        self.linear2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear2(self.dropout(nnx.relu(self.linear1(x))))


np.random.seed(0)  # the epochs' shuffles
rs = np.random.RandomState(1)
x = rs.randn(48, 4).astype("float32")
y = (x.sum(1, keepdims=True) + 0.1 * rs.randn(48, 1)).astype("float32")
BATCH = 8

model = MLP(rngs=nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
if args.distributed:
    # data parallel over the processes: the state replicated, each batch split between them
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    jax.set_mesh(mesh)  # the arrays made in the loop (a metric's reset) are the mesh's too
    replicated = NamedSharding(mesh, PartitionSpec())
    split = NamedSharding(mesh, PartitionSpec("data"))

    def replicate(v: jax.Array) -> jax.Array:
        if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
            data = jax.make_array_from_process_local_data(replicated, jax.random.key_data(v))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(v))
        return jax.make_array_from_process_local_data(replicated, np.asarray(v))

    for obj in (model, optimizer, metrics):
        nnx.update(obj, jax.tree.map(replicate, nnx.state(obj)))


def loss_fn(model: MLP, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    return ((model(batch[0]) - batch[1]) ** 2).mean()


@nnx.jit
def train_step(model, optimizer, metrics, batch):  # type: ignore[no-untyped-def]
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    metrics.update(loss=loss)
    optimizer.update(model, grads)
    return loss


def batches():  # type: ignore[no-untyped-def]
    order = np.random.permutation(len(x))
    for i in range(0, len(x), BATCH):
        batch = x[order[i : i + BATCH]], y[order[i : i + BATCH]]
        if args.distributed:  # this process's part of the global batch
            n, k = jax.process_count(), jax.process_index()
            part = BATCH // n
            batch = tuple(
                jax.make_array_from_process_local_data(split, b[k * part : (k + 1) * part])
                for b in batch
            )
        yield batch


class SlowCheckpointer(ocp.StandardCheckpointer):  # type: ignore[misc]
    def save(self, directory, state, *a, **kw):  # type: ignore[no-untyped-def]
        step = int(state["optimizer"]["step"][...])
        if args.slow_write and step >= args.slow_write_from:
            print(f"writing {step}", flush=True)
            time.sleep(args.slow_write)
        return super().save(directory, state, *a, **kw)


loop = PreemptibleLoop(
    args.dir,
    state={"model": model, "optimizer": optimizer, "metrics": metrics},
    save_every_steps=args.save_every,
    checkpointer=SlowCheckpointer() if args.slow_write else None,
)
for epoch in loop.epochs(args.epochs):
    model.train()
    for batch in loop.batches(batches()):
        loss = train_step(model, optimizer, metrics, batch)
        print(f"step {int(optimizer.step[...])} loss {float(loss)!r}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    shown = " ".join(f"{k}={float(v)!r}" for k, v in metrics.compute().items())
    print(f"epoch {epoch} {shown}", flush=True)
    metrics.reset()
print(f"done step={int(optimizer.step[...])}", flush=True)


def plain(v: jax.Array) -> np.ndarray:
    return np.asarray(
        jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v
    )


values = [plain(v) for v in jax.tree.leaves(nnx.state((model, optimizer)))]
if jax.process_index() == 0:
    with open(args.out, "wb") as fh:
        np.savez(fh, *values)
sys.exit(0)
