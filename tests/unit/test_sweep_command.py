"""Command building: W&B's macros, W&B's value formatting, and no shell between us and argv."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from preemptible import ConfigError
from preemptible.sweeps.spec._command import build_command
from preemptible.sweeps.spec._model import SweepSpec
from preemptible.sweeps.spec._spec import parse_spec

PARAMS: dict[str, Any] = {
    "lr": 0.1,
    "flag": True,
    "off": False,
    "opt": {"beta": 0.9},
    "act": "relu",
}


def make(command: list[Any] | None = None, program: str | None = "train.py") -> SweepSpec:
    data: dict[str, Any] = {"method": "random", "parameters": {"a": {"value": 1}}}
    if command is not None:
        data["command"] = command
    if program is not None:
        data["program"] = program
    return parse_spec(data)


def build(spec: SweepSpec, tmp_path: Path, params: dict[str, Any] = PARAMS) -> list[str]:
    return build_command(
        spec, params, interpreter="/opt/py/bin/python", params_file=tmp_path / "p.json"
    )


def test_the_default_command_is_wandbs_with_values_formatted_as_wandb_does(tmp_path: Path) -> None:
    assert build(make(), tmp_path) == [
        "/usr/bin/env",
        "/opt/py/bin/python",
        "train.py",
        "--lr=0.1",
        "--flag=True",
        "--off=False",
        "--opt={'beta': 0.9}",  # W&B passes str() of the nested dict
        "--act=relu",
    ]
    assert not (tmp_path / "p.json").exists()  # written only for ${args_json_file}


def test_args_no_hyphens_and_args_no_boolean_flags(tmp_path: Path) -> None:
    spec = make(["python", "${program}", "${args_no_hyphens}", "--", "${args_no_boolean_flags}"])
    assert build(spec, tmp_path) == [
        "python",
        "train.py",
        "lr=0.1",
        "flag=True",
        "off=False",
        "opt={'beta': 0.9}",
        "act=relu",
        "--",
        "--lr=0.1",
        "--flag",
        "--opt={'beta': 0.9}",
        "--act=relu",
    ]


def test_args_json_is_one_argument_and_args_json_file_a_path_to_the_same_json(
    tmp_path: Path,
) -> None:
    spec = make(["${interpreter}", "${program}", "${args_json}", "--cfg=${args_json_file}"])
    argv = build(spec, tmp_path)
    assert argv[:2] == ["/opt/py/bin/python", "train.py"]
    assert json.loads(argv[2]) == PARAMS
    assert argv[3] == f"--cfg={tmp_path / 'p.json'}"
    assert json.loads((tmp_path / "p.json").read_text()) == PARAMS


def test_args_json_file_replaces_a_planted_link_instead_of_writing_through_it(
    tmp_path: Path,
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "p.json").symlink_to(victim)
    build(make(["${program}", "--cfg=${args_json_file}"]), tmp_path)
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "p.json").is_symlink()
    assert json.loads((tmp_path / "p.json").read_text()) == PARAMS


def test_a_whole_element_macro_may_expand_to_nothing_and_literals_stay(tmp_path: Path) -> None:
    spec = make(["${env}", "x${env}y", "--epochs", 3, "${args}", "$HOME", "${unclosed"])
    argv = build(spec, tmp_path, params={})
    assert argv == ["/usr/bin/env", "x/usr/bin/envy", "--epochs", "3", "$HOME", "${unclosed"]


def test_envvar_is_read_where_the_command_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = make(["${program}", "--data=${envvar:DATA_DIR}"])
    monkeypatch.setenv("DATA_DIR", "/mnt/data")
    assert build(spec, tmp_path) == ["train.py", "--data=/mnt/data"]
    monkeypatch.delenv("DATA_DIR")
    with pytest.raises(ConfigError, match=r"^command: \$\{envvar:DATA_DIR\} names an environment"):
        build(spec, tmp_path)


def test_a_macro_the_parser_never_saw_is_refused(tmp_path: Path) -> None:
    spec = make()
    bad = SweepSpec(**{**spec.__dict__, "command": ("${prog}",)})
    with pytest.raises(ConfigError, match=r"^command: '\$\{prog\}' is not a macro; valid: "):
        build(bad, tmp_path)


PROGRAM = """\
import json, sys
print(json.dumps({"argv": sys.argv[1:], "file": json.load(open(sys.argv[-1].split("=", 1)[1]))}))
"""


@pytest.mark.timeout(60)
def test_the_program_receives_each_value_as_one_untouched_argument(tmp_path: Path) -> None:
    program = tmp_path / "show.py"
    program.write_text(PROGRAM)
    params = {"name": "a b; echo $HOME `id` * \"'", "n": 3, "nested": {"k": "$(x)"}}
    spec = make(
        ["${env}", "${interpreter}", "${program}", "${args}", "--cfg=${args_json_file}"],
        str(program),
    )
    argv = build_command(
        spec, params, interpreter=sys.executable, params_file=tmp_path / "run" / "p.json"
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["argv"] == [
        "--name=a b; echo $HOME `id` * \"'",
        "--n=3",
        "--nested={'k': '$(x)'}",
        f"--cfg={tmp_path / 'run' / 'p.json'}",
    ]
    assert seen["file"] == params


# Each value type once; the expected elements are what W&B's agent builds for the same
# parameters (wandb/sdk/launch/sweeps/utils.py create_sweep_command_args: str() of the value).
TYPED: dict[str, Any] = {
    "name": "a b c",
    "flag": True,
    "off": False,
    "lr": 0.1,
    "small": 1e-05,
    "layers": [64, 32],
    "opt": {"beta": 0.9, "name": "adam"},
    "none": None,
    "neg": -2.5,
}


@pytest.mark.parametrize(
    ("macro", "expected"),
    [
        (
            "${args_no_equals}",
            [
                *("--name", "a b c", "--flag", "True", "--off", "False", "--lr", "0.1"),
                *("--small", "1e-05", "--layers", "[64, 32]"),
                *("--opt", "{'beta': 0.9, 'name': 'adam'}", "--none", "None", "--neg", "-2.5"),
            ],
        ),
        (
            "${args_append_hydra}",
            [
                *("+name=a b c", "+flag=True", "+off=False", "+lr=0.1", "+small=1e-05"),
                *("+layers=[64, 32]", "+opt={'beta': 0.9, 'name': 'adam'}", "+none=None"),
                "+neg=-2.5",
            ],
        ),
        (
            "${args_override_hydra}",
            [
                *("++name=a b c", "++flag=True", "++off=False", "++lr=0.1", "++small=1e-05"),
                *("++layers=[64, 32]", "++opt={'beta': 0.9, 'name': 'adam'}", "++none=None"),
                "++neg=-2.5",
            ],
        ),
    ],
)
def test_the_other_wandb_macros_give_wandbs_elements(
    macro: str, expected: list[str], tmp_path: Path
) -> None:
    spec = make(["python", "${program}", macro])
    assert build(spec, tmp_path, TYPED) == ["python", "train.py", *expected]
    assert build(spec, tmp_path, {}) == ["python", "train.py"]  # no parameters: no elements


@pytest.mark.parametrize("macro", ["args_no_equals", "args_append_hydra", "args_override_hydra"])
def test_the_other_multi_element_macros_must_be_a_whole_element(macro: str) -> None:
    with pytest.raises(ConfigError, match=rf"command\[1\]: \$\{{{macro}\}} expands to one"):
        make(["python", f"--x=${{{macro}}}"])


def test_args_no_equals_reaches_the_program_as_separate_arguments(tmp_path: Path) -> None:
    script = "import sys, json; print(json.dumps(sys.argv[1:]))"
    spec = make([sys.executable, "-c", script, "${args_no_equals}"])
    argv = build(spec, tmp_path, {"name": "a b", "n": 3})
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout
    assert json.loads(out) == ["--name", "a b", "--n", "3"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "macro",
    [
        *("args", "args_no_hyphens", "args_no_boolean_flags", "args_no_equals"),
        *("args_append_hydra", "args_override_hydra"),
    ],
)
def test_every_multi_element_macro_is_what_wandb_itself_builds(macro: str, tmp_path: Path) -> None:
    utils = pytest.importorskip("wandb.sdk.launch.sweeps.utils")  # the 'wandb' extra
    params = {**TYPED, "n": 3, "nested": {"a": [1, {"b": None}]}, "empty": "", "q": "it's"}
    theirs = utils.create_sweep_command_args({"args": {k: {"value": v} for k, v in params.items()}})
    spec = make(["${" + macro + "}"])
    assert build(spec, tmp_path, params) == theirs[macro]
