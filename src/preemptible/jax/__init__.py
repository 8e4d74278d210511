"""JAX training loops (Flax NNX with Orbax checkpoints) that stop cleanly and resume exactly:
``PreemptibleLoop``.

A front end of the kit (``preemptible.frontend``), like the accelerate loop: the kit's stop
session owns the signal latch, the platform watcher, the grace policy, periodic saves, the
directory lock, the run record, the tracker and the exit. What this front end adds:

- where the boundaries are: ``batches(iterable)`` yields the epoch's batches, and the moment
  the loop asks for the next one is the step's boundary; ``epochs(n)`` yields the epochs from
  the resumed one, and the end of each is a boundary too;
- the checkpoint is Orbax's: the ``nnx.state`` of every object given in ``state=`` (weights,
  optimizer state and step, the keys and counts of every ``nnx.Rngs`` stream the model holds:
  a dropout's PRNG key is state like any other), written by an Orbax checkpointer
  (``StandardCheckpointer`` by default) into ``checkpoint-N/state``, restored from it into the
  same objects (``nnx.update``), with the shardings the live arrays have;
- the commit is the kit's: Orbax writes into a temporary of the store (``StagedSaver``), which
  is committed as ``checkpoint-N`` (fsync, rename, directory fsync; a bucket's URL uploads it);
  a kill mid-save leaves a temporary that the next start removes, never a ``checkpoint-N``;
- the data position, in a small JSON file of each process beside Orbax's directory: the epoch,
  the batches of it trained, and the global random states of Python and NumPy as the epoch
  began and as the step ended (a shuffle drawn from NumPy's global generator at the epoch's
  start is drawn again the same way). A resumed epoch's first batches are drawn from the
  iterable and not trained on: the data's order, and what comes after, is that of a run never
  stopped.

JAX has no global random state: every key the training uses must live in the objects given
(an ``nnx.Rngs`` in the model, or given itself in ``state=``), or be derived from the step.
``import preemptible`` imports no JAX; ``preemptible.jax`` imports jax, flax and orbax.
"""

from __future__ import annotations

from ._loop import PreemptibleLoop

__all__ = ["PreemptibleLoop"]
