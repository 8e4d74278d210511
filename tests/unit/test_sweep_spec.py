"""The sweep spec: W&B's format where it overlaps, and one clear line for every bad input."""

from __future__ import annotations

import copy
import datetime
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from preemptible import ConfigError
from preemptible.sweeps.spec._model import SweepSpec, leaves
from preemptible.sweeps.spec._spec import load_spec, parse_spec
from tests.unit.sweep_strategies import garbage, spec_like, valid_spec

BASE: dict[str, Any] = {
    "program": "train.py",
    "method": "random",
    "metric": {"name": "val_loss", "goal": "minimize"},
    "parameters": {"lr": {"min": 0.0001, "max": 0.1}, "bs": {"values": [16, 32]}},
}

# W&B's nested-parameters example (wandb/sweeps, examples/nested-params), as a W&B user has it
WANDB_NESTED = """\
description: sweep using nested params
program: train-nested-cli.py
project: nested-examples
method: grid
metric:
  name: loss
  goal: minimize
parameters:
  batch_size:
    values: [32, 64]
  optimizer:
    parameters:
      lr:
        values: [0.001, 0.0001]
      nadam:
        parameters:
          beta:
            values: [0.9, 0.95]
"""


def spec(**changes: Any) -> dict[str, Any]:
    """BASE with top-level keys replaced (None deletes one)."""
    out = copy.deepcopy(BASE)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def param(**p: Any) -> dict[str, Any]:
    return spec(parameters={"x": p})


def error(data: object, source: str = "spec") -> str:
    with pytest.raises(ConfigError) as info:
        parse_spec(data, source=source)
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"{source}: "), message
    return message


def test_a_wandb_spec_with_nested_parameters_parses_as_wandb_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "sweep.yaml"
    path.write_text(WANDB_NESTED)
    s = load_spec(path)
    assert s.method == "grid" and s.program == "train-nested-cli.py"
    assert s.metric is not None and (s.metric.name, s.metric.goal) == ("loss", "minimize")
    assert s.command == ("${env}", "${interpreter}", "${program}", "${args}")  # W&B's default
    assert [path for path, _ in leaves(s.parameters)] == [
        ("batch_size",),
        ("optimizer", "lr"),
        ("optimizer", "nadam", "beta"),
    ]
    assert s.grid_size() == 8
    assert s.ignored == ("description", "project")  # W&B keys with no effect here
    assert s.raw["project"] == "nested-examples"


def test_defaults() -> None:
    s = parse_spec(BASE)
    assert (s.run_cap, s.term_timeout, s.name) == (None, None, None)
    assert (s.max_failures, s.max_preemptions) == (0, 100)
    assert s.grid_size() is None
    assert s.ignored == ()


def test_the_distribution_is_inferred_as_wandb_does() -> None:
    s = parse_spec(
        spec(
            parameters={
                "a": {"values": [1, 2]},
                "b": {"value": "adam"},
                "c": {"min": 1, "max": 10},
                "d": {"min": 0.1, "max": 1.0},
                "e": {"min": 0, "max": 1.0},
                "f": {"distribution": "normal"},
            }
        )
    )
    kinds = {name: p.distribution for name, p in s.parameters.items()}
    assert kinds == {
        "a": "categorical",
        "b": "constant",
        "c": "int_uniform",
        "d": "uniform",
        "e": "uniform",
        "f": "normal",
    }
    assert (s.parameters["f"].mu, s.parameters["f"].sigma) == (0.0, 1.0)  # W&B's defaults


def test_every_optional_key_is_read() -> None:
    s = parse_spec(
        spec(
            command=["${env}", "python", "${program}", "--epochs", 3, "${args}"],
            run_cap=20,
            max_failures=2,
            max_preemptions=7,
            term_timeout=45,
            name="lr-search",
            early_terminate={"type": "hyperband", "min_iter": 3},
            metric={"name": "acc", "goal": "maximize", "target": 0.99},
        )
    )
    assert s.command == ("${env}", "python", "${program}", "--epochs", "3", "${args}")
    assert (s.run_cap, s.max_failures, s.max_preemptions) == (20, 2, 7)
    assert s.term_timeout == 45.0 and s.name == "lr-search"
    assert s.metric is not None and s.metric.goal == "maximize" and s.metric.target == 0.99
    assert s.ignored == ()
    assert s.metric.reached(0.99) and s.metric.reached(1.0) and not s.metric.reached(0.98)
    loss = parse_spec(spec(metric={"name": "loss", "target": 0.1})).metric
    assert loss is not None and loss.reached(0.1) and not loss.reached(0.11)
    assert not loss.reached(None)


