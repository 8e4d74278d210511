"""A tiny GAN shaped like keras-io's ``dcgan_overriding_train_step`` (and the GAN of its
``custom_train_step_in_{torch,tensorflow}`` guides), fit with
``preemptible.keras.PreemptionCallback``: the model holds its own ``d_optimizer`` and
``g_optimizer``, a ``SeedGenerator`` for the latent draws and two loss trackers, and overrides
``train_step``; ``compile()`` makes the default optimizer that nothing steps. The backend is
``KERAS_BACKEND``'s (torch or tensorflow). Run it again with the same arguments and it resumes.

Prints ``batch E B it=N`` after each batch (N: the discriminator optimizer's iterations),
``fit done it=N`` at the end, and writes every model and optimizer variable to ``--out``.
``--hold-numpy-rng``: the model also holds a NumPy generator, which the callback must refuse.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--out", required=True)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--hold-numpy-rng", action="store_true")
args = p.parse_args()

import keras  # noqa: E402

from preemptible.keras import PreemptionCallback  # noqa: E402

sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line

backend = keras.backend.backend()
if backend == "torch":
    import random

    import torch

    torch.set_num_threads(1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
else:
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.utils.set_random_seed(0)

LATENT = 8
images = np.random.RandomState(1).rand(48, 6, 6, 1).astype("float32")

discriminator = keras.Sequential(
    [
        keras.Input((6, 6, 1)),
        keras.layers.Conv2D(4, 3, strides=2, padding="same"),
        keras.layers.LeakyReLU(negative_slope=0.2),
        keras.layers.GlobalMaxPooling2D(),
        keras.layers.Dense(1),
    ],
    name="discriminator",
)
generator = keras.Sequential(
    [
        keras.Input((LATENT,)),
        keras.layers.Dense(3 * 3 * 4),
        keras.layers.LeakyReLU(negative_slope=0.2),
        keras.layers.Reshape((3, 3, 4)),
        keras.layers.Conv2DTranspose(4, 3, strides=2, padding="same"),
        keras.layers.LeakyReLU(negative_slope=0.2),
        keras.layers.Conv2D(1, 3, padding="same", activation="sigmoid"),
    ],
    name="generator",
)


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):  # type: ignore[no-untyped-def]
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        if args.hold_numpy_rng:
            self.noise = np.random.default_rng(0)

    def call(self, images):  # type: ignore[no-untyped-def]
        return self.discriminator(images)  # fit builds the model with it (torch backend)

    @property
    def metrics(self):  # type: ignore[no-untyped-def]
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):  # type: ignore[no-untyped-def]
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def _batch(self, real_images):  # type: ignore[no-untyped-def]
        batch_size = keras.ops.shape(real_images)[0]
        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        combined = keras.ops.concatenate([self.generator(latent), real_images], axis=0)
        labels = keras.ops.concatenate(
            [keras.ops.ones((batch_size, 1)), keras.ops.zeros((batch_size, 1))], axis=0
        )
        labels += 0.05 * keras.random.uniform(keras.ops.shape(labels), seed=self.seed_generator)
        misleading = keras.ops.zeros((batch_size, 1))
        return batch_size, combined, labels, misleading

    def train_step(self, real_images):  # type: ignore[no-untyped-def]
        if backend == "torch":
            return self._torch_step(real_images)
        return self._tf_step(real_images)

    def _tf_step(self, real_images):  # type: ignore[no-untyped-def]
        batch_size, combined, labels, misleading = self._batch(real_images)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        weights = self.discriminator.trainable_weights
        grads = tape.gradient(d_loss, weights)
        self.d_optimizer.apply_gradients(zip(grads, weights, strict=True))
        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(misleading, self.discriminator(self.generator(latent)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights, strict=True))
        return self._track(d_loss, g_loss)

    def _torch_step(self, real_images):  # type: ignore[no-untyped-def]
        batch_size, combined, labels, misleading = self._batch(real_images)
        self.zero_grad()
        d_loss = self.loss_fn(labels, self.discriminator(combined))
        d_loss.backward()
        grads = [v.value.grad for v in self.discriminator.trainable_weights]
        with torch.no_grad():
            self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        self.zero_grad()
        g_loss = self.loss_fn(misleading, self.discriminator(self.generator(latent)))
        g_loss.backward()
        grads = [v.value.grad for v in self.generator.trainable_weights]
        with torch.no_grad():
            self.g_optimizer.apply(grads, self.generator.trainable_weights)
        return self._track(d_loss, g_loss)

    def _track(self, d_loss, g_loss):  # type: ignore[no-untyped-def]
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


class Printer(keras.callbacks.Callback):
    """Listed before the preemption callback: it has printed the batch when a stop exits."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):  # type: ignore[no-untyped-def]
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
        it = int(keras.ops.convert_to_numpy(self.model.d_optimizer.iterations))
        print(f"batch {self.epoch} {batch} it={it}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)


gan = GAN(discriminator=discriminator, generator=generator, latent_dim=LATENT)
gan.compile(
    d_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
    g_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
    loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
)
gan.fit(
    images,
    batch_size=8,
    shuffle=True,
    epochs=args.epochs,
    callbacks=[Printer(), PreemptionCallback(args.dir)],
    verbose=0,
)
it = int(keras.ops.convert_to_numpy(gan.d_optimizer.iterations))
print(f"fit done it={it}", flush=True)
variables = [*gan.variables, *gan.d_optimizer.variables, *gan.g_optimizer.variables]
with open(args.out, "wb") as fh:
    np.savez(fh, *[keras.ops.convert_to_numpy(v) for v in variables])
sys.exit(0)
