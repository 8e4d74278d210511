"""Canary: what ``PreemptionCallback`` relies on in the Trainer, beyond its documented hooks.

transformers is pinned (constraints.txt: 5.23.0). When one of these fails after an upgrade,
the callback's atomic commit or its exact resume has to be looked at again:

- a save reads ``args.output_dir`` when it happens (``_get_output_dir``), after ``on_step_end``
  and before ``on_save``, and writes ``checkpoint-{global_step}`` under it;
- the default callbacks (``DefaultFlowCallback``, which asks for ``save_steps`` saves in its
  ``on_step_end``) run before the user's;
- ``on_save`` resets ``should_save``; the loop calls ``on_epoch_end`` (and may save there)
  after a stop asked for in ``on_step_end``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


class Tokens(torch.utils.data.Dataset):  # type: ignore[misc]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = torch.arange(8) % 16
        return {"input_ids": ids, "labels": ids}


def test_transformers_canary_save_reads_output_dir_at_save_time(tmp_path: Path) -> None:
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )
    from transformers.trainer_callback import DefaultFlowCallback

    staged = tmp_path / "staged"
    staged.mkdir()
    events: list[tuple[str, int, bool]] = []

    class Probe(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            events.append(("step_end", state.global_step, control.should_save))
            if state.global_step == 2:
                self.kept = args.output_dir
                args.output_dir = str(staged)
                control.should_training_stop = True

        def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            events.append(("save", state.global_step, control.should_save))
            args.output_dir = self.kept

        def on_epoch_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            events.append(("epoch_end", state.global_step, control.should_save))

    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=4,
        report_to=[],
        disable_tqdm=True,
    )
    probe = Probe()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[probe])
    callbacks = trainer.callback_handler.callbacks
    assert isinstance(callbacks[0], DefaultFlowCallback) and probe in callbacks[1:]
    trainer.train()
    # save_steps=2: DefaultFlowCallback asked for the save of step 2 before Probe's hook ran;
    # it went to the directory output_dir named at that moment, then on_save came
    assert ("step_end", 2, True) in events
    assert events.index(("save", 2, False)) == events.index(("step_end", 2, True)) + 1
    assert (staged / "checkpoint-2" / "trainer_state.json").is_file()
    assert not (tmp_path / "out" / "checkpoint-2").exists()
    assert events[-1][0] == "epoch_end" and events[-1][1] == 2  # after the stop