@pytest.mark.parametrize("target", ["0.5", True, float("nan"), float("inf"), [1]])
def test_a_metric_target_that_is_not_a_finite_number_is_refused(target: object) -> None:
    with pytest.raises(ConfigError, match=r"metric\.target: .*a finite number"):
        parse_spec(spec(metric={"name": "loss", "target": target}))


@pytest.mark.parametrize("kind", ["local", "cloud"])
def test_a_wandb_controller_is_accepted_and_listed_as_ignored(kind: str) -> None:
    s = parse_spec(spec(controller={"type": kind}))
    assert s.ignored == ("controller",)
    assert s.raw["controller"] == {"type": kind}
    assert parse_spec(dict(s.raw)) == s


def test_wandbs_other_distributions_parse_with_wandbs_keys_and_defaults() -> None:
    s = parse_spec(
        spec(
            parameters={
                "inv": {"distribution": "inv_log_uniform", "min": 0, "max": 2},
                "invv": {"distribution": "inv_log_uniform_values", "min": 0.01, "max": 1},
                "b": {"distribution": "beta"},
                "qb": {"distribution": "q_beta", "a": 2, "b": 5.5, "q": 0.1},
                "p": {
                    "distribution": "categorical_w_probabilities",
                    "values": ["x", "y"],
                    "probabilities": [0.25, 0.75],
                },
                "close": {"values": [1, 2, 3], "probabilities": [0.33333] * 3},
            }
        )
    )
    p = s.parameters
    assert (p["inv"].low, p["inv"].high) == (math.exp(-2), 1.0)  # 1/x from e^0 to e^2
    assert (p["invv"].low, p["invv"].high) == (0.01, 1)
    assert (p["b"].a, p["b"].b, p["b"].low, p["b"].high) == (1.0, 1.0, 0.0, 1.0)  # W&B's a=b=1
    assert (p["qb"].a, p["qb"].b, p["qb"].q, p["qb"].kmin, p["qb"].kmax) == (2, 5.5, 0.1, 0, 10)
    assert p["p"].distribution == "categorical" and p["p"].probabilities == (0.25, 0.75)
    assert p["close"].probabilities is not None  # within np.isclose's tolerance, as in W&B


def test_a_value_written_twice_is_kept_by_random_and_run_once_by_a_grid() -> None:
    values = [16, 32, 16, 16.0, True]
    s = parse_spec(spec(parameters={"x": {"values": values}}))
    assert s.parameters["x"].values == tuple(values) and s.ignored == ()
    g = parse_spec(spec(method="grid", parameters={"x": {"values": values}}))
    assert g.parameters["x"].values == (16, 32, True)  # the first of the equal ones
    assert g.ignored == ("parameters.x.values[2]", "parameters.x.values[3]")
    assert g.grid_size() == 3
    assert g.raw["parameters"]["x"]["values"] == values  # raw is the spec as written


def test_raw_is_plain_json_and_parses_back_to_the_same_spec() -> None:
    data = spec(
        parameters={"opt": {"parameters": {"lr": {"values": [0.1, (1, 2)]}}}},
        description="d",
    )
    s = parse_spec(data)
    text = json.dumps(s.raw, allow_nan=False)
    assert parse_spec(json.loads(text)) == s
    assert s.raw["parameters"]["opt"]["parameters"]["lr"]["values"] == [0.1, [1, 2]]
    data["parameters"]["opt"]["parameters"]["lr"]["values"].append(7)  # the caller's copy
    assert len(s.raw["parameters"]["opt"]["parameters"]["lr"]["values"]) == 2


