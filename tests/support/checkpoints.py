"""What the front ends' stop tests read back from a checkpoint folder: the committed
checkpoints, the temporaries a stop must not leave, and whether two runs ended with the same
weights; and the Lightning fit script's command line."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import python_args


def same_weights(a: Path, b: Path) -> bool:
    """Two saved state dicts (``torch.save``) hold the same, non-empty, tensors bit for bit."""
    import torch

    wa, wb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return bool(wa) and wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def same_values(a: Path, b: Path) -> bool:
    """Two ``.npz`` files hold the same arrays, bit for bit."""
    import numpy as np

    with np.load(a, allow_pickle=False) as wa, np.load(b, allow_pickle=False) as wb:
        return wa.files == wb.files and all(np.array_equal(wa[k], wb[k]) for k in wa.files)


def committed(folder: Path, pattern: str = "step-*.ckpt") -> list[str]:
    """The names of the committed checkpoints in ``folder``, in order."""
    return sorted(p.name for p in folder.glob(pattern))


def temporaries(folder: Path, pattern: str = ".tmp-*") -> list[Path]:
    """The temporaries left in ``folder`` (a save never finished)."""
    return sorted(folder.glob(pattern))


def fit_args(d: Path, *extra: str, save_dir: str | None = None) -> list[str]:
    """The command line of ``scripts/fit.py`` (a Lightning fit) saving to ``d`` (``save_dir``:
    elsewhere, a bucket's URL, say; the weights still go to ``d/o.pt``)."""
    where = str(d) if save_dir is None else save_dir
    return python_args("fit.py", "--save-dir", where, "--out", str(d / "o.pt"), *extra)
