"""The public surface: __all__ is complete, the import is light, the version is consistent."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import preemptible


def test_all_lists_every_public_name() -> None:
    public = {name for name in vars(preemptible) if not name.startswith("_")}
    modules = {name for name in public if type(getattr(preemptible, name)).__name__ == "module"}
    assert public - modules - {"annotations"} == set(preemptible.__all__) - {"__version__"}


def test_import_pulls_no_heavy_library() -> None:
    code = (
        "import sys, preemptible, preemptible.cli._main\n"
        "heavy = [m for m in ('torch', 'numpy', 'lightning', 'mlflow', 'wandb', 'psycopg',"
        " 'transformers', 'accelerate', 'keras', 'tensorflow', 'jax', 'flax', 'orbax',"
        " 'obstore', 'boto3')"
        " if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_single_process_run_imports_no_distributed_tensor_package(tmp_path) -> None:
    """torch.distributed.tensor brings sympy (470 modules): 0.5 s at every start, and some
    20 ms at every exit, the stop's included. A run without DTensors needs none of it."""
    code = (
        "import sys, torch, preemptible\n"
        "h = preemptible.PreemptionCheckpointHandler(sys.argv[1], {'m': torch.nn.Linear(2, 2)})\n"
        "for _ in h.steps(2): h.save()\n"
        "print([m for m in ('torch.distributed.tensor', 'sympy') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_version_matches_the_installed_metadata() -> None:
    assert preemptible.__version__ == version("preemptible")