@pytest.mark.parametrize(
    ("parameters", "size"),
    [
        ({"a": {"values": [1, 2]}, "b": {"values": ["x", "y", "z"]}}, 6),
        ({"a": {"min": 1, "max": 4}, "b": {"value": 3}}, 4),
        # W&B's grid runs numpy's arange(min, max, q): max itself is left out
        ({"a": {"distribution": "q_uniform", "min": 0.3, "max": 0.6, "q": 0.1}}, 3),
        ({"a": {"distribution": "q_uniform", "min": 0, "max": 1, "q": 0.25}}, 4),
        ({"a": {"distribution": "q_uniform", "min": 0.05, "max": 0.5, "q": 0.1}}, 5),
        ({"a": {"distribution": "q_uniform", "min": 1, "max": 1.3, "q": 0.1}}, 4),  # as numpy
        # equal values run once: 1 and 1.0 are one value to W&B's grid, true another
        ({"a": {"values": [1, 1.0, True]}}, 2),
        ({"a": {"values": [[1], [1.0], "1", 1, {"k": 1}, {"k": 1}]}}, 5),  # [1] is not [1.0]
        ({"g": {"parameters": {"a": {"values": [1, 2]}, "b": {"min": 0, "max": 2}}}}, 6),
    ],
)
def test_grid_size(parameters: dict[str, Any], size: int) -> None:
    assert parse_spec(spec(method="grid", parameters=parameters)).grid_size() == size


