"""The Hugging Face Trainer front end: ``PreemptionCallback`` (``pip install
'preemptible[transformers]'``).

    from preemptible.transformers import PreemptionCallback
    from transformers.trainer_utils import get_last_checkpoint

    trainer = Trainer(model, args, train_dataset=data, callbacks=[PreemptionCallback()])
    trainer.train(resume_from_checkpoint=get_last_checkpoint(args.output_dir))

transformers is imported here, not by ``import preemptible``.
"""

from ._callback import PreemptionCallback

__all__ = ["PreemptionCallback"]
