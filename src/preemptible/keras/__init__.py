"""Keras 3 fits that stop cleanly and resume exactly: ``PreemptionCallback``.

A front end of the kit (``preemptible.frontend``), like ``PreemptionCheckpointHandler`` and
the Lightning callback: the kit's stop session owns the signal latch, the platform watcher,
the grace policy (insurance checkpoints, the last safe batch), periodic saves, the directory
lock, the run record, the tracker and the exit. The callback says where a fit has boundaries
(after each training batch; after a validation batch of the fit; the end of training) and how
its state is saved (``_state``: a NumPy ``.npz`` committed through the kit's ``NamedSaver``:
a temporary in the directory, fsync, rename, directory fsync).

What an exact mid-epoch resume needs from Keras 3 (found by experiment, keras 3.15.1, torch,
TensorFlow and JAX backends; each reliance on Keras internals has a ``test_keras_canary_*``):

- ``fit()`` calls ``on_train_begin`` and only then reads ``model._initial_epoch`` (what
  ``BackupAndRestore`` sets): the restore happens there, the fit starts at the saved epoch;
- ``fit()`` looks ``model.train_function`` up for every batch: for the batches of the
  resumed epoch that were trained before the stop, the callback's own function draws the
  batch (the data's order is the same) and trains nothing;
- the order of an epoch (torch's ``RandomSampler`` seed, Python's shuffle of a
  ``PyDataset``) is drawn at its first batch, after ``on_epoch_begin``: the random states of
  the epoch's start are put back there, and those of the saved batch's end once the skipped
  batches are drawn (dropout without a seed draws from torch's global generator);
- with ``keras.utils.set_random_seed``, TensorFlow shuffles array inputs in the same order
  every epoch, and dropout draws from the layers' ``SeedGenerator``, whose state is in
  ``model.variables``;
- JAX's fit passes the variables' values from step to step in a state of its own
  (``train_function`` takes and returns it) and may empty the variables while an epoch runs:
  a skipped batch hands the state back as it came, a save calls ``model.jax_state_sync()``
  first; dropout draws from the layers' ``SeedGenerator``s, as on TensorFlow.
"""

from __future__ import annotations

from ._callback import PreemptionCallback

__all__ = ["PreemptionCallback"]
