"""Sweep files as people write them and run them with W&B (issue 36): what W&B's CLI accepts
(it reads the file with PyYAML) is accepted with a warning naming the key and the line, and a
file with several mistakes is answered with all of them at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from preemptible import ConfigError
from preemptible.sweeps.spec._spec import load_spec

pytestmark = pytest.mark.timeout(60)

# the shape of the real files that were refused: numbers in YAML 1.2's spelling, which PyYAML
# (YAML 1.1) reads as text
EXPONENTS = """\
program: train.py
method: bayes
metric:
  name: val_loss
  goal: minimize
parameters:
  lr:
    distribution: log_uniform_values
    min: 1e-6
    max: 1e-3
  weight_decay:
    values: [0.0, 1e-4]
  epochs:
    value: 3
"""


def write(tmp_path: Path, text: str, name: str = "sweep.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


DB = "sqlite:s.db"


def sweep_create(where: Path) -> subprocess.CompletedProcess[str]:
    """``preemptible sweep create sweep.yaml`` in ``where``, with none of the test's own
    PREEMPTIBLE_ variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
    return subprocess.run(
        [sys.executable, "-m", "preemptible", "sweep", "create", "sweep.yaml", "--db", DB],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )


def test_a_number_yaml_1_1_reads_as_text_is_the_number_with_a_warning_naming_key_and_line(
    tmp_path: Path,
) -> None:
    spec = load_spec(write(tmp_path, EXPONENTS))
    lr = spec.parameters["lr"]
    assert (lr.min, lr.max) == (1e-6, 1e-3)
    assert spec.parameters["weight_decay"].values == (0.0, 1e-4)
    assert spec.raw["parameters"]["lr"]["min"] == 1e-6  # what the queue stores: the number
    assert spec.warnings == (
        "parameters.lr.min: line 9: 1e-6 is text to YAML 1.1 (PyYAML, W&B); taken as the "
        "number 1e-06",
        "parameters.lr.max: line 10: 1e-3 is text to YAML 1.1 (PyYAML, W&B); taken as the "
        "number 0.001",
        "parameters.weight_decay.values[1]: line 12: 1e-4 is text to YAML 1.1 (PyYAML, W&B); "
        "taken as the number 0.0001",
    )


def test_a_quoted_number_is_still_text_and_the_hint_reads_as_advice(tmp_path: Path) -> None:
    text = EXPONENTS.replace("min: 1e-6", "min: '1e-6'")
    with pytest.raises(ConfigError) as info:
        load_spec(write(tmp_path, text))
    assert str(info.value) == (
        f"{tmp_path / 'sweep.yaml'}: parameters.lr.min: must be a number, not text '1e-6' "
        "(it is quoted, so it is text; write the number without quotes)"
    )


def test_a_key_written_twice_keeps_the_last_with_a_warning_naming_both_lines(
    tmp_path: Path,
) -> None:
    text = EXPONENTS.replace("  epochs:\n    value: 3\n", "  epochs:\n    value: 3\n    value: 5\n")
    spec = load_spec(write(tmp_path, text))
    assert spec.parameters["epochs"].value == 5  # as PyYAML, which W&B's CLI uses
    assert (
        "parameters.epochs: key 'value' is written twice on lines 14 and 15; the last is used, "
        "as PyYAML (and so W&B) reads it"
    ) in spec.warnings


def test_the_natural_log_forms_carry_wandbs_deprecation_warning(tmp_path: Path) -> None:
    text = EXPONENTS.replace(
        "distribution: log_uniform_values\n    min: 1e-6\n    max: 1e-3",
        "distribution: log_uniform\n    min: -13.8\n    max: -6.9",
    )
    spec = load_spec(write(tmp_path, text))
    assert spec.parameters["lr"].distribution == "log_uniform"  # read as W&B reads it
    assert (
        "parameters.lr: uses log_uniform, where min/max specify base-e exponents. Use "
        "log_uniform_values to specify limit values."
    ) in spec.warnings


def test_parameters_present_but_empty_says_so(tmp_path: Path) -> None:
    text = "program: train.py\nmethod: random\nparameters:\n  # lr: {min: 0.001, max: 0.1}\n"
    with pytest.raises(ConfigError) as info:
        load_spec(write(tmp_path, text))
    message = str(info.value)
    assert "parameters: is empty; list the parameters to sweep under it" in message, message
    assert "required" not in message


# a file with a mistake in each of five places
MISTAKES = """\
program: train.py
method: grids
metric:
  name: val_loss
  goal: minimise
run_caps: 10
parameters:
  lr:
    distribution: log_uniform_value
    min: 0.000001
    max: 0.001
  batch_size:
    values: []
  dropout:
    min: '0.1'
    max: 0.5
  epochs:
    value: 3
"""


def test_every_problem_of_a_file_is_reported_at_once_and_the_cli_exits_2(tmp_path: Path) -> None:
    path = write(tmp_path, MISTAKES)
    with pytest.raises(ConfigError) as info:
        load_spec(path)
    lines = str(info.value).splitlines()
    # each problem once, in the order of the checks, each line naming the file and key path
    assert [line.split(": ", 2)[1:] for line in lines] == [
        ["run_caps", lines[0].split(": ", 2)[2]],
        ["method", "'grids' is not valid; valid: grid, random, bayes"],
        ["parameters.lr.distribution", lines[2].split(": ", 2)[2]],
        [
            "parameters.batch_size.values",
            "must be a non-empty list of the values to try, not a list",
        ],
        [
            "parameters.dropout.min",
            "must be a number, not text '0.1' (it is quoted, so it is text; write the number "
            "without quotes)",
        ],
        ["metric.goal", "'minimise' is not valid; valid: minimize, maximize"],
    ]
    assert all(line.startswith(f"{path}: ") for line in lines)
    assert lines[0].endswith(
        "not a sweep key; valid: program, command, method, metric, "
        "parameters, run_cap, name, max_failures, max_preemptions, "
        "term_timeout, early_terminate, description, project, entity, "
        "controller"
    )
    assert "'log_uniform_value' is not valid; valid: constant, categorical" in lines[2]
    out = sweep_create(tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith("preemptible: sweep.yaml: run_caps: not a sweep key"), out.stderr
    assert len(lines) == 6 and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "s.db").exists()  # nothing was created


def test_sweep_create_shows_the_warnings_and_creates_the_sweep(tmp_path: Path) -> None:
    write(tmp_path, EXPONENTS)
    out = sweep_create(tmp_path)
    assert out.returncode == 0, out.stderr
    assert (
        "preemptible: sweep.yaml: warning: parameters.lr.min: line 9: 1e-6 is text to YAML 1.1"
        in out.stderr
    ), out.stderr