MACROS = "${env}, ${interpreter}, ${program}, ${args_json}, ${args_json_file}, ${args}"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ([1, 2], "spec: a spec is a mapping of keys (program, command, method"),
        (spec(run_caps=3), "spec: run_caps: not a sweep key; valid: program, command, method"),
        (spec(method=None), "spec: method: required; valid: grid, random, bayes"),
        (spec(method="hyperband"), "method: 'hyperband' is not valid; valid: grid, random, bayes"),
        (spec(parameters=None), "spec: parameters: required"),
        (spec(parameters={}), "parameters: must name at least one parameter"),
        (spec(parameters=[1]), "parameters: must be a mapping of parameter names"),
        (
            param(distribution="lognormal", min=1, max=2),
            "parameters.x.distribution: 'lognormal' is not valid; valid: constant, categorical, "
            "int_uniform, uniform, q_uniform, log_uniform_values, q_log_uniform_values,",
        ),
        (param(valuez=3), "parameters.x.valuez: not a parameter key; valid: parameters,"),
        (param(), "parameters.x: give values, value, min and max, a distribution, or nested"),
        (spec(parameters={"x": 3}), "parameters.x: must be a mapping such as {values: [1, 2]}"),
        (spec(parameters={"1lr": {"value": 1}}), "parameters.1lr: not a valid parameter name"),
        (
            spec(parameters={"a b": {"value": 1}}),
            "parameters.'a b': not a valid parameter name",
        ),
        (
            param(values=[1], min=0),
            "parameters.x.min: not valid with distribution categorical; valid keys: "
            "distribution, values, probabilities",
        ),
        (param(min=0.5), "parameters.x.max: required for distribution uniform"),
        (param(min=0.1, max=0.0001), "parameters.x.min: 0.1 is greater than max (0.0001)"),
        (param(distribution="int_uniform", min=1.5, max=3), "x.min: must be an integer, not"),
        (param(min=0, max=2**53 + 1), "parameters.x: min and max of int_uniform must be within"),
        (
            param(distribution="q_uniform", min=0, max=1, q=1e-17),
            "parameters.x.q: 1e-17 is too small for min and max (more than 2**53 steps)",
        ),
        (param(min="0", max=1), "parameters.x.min: must be a number, not text '0'"),
        (param(min=True, max=3), "parameters.x.min: must be a number, not true/false"),
        (
            param(min="1e-5", max=0.1),
            "parameters.x.min: must be a number, not text '1e-5' (it is quoted, so it is "
            "text; write the number without quotes)",
        ),
        (
            param(distribution="q_uniform", min=0, max=1, q=0),
            "x.q: 0 is not valid; use a number > 0",
        ),
        (
            spec(
                method="grid", parameters={"x": {"distribution": "q_uniform", "min": 1, "max": 1}}
            ),
            "parameters.x: q_uniform in a grid runs min, min + q, ... below max, and min (1) is "
            "not below max (1)",
        ),
        (
            param(distribution="categorical_w_probabilities", values=[1, 2]),
            "parameters.x.probabilities: required for distribution categorical_w_probabilities",
        ),
        (
            param(distribution="categorical_w_probabilities", values=[1, 2], probabilities=[1]),
            "parameters.x.probabilities: must be a list of 2 numbers, one per value",
        ),
        (
            param(distribution="categorical_w_probabilities", values=[1], probabilities=[1.1]),
            "parameters.x.probabilities: must add up to 1 (within 1e-05), not 1.1",
        ),
        (
            param(distribution="categorical_w_probabilities", values=[1, 2], probabilities=[2, -1]),
            "parameters.x.probabilities[1]: -1 is not valid; use a number >= 0",
        ),
        (param(distribution="beta", a=0), "parameters.x.a: 0 is not valid; use a number > 0"),
        (param(distribution="q_beta", b=-1), "parameters.x.b: -1 is not valid; use a number > 0"),
        (param(distribution="beta", a="2"), "parameters.x.a: must be a number, not text '2'"),
        (param(distribution="q_beta", q=0), "parameters.x.q: 0 is not valid; use a number > 0"),
        (
            param(distribution="beta", min=0, max=1),
            "parameters.x.min: not valid with distribution beta; valid keys: distribution, a, b",
        ),
        (param(distribution="inv_log_uniform"), "parameters.x.min: required for distribution"),
        (
            param(distribution="inv_log_uniform", min=-1, max=701),
            "parameters.x: min and max of inv_log_uniform are natural logs; keep them within",
        ),
        (
            param(distribution="inv_log_uniform_values", min=0, max=1),
            "parameters.x.min: 0 is not valid for inv_log_uniform_values; use a number > 0",
        ),
        (
            param(distribution="inv_log_uniform_values", min=2, max=1),
            "parameters.x.min: 2 is greater than max (1)",
        ),
        (spec(controller="local"), "spec: controller: must be a mapping such as {type: local}"),
        (spec(controller={}), "spec: controller.type: required; valid: local, cloud"),
        (spec(controller={"type": "remote"}), "controller.type: 'remote' is not valid; valid: lo"),
        (
            spec(controller={"type": "local", "schedule": []}),
            "spec: controller.schedule: not a controller key; valid: type",
        ),
        (param(distribution="normal", sigma=0), "x.sigma: 0 is not valid; use a number > 0"),
        (param(distribution="log_normal", mu=800), "mu + 10 * sigma must be <= 700"),
        (
            param(distribution="log_uniform_values", min=0, max=1),
            "parameters.x.min: 0 is not valid for log_uniform_values; use a number > 0",
        ),
        (param(distribution="log_uniform", min=-1, max=800), "natural logs; keep them within"),
        (param(values=[]), "parameters.x.values: must be a non-empty list"),
        (param(values=[1, 2], probabilities=[1.0]), "x.probabilities: must be a list of 2"),
        (param(values=[1, 2], probabilities=[-0.5, 1.5]), "probabilities[0]: -0.5 is not valid"),
        (
            param(values=[1, 2], probabilities=[0.5, 0.4]),
            "must add up to 1 (within 1e-05), not 0.9",
        ),
        (param(distribution="constant"), "parameters.x.value: required for distribution constant"),
        (
            spec(parameters={"g": {"parameters": {"a": {"value": 1}}, "values": [1]}}),
            "parameters.g.values: not valid beside 'parameters'",
        ),
        (spec(parameters={"g": {"parameters": {}}}), "parameters.g.parameters: must name at"),
        (
            spec(method="grid"),
            "parameters.lr: distribution uniform has no finite set of values for method grid",
        ),
        (
            spec(
                method="grid", parameters={"g": {"parameters": {"z": {"distribution": "normal"}}}}
            ),
            "parameters.g.parameters.z: distribution normal has no finite set",
        ),
        (
            spec(method="grid", parameters={"b": {"values": [1, 2], "probabilities": [0.5, 0.5]}}),
            "parameters.b.probabilities: not valid with method grid",
        ),
        (
            spec(run_cap=True),
            "spec: run_cap: True is not valid; use an integer from 1 to 2147483647",
        ),
        (spec(run_cap=0), "spec: run_cap: 0 is not valid; use an integer from 1 to 2147483647"),
        (spec(run_cap=2.0), "spec: run_cap: 2.0 is not valid; use an integer from 1 to"),
        (spec(max_failures=-1), "spec: max_failures: -1 is not valid; use an integer from 0 to"),
        (spec(max_preemptions=1.5), "max_preemptions: 1.5 is not valid; use an integer from 0 to"),
        (spec(term_timeout=0), "spec: term_timeout: 0 is not valid; use seconds > 0"),
        (spec(term_timeout="30"), "spec: term_timeout: '30' is not valid; use seconds > 0"),
        (spec(term_timeout=False), "spec: term_timeout: False is not valid"),
        (spec(method="bayes", metric=None), "spec: metric: required for method bayes"),
        (spec(metric={"name": "l", "goal": "max"}), "metric.goal: 'max' is not valid; valid:"),
        (spec(metric={"goal": "minimize"}), "spec: metric.name: required"),
        (spec(metric={"name": "l", "mode": "min"}), "spec: metric.mode: not a metric key"),
        (spec(name=3), "spec: name: must be text, not integer 3"),
        (spec(description=["x"]), "spec: description: must be text, not a list"),
        (spec(command="python train.py"), "spec: command: must be a list of arguments"),
        (spec(command=[]), "spec: command: must not be empty"),
        (spec(command=["${env}", True]), "spec: command[1]: must be text (quote it in YAML)"),
        (
            spec(command=["${env}", "${python}", "${args}"]),
            f"spec: command[1]: '${{python}}' is not a macro; valid: {MACROS}",
        ),
        (
            spec(command=["python", "x.py", "--flags=${args}"]),
            "spec: command[2]: ${args} expands to one argument per parameter, so it must be a "
            "whole element of the list",
        ),
        (spec(command=["${envvar:1X}"]), "command[0]: '${envvar:1X}' does not name an environment"),
        (
            spec(program=None, command=["python", "${program}"]),
            "spec: program: required: the command uses ${program}",
        ),
        (
            spec(program=None),
            "spec: program: required: the command (the default command, ${env} ${interpreter} "
            "${program} ${args}) uses ${program}",
        ),
        (spec(program=""), "spec: program: must be the path of the program to run"),
        (
            param(values=[datetime.date(2024, 1, 1)]),
            "parameters.x.values[0]: a date (datetime.date(2024, 1, 1)) is not valid here; "
            "use text (quote it in YAML)",
        ),
        (param(min=float("nan"), max=1.0), "parameters.x.min: nan is not valid; use a finite"),
        (param(value=10**400), "parameters.x.value: is too large a number"),
        (param(value="a\x00b"), "parameters.x.value: contains a NUL character"),
        ({**BASE, 1: 2}, "spec: (top level): key 1 must be text (quote it in YAML)"),
        (spec(early_terminate="hyperband"), "spec: early_terminate: must be a mapping"),
    ],
)
def test_each_problem_is_one_line_naming_the_key(data: object, expected: str) -> None:
    assert expected in error(data)


