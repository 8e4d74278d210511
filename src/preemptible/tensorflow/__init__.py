"""TensorFlow custom loops that stop cleanly and resume exactly: ``PreemptionCheckpointHandler``
with the constructor and methods of TensorFlow's own
(``tf.distribute.experimental.PreemptionCheckpointHandler``), so that a loop written after
TensorFlow's docs is ported by changing one import.

A front end of the kit (``preemptible.frontend``): the kit's stop session owns the signal
latch, the platform watcher, the grace policy, periodic saves, the directory lock, the run
record and the exit. The handler says where its boundaries are (before each ``run()`` call,
where TensorFlow's handler checks too: a stop requested during a step is acted on before the
next one starts, with the count of steps done) and how it saves: the user's
``tf.train.Checkpoint``, the number of ``run()`` calls, the state of TensorFlow's global
random generator and those of the Keras models' ``SeedGenerator``s (dropout's), written by
``tf.train.Checkpoint.write`` into a directory ``tf-<step>`` (``ckpt.index``, ``ckpt.data-*``)
that the kit commits as a whole (a temporary directory, fsync of each file, rename, directory
fsync).
"""

from __future__ import annotations

from ._handler import PreemptionCheckpointHandler

__all__ = ["PreemptionCheckpointHandler"]
