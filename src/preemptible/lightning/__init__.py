"""Lightning fits that stop cleanly and resume exactly: ``GracefulInterruptCallback``.

The callback is a front end of the kit (``preemptible.frontend``), like
``PreemptionCheckpointHandler``: the kit's stop session owns the signal latch, the platform
watcher, the grace policy, the agreement of DDP ranks, the run record, the tracker and the
exit. The callback only says where a Lightning fit has boundaries and how Lightning saves
there (``trainer.save_checkpoint`` into ``resume.ckpt``, committed through the kit's
``NamedSaver``: a temporary in ``save_dir``, fsync, rename, directory fsync). So a fit gets
every platform notice (GCE, EC2, Azure, SLURM time limit, stop file) and the grace policy: an
insurance ``resume.ckpt`` when a notice leaves time, the final one at the last safe batch.

Where a stop is acted on, and why there:

- after a training batch: the normal boundary; under DDP all ranks agree on the batch through
  the process group's key-value store (a write when a rank stops, a background poll, never a
  collective per batch);
- after a validation batch inside a fit (including the sanity check): waiting for the whole
  pass can eat a notice window. The checkpoint records the last finished training batch with
  the validation marked due, so the resumed fit runs that pass first (single process only:
  DDP ranks are not in lockstep during validation);
- at ``on_train_end``: a stop that arrived after the last training batch (final validation,
  epoch-end hooks) still saves and exits instead of being dropped; under DDP the ranks meet
  once in the store to learn whether any of them was asked.

Lightning's own save goes through an fsspec transaction whose temporary lives in /tmp (a copy,
not a rename, across file systems) and is never fsynced; on a spot VM that powers off right
after the exit, such a file can be empty or missing. ``resume.ckpt`` never is.

The modules: ``_callback`` (the hooks), ``_resume`` (RNG and data position of an exact
resume, through Lightning's loops), ``_signals`` (Lightning's signal connector).
"""

from __future__ import annotations

from ._callback import GracefulInterruptCallback

__all__ = ["GracefulInterruptCallback"]