def test_the_source_prefixes_the_message_and_stays_on_one_line() -> None:
    assert error(spec(method="x"), source="sweeps/a.yaml").startswith("sweeps/a.yaml: method:")
    with pytest.raises(ConfigError) as info:
        parse_spec(spec(method="x"), source="a\nb.yaml")
    assert str(info.value).startswith("'a\\nb.yaml': method: 'x' is not valid")
    message = error(spec(parameters={"x\ny": {"value": 1}}))
    assert "parameters.'x\\ny': not a valid parameter name" in message


def test_load_spec_reads_yaml_and_json(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text(
        "method: random\nprogram: t.py\nparameters: {a: {values: [1]}}\n"
    )
    (tmp_path / "s.json").write_text(json.dumps(BASE))
    assert load_spec(tmp_path / "s.yaml").parameters["a"].values == (1,)
    assert load_spec(str(tmp_path / "s.json")) == parse_spec(BASE)


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("missing.yaml", None, "missing.yaml: no such file"),
        ("empty.yaml", "", "empty.yaml: is empty; a spec needs at least method and parameters"),
        ("bad.yaml", "method: grid\n  parameters: [1\n", "bad.yaml: not valid YAML: "),
        ("tab.yaml", "method:\t[\n", "tab.yaml: not valid YAML"),
        ("bad.json", '{"method": "grid",}', "bad.json: not valid JSON: Expecting property name"),
        ("nan.json", '{"method": NaN}', "nan.json: method: nan is not valid; use a finite number"),
        ("list.yaml", "- 1\n- 2\n", "list.yaml: a spec is a mapping of keys"),
        ("date.yaml", "description: 2024-01-01\n", "description: a date"),
        ("set.yaml", "run_cap: !!set {a, b}\n", "run_cap: a set"),
        ("py.yaml", "m: !!python/object:os.system {}\n", "py.yaml: not valid YAML:"),
        ("big.yaml", "run_cap: " + "9" * 5000 + "\n", "big.yaml: not valid YAML"),
        ("deep.json", "[" * 100_000 + "]" * 100_000, "deep.json: not usable JSON"),
        ("two.yaml", "a: 1\n---\nb: 2\n", "two.yaml: not valid YAML: "),
    ],
)
def test_load_spec_gives_one_line_for_a_bad_file(
    tmp_path: Path, name: str, text: str | None, expected: str
) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_spec(path)
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith(str(path)), message
    assert expected in message, message


