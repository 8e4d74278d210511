"""The accelerate front end: ``PreemptibleLoop`` for a training loop of one's own on
``accelerate.Accelerator`` (``pip install 'preemptible[transformers]'``, which has accelerate).

    from preemptible.accelerate import PreemptibleLoop

    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(...)
    loop = PreemptibleLoop(accelerator, "ckpt")           # resumes: accelerator.load_state
    for epoch in loop.epochs(num_epochs):                   # from the resumed epoch
        for batch in loop.batches(train_dataloader):       # from the resumed batch
            ...                                             # the loop's own step

accelerate is imported here, not by ``import preemptible``.
"""

from ._loop import PreemptibleLoop

__all__ = ["PreemptibleLoop"]