def test_load_spec_refuses_a_directory_and_bytes_that_are_not_text(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"is a directory; give the spec file"):
        load_spec(tmp_path)
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match=r"bin.yaml: is not UTF-8 text"):
        load_spec(tmp_path / "bin.yaml")


def test_a_yaml_alias_bomb_is_refused_without_expanding_it(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\ndescription: *a8\n")
    with pytest.raises(ConfigError, match=r"the spec is too large \(more than 100000 values\)"):
        load_spec(tmp_path / "bomb.yaml")


def _parse_or_one_line(data: object) -> SweepSpec | None:
    """The spec, or None after checking the error is a line per problem, each naming the
    source."""
    try:
        return parse_spec(data)
    except ConfigError as exc:
        lines = str(exc).splitlines()
        assert lines and all(line.startswith("spec: ") for line in lines), str(exc)
        assert len(set(lines)) == len(lines), str(exc)
        return None


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=garbage | spec_like)
def test_any_input_gives_a_spec_or_one_line(data: object) -> None:
    _parse_or_one_line(data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_mutated_valid_spec_gives_a_spec_or_one_line(data: st.DataObject) -> None:
    spec_ = data.draw(valid_spec())
    node: Any = spec_
    # walk down to a random mapping or list, then replace, delete or add one entry there
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        key = data.draw(st.sampled_from(keys))
        child = node[key]
        if isinstance(child, (dict, list)) and child and data.draw(st.booleans()):
            node = child
            continue
        action = data.draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            node[key] = data.draw(garbage)
        elif action == "delete":
            del node[key]
        elif isinstance(node, dict):
            node[data.draw(st.text(max_size=8))] = data.draw(garbage)
        else:
            node.append(data.draw(garbage))
        break
    result = _parse_or_one_line(spec_)
    if result is not None:  # whatever parsed must survive the trip through the queue
        assert parse_spec(json.loads(json.dumps(result.raw, allow_nan=False))) == result


@settings(max_examples=100, deadline=None)
@given(spec_=valid_spec())
def test_every_valid_spec_parses_and_round_trips(spec_: dict[str, Any]) -> None:
    s = parse_spec(spec_)
    assert parse_spec(json.loads(json.dumps(s.raw, allow_nan=False))) == s
    if s.method == "grid":
        assert isinstance(s.grid_size(), int) and s.grid_size() >= 1


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=60) | st.sampled_from([WANDB_NESTED, WANDB_NESTED[:-40]]))
def test_any_file_gives_a_spec_or_one_line(
    tmp_path_factory: pytest.TempPathFactory, text: str
) -> None:
    path = tmp_path_factory.mktemp("spec") / "s.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        load_spec(path)
    except ConfigError as exc:
        lines = str(exc).splitlines()
        assert lines and all(line.startswith(f"{path}: ") for line in lines), str(exc)
