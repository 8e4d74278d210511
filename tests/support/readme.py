"""The README harness: every code block of README.md and of the docs site's pages
(docs/**/*.md) is executed or checked, so an example cannot drift
(tests/integration/test_readme.py makes one test of each block, named after its page).

Each fenced block gets one test item, chosen by a one-line HTML comment right before its
opening fence::

    <!-- readme-test: KIND [key=value ...] -->

A block without one fails (so a new block is never added untested); ``skip:`` needs a reason.

python    run it (the venv's python, a tmp working directory) after ``setup=NAME``, a module
          in tests/readme/ that defines the names the block uses but does not define:
          ``plain`` (default: model, opt, state, train_step, total_steps, batch, train_batch,
          validate, ...), ``lightning`` (a LightningModule model, train_loader, val_loader,
          an active MLflow run), ``transformers`` (``model``, ``args``, ``data``: a tiny
          GPT-2 and a few Trainer steps; python only), ``keras`` (``make_model()``, ``x``,
          ``y``: a Keras model on the torch backend), ``tensorflow`` (``strategy``,
          ``make_model()``, ``dataset``, ``TOTAL_STEPS``, ``log_step(step)``: a TensorFlow
          custom loop's pieces), ``jax`` (``MLP``, ``train_batches()``, ``NUM_EPOCHS``,
          ``log_step(step)``: a Flax NNX loop's pieces), ``bare`` (nothing). ``exit=N``
          (default 0).
loop      a training loop: run it uninterrupted, and again with a SIGTERM once the setup
          printed step ``at=N`` (default 13); that run must exit with the setup's stop code
          (``exit=`` overrides) leaving a checkpoint, and the same program run once more must
          resume from the next step and end with the same weights (and plain values in
          ``state``), bit for bit, as the uninterrupted run.
          ``group=NAME`` (python, loop): blocks that are fragments of one program run as
          one, in README order, at the group's first block. ``bucket=NAME`` (loop): the
          block's checkpoints go to ``s3://NAME/...`` on the tests' S3 server (fixture
          ``s3_server``: the block's text is what a user runs); each run is a machine of its
          own (working directory, HOME, TMPDIR): the uninterrupted one (beside it, with
          ``NAME-ref`` for ``NAME`` in its text: a bucket of its own), the interrupted one,
          whose machine is then gone, and the resumed one on a new machine: it must resume
          from the bucket.
shell     run it with bash (the venv first on PATH, a stand-in ``train.py`` in the working
          directory). ``signal=USR1``: sent to the script once train.py printed step ``at=``
          (default 10); ``exit=N`` the expected code (default 0); with a signal, a
          checkpoint must exist. Options of ``preemptible`` lines are checked as below.
script    ``bash -n``, and the options of every ``preemptible`` command must exist in its
          ``--help`` (for scripts that need a real cluster).
synopsis  the options of every ``preemptible`` command must exist in its ``--help``.
yaml      parsed; every container command must be in exec form, ``preemptible`` ones with
          options that exist; ``PREEMPTIBLE_GRACE_PERIOD`` = terminationGracePeriodSeconds.
make      every ``make TARGET`` line names a Makefile target; ``run=a,b``: their recipes are
          run (with this interpreter's bin for $(BIN), not a rebuilt .venv), and the
          targets in ``skip=c`` need ``why="..."``.
output    a sample of output, not code: skipped. ``of="make demo"`` (or any command):
          compared line by line with that command's real output, numbers and paths aside
          (run with an empty matplotlib cache, so a library's first-run line shows up).
skip:     ``<!-- readme-test: skip: REASON -->``.

A page's blocks are a program of their own: ``group=`` joins blocks of one page only, and a
traceback names the page and its line. Blocks that need a framework (``setup=lightning``,
``setup=keras``, ``setup=tensorflow``, ``setup=transformers``, ``setup=jax``, ``trainer``,
``torchrun``) are marked ``frameworks`` by test_readme.py, so they run in that lane
(tests/services/lanes.sh).

Commands named by ``make run=`` and ``output of=`` start in the background when the module
starts and their items run last, so the demo (a sweep: about a minute) overlaps the other items.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, Child

README = ROOT / "README.md"
DOCS = ROOT / "docs"
HELPERS = ROOT / "tests" / "readme"
BIN = Path(sys.executable).parent
STEP = re.compile(r"readme-step (\d+)")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)")
MARKER = re.compile(r"^\s*<!--\s*readme-test:(.*?)-->\s*$")


@dataclass(frozen=True)
class Setup:
    module: str  # in tests/readme/
    stop_exit: int = 143  # what an interrupted loop exits with
    checkpoint: str = "ckpt/step-*.ckpt"  # what it leaves, relative to the working directory
    resumed: str | None = None  # a line the resumed run must print; {step} = its first step


SETUPS = {
    "plain": Setup("plain", resumed="preemptible: resumed from ckpt/step-{step:010d}"),
    "lightning": Setup("lightning_fit", stop_exit=143, checkpoint="ckpt/resume.ckpt"),
    "keras": Setup(
        "keras_model",
        checkpoint="ckpt/keras-*.npz",
        resumed="preemptible: resumed from ckpt/keras-{step}.npz at step {step}",
    ),
    "tensorflow": Setup(
        "tf_loop",
        checkpoint="ckpt/tf-*",
        resumed="preemptible: resumed from ckpt/tf-{step} at step {step}",
    ),
    "transformers": Setup("transformers_trainer"),  # python only: a few Trainer steps
    "jax": Setup(
        "flax_loop",
        checkpoint="ckpt/checkpoint-*",
        resumed="preemptible: resumed from ckpt/checkpoint-{step} at step {step}",
    ),
    "bare": Setup("bare"),  # nothing defined: for blocks that need no names
}
FRAMEWORK_SETUPS = frozenset({"lightning", "keras", "tensorflow", "transformers", "jax"})
FRAMEWORK_KINDS = frozenset({"trainer", "torchrun"})


def documents() -> list[Path]:
    """The Markdown files whose blocks are tested: README.md, then the docs site's pages."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def page_name(path: Path) -> str:
    """``README.md``, ``docs/frontends/lightning.md``: how a block's place is written."""
    return path.relative_to(ROOT).as_posix()


@dataclass(frozen=True)
class Block:
    index: int
    fence_line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None  # the marker's text after "readme-test:", or None
    page: str = "README.md"  # the file, relative to the repository

    @property
    def line(self) -> int:
        """The page line of the block's first line of code."""
        return self.fence_line + 1

    @property
    def where(self) -> str:
        return f"{self.page}:{self.fence_line} (```{self.lang})"

    @property
    def id(self) -> str:
        """``README/03-import-preemptible``, ``frontends/lightning/00-import-lightning``: the
        page, then the block's place on it and its first line."""
        first = next((ln for ln in self.text.splitlines() if ln.strip()), "empty")
        slug = re.sub(r"[^A-Za-z0-9]+", "-", first).strip("-")[:40]
        page = self.page.removeprefix("docs/").removesuffix(".md")
        return f"{page}/{self.index:02d}-{slug}"


@dataclass
class Parsed:
    blocks: list[Block] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def parse_readme(text: str, page: str = "README.md") -> Parsed:
    """The fenced blocks of a Markdown text (the file ``page``), each with the marker on the
    line before it."""
    lines = text.splitlines()
    out = Parsed()
    used_markers: set[int] = set()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3)
        close = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        if j == len(lines):
            out.problems.append(f"{page}:{i + 1}: a fence that is never closed")
        body = "\n".join(ln[indent:] if ln[:indent].isspace() else ln for ln in lines[i + 1 : j])
        marker = None
        if i > 0 and (mm := MARKER.match(lines[i - 1])):
            marker = mm.group(1).strip()
            used_markers.add(i - 1)
        out.blocks.append(Block(len(out.blocks), i + 1, lang, body + "\n", marker, page))
        i = j + 1
    for n, line in enumerate(lines):
        if "readme-test:" in line and n not in used_markers:
            out.problems.append(
                f"{page}:{n + 1}: a readme-test marker must be one line "
                "(<!-- readme-test: ... -->) right before an opening fence"
            )
    return out


@dataclass(frozen=True)
class Ctx:
    tmp: Path
    spawn: Callable[..., Child]
    factory: pytest.TempPathFactory
    blocks: list[Block]  # all of the document's, for groups
    fixture: Callable[[str], Any] | None = None  # request.getfixturevalue: services (bucket=)


@dataclass(frozen=True)
class Plan:
    kind: str
    options: dict[str, str]


@dataclass(frozen=True)
class Kind:
    run: Callable[..., None]
    options: frozenset[str]
    langs: frozenset[str] | None  # None: any
    timeout: int = 60


def plan(block: Block) -> Plan:
    """What to do with ``block``; AssertionError with one clear line when it cannot tell."""
    kinds = ", ".join(sorted(KINDS))
    if block.marker is None:
        raise AssertionError(
            f"{block.where} has no test: put <!-- readme-test: KIND ... --> on the line right "
            f"before its fence (KIND: {kinds}, or 'skip: REASON'); see tests/support/readme.py"
        )
    if block.marker.startswith("skip:"):
        why = block.marker[len("skip:") :].strip()
        if not why:
            raise AssertionError(f"{block.where}: 'skip:' needs a reason after it")
        return Plan("skip", {"why": why})
    try:
        tokens = shlex.split(block.marker)
    except ValueError as exc:
        raise AssertionError(f"{block.where}: marker {block.marker!r}: {exc}") from None
    if not tokens or tokens[0] not in KINDS:
        raise AssertionError(f"{block.where}: marker {block.marker!r}: KIND is one of {kinds}")
    kind = KINDS[tokens[0]]
    options = {}
    for token in tokens[1:]:
        key, _, value = token.partition("=")
        if key not in kind.options:
            valid = ", ".join(sorted(kind.options)) or "none"
            raise AssertionError(
                f"{block.where}: marker option {key!r} is not one of {tokens[0]}'s ({valid})"
            )
        options[key] = value
    if kind.langs is not None and block.lang not in kind.langs:
        raise AssertionError(
            f"{block.where}: {tokens[0]} is for ```{'/'.join(sorted(kind.langs))} blocks"
        )
    if "setup" in kind.options and options.get("setup", "plain") not in SETUPS:
        raise AssertionError(f"{block.where}: setup= is one of {', '.join(SETUPS)}")
    if tokens[0] == "loop" and options.get("setup") == "transformers":
        raise AssertionError(f"{block.where}: setup=transformers is for python blocks")
    return Plan(tokens[0], options)


def unique_blocks(blocks: list[Block]) -> list[Block]:
    """``blocks`` without the repeats: a block with the same language, marker and code as an
    earlier one (the README's Lightning example is also on the Lightning page) is the same
    test, so it runs once, as the first one. Blocks of a group are never repeats: what runs
    depends on the other blocks of their page."""
    seen: set[tuple[str, str | None, str]] = set()
    out = []
    for block in blocks:
        what = _plan_or_none(block)
        key = (block.lang, block.marker, block.text)
        if what is not None and "group" not in what.options and key in seen:
            continue
        seen.add(key)
        out.append(block)
    return out


def needs_framework(block: Block) -> bool:
    """Whether ``block`` runs a framework's fit (its test goes to the ``frameworks`` lane)."""
    what = _plan_or_none(block)
    if what is None:
        return False
    return what.kind in FRAMEWORK_KINDS or what.options.get("setup") in FRAMEWORK_SETUPS


# -- python and loop -----------------------------------------------------------------------


def _plan_or_none(block: Block) -> Plan | None:
    try:
        return plan(block)
    except AssertionError:
        return None


def _members(block: Block, options: dict[str, str], document: list[Block]) -> list[Block]:
    """The blocks of ``block``'s group in page order (just ``block`` without a group); a
    group never spans pages (``document`` is the page's blocks)."""
    name = options.get("group")
    if name is None:
        return [block]
    own = plan(block)
    members = []
    for b in document:
        other = _plan_or_none(b)
        if other is not None and other.options.get("group") == name:
            if b.page != block.page:
                continue
            if (other.kind, other.options.get("setup")) != (own.kind, options.get("setup")):
                raise AssertionError(f"{b.where}: group {name} mixes kinds or setups")
            members.append(b)
    return members


_group_outcome: dict[tuple[str, str], str | None] = {}  # (page, group) -> failure or None


def _once_per_group(block: Block, options: dict[str, str], body: Callable[[], None]) -> None:
    """Run a group's program at its first block; its other blocks report the same outcome."""
    name = options.get("group")
    if name is None:
        body()
        return
    key = (block.page, name)
    if key not in _group_outcome:
        try:
            body()
        except AssertionError as exc:
            _group_outcome[key] = str(exc)
            raise
        _group_outcome[key] = None
    failure = _group_outcome[key]
    if failure is not None:
        pytest.fail(f"group {name} (run at its first block) failed:\n{failure}")


def _program(
    tmp: Path, blocks: list[Block], setup: str, replace: tuple[str, str] = ("", "")
) -> list[str]:
    """The command that runs ``blocks`` after ``setup``; ``replace``: (old, new) in their text
    (a reference run's bucket of its own)."""
    spec = tmp / ("readme-blocks-replaced.json" if replace[0] else "readme-blocks.json")
    module = SETUPS[setup].module
    page = blocks[0].page
    texts = [[b.line, b.text.replace(*replace) if replace[0] else b.text] for b in blocks]
    spec.write_text(json.dumps({"setup": module, "page": page, "blocks": texts}))
    return [sys.executable, str(HELPERS / "run_blocks.py"), str(spec)]


def _run_python(block: Block, options: dict[str, str], ctx: Ctx) -> None:
    tmp, spawn = ctx.tmp, ctx.spawn
    blocks = _members(block, options, ctx.blocks)

    def body() -> None:
        child = spawn(_program(tmp, blocks, options.get("setup", "plain")), cwd=tmp)
        rc = child.wait(120)
        want = int(options.get("exit", "0"))
        assert rc == want, f"{block.where}: exit {rc}, expected {want}\n{child.output}"

    _once_per_group(block, options, body)


def _steps(child: Child) -> list[int]:
    return [int(m.group(1)) for line in child.lines if (m := STEP.search(line))]


def _wait_step(child: Child, at: int, block: Block) -> None:
    """Wait until ``child`` printed ``readme-step N`` for some N >= ``at``."""

    def reached(line: str) -> bool:
        return (m := STEP.search(line)) is not None and int(m.group(1)) >= at

    try:
        child.wait_line(reached, timeout=120)
    except AssertionError as exc:
        raise AssertionError(f"{block.where}: never reached step {at}: {exc}") from None


def _same(a: Path, b: Path) -> list[str]:
    """The keys whose values differ between two saved results (empty: identical)."""
    import torch

    wa, wb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    differ = sorted(set(wa) ^ set(wb))
    for key in set(wa) & set(wb):
        va, vb = wa[key], wb[key]
        same = torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb
        if not same:
            differ.append(key)
    return differ


def _run_loop(block: Block, options: dict[str, str], ctx: Ctx) -> None:
    if "bucket" in options:
        _run_bucket_loop(block, options, ctx)
        return
    tmp, spawn = ctx.tmp, ctx.spawn
    blocks = _members(block, options, ctx.blocks)
    setup = SETUPS[options.get("setup", "plain")]
    at = int(options.get("at", "13"))
    stop_exit = int(options.get("exit", str(setup.stop_exit)))

    def body() -> None:
        ref_dir, run_dir = tmp / "uninterrupted", tmp / "interrupted"
        ref_dir.mkdir()
        run_dir.mkdir()
        args = _program(tmp, blocks, options.get("setup", "plain"))
        # the reference runs beside the interrupted one (two cores), at full speed
        ref = spawn(args, cwd=ref_dir, env={"README_OUT": str(ref_dir / "final.pt")})
        out = {"README_OUT": str(run_dir / "final.pt")}
        first = spawn(args, cwd=run_dir, env={**out, "README_STEP_SLEEP": "0.05"})
        _wait_step(first, at, block)
        first.signal(signal.SIGTERM)
        rc = first.wait(60)
        assert rc == stop_exit, (
            f"{block.where}: SIGTERM at step {at}: exit {rc}, expected {stop_exit}\n{first.output}"
        )
        saved = sorted(run_dir.glob(setup.checkpoint))
        assert saved, f"{block.where}: no {setup.checkpoint} after the stop\n{first.output}"
        stopped = _steps(first)[-1]

        second = spawn(args, cwd=run_dir, env=out)
        rc = second.wait(120)
        assert rc == 0, f"{block.where}: the resumed run exited {rc}\n{second.output}"
        resumed = _steps(second)
        assert resumed and resumed[0] == stopped + 1, (
            f"{block.where}: the interrupted run's last step was {stopped}, the resumed run "
            f"started at {resumed[:1]}\n{second.output}"
        )
        if setup.resumed is not None:
            expected = setup.resumed.format(step=stopped + 1)
            assert expected in second.output, f"no '{expected}' line\n{second.output}"

        assert ref.wait(120) == 0, f"{block.where}: the uninterrupted run failed\n{ref.output}"
        differ = _same(ref_dir / "final.pt", run_dir / "final.pt")
        assert not differ, (
            f"{block.where}: stopped after step {stopped} and resumed, the run ends with other "
            f"values than an uninterrupted one: {', '.join(differ)}"
        )

    _once_per_group(block, options, body)


def _fresh_bucket(server: Any, name: str) -> None:
    """Bucket ``name`` on the tests' S3 server, made or emptied (boto3, not the client under
    test)."""
    import boto3

    env = server.env()
    s3 = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_REGION"],
    )
    with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
        s3.create_bucket(Bucket=name)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=name):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=name, Delete={"Objects": keys})


def _run_bucket_loop(block: Block, options: dict[str, str], ctx: Ctx) -> None:
    """``loop bucket=NAME``: the uninterrupted run (its own bucket) beside the interrupted one,
    then, that machine gone, the resumed one on a new machine (see the module docstring)."""
    from tests.support.machines import Machine

    assert ctx.fixture is not None, f"{block.where}: bucket= needs the s3_server fixture"
    server = ctx.fixture("s3_server")
    name = options["bucket"]
    setup = SETUPS[options.get("setup", "plain")]
    at = int(options.get("at", "13"))
    stop_exit = int(options.get("exit", str(setup.stop_exit)))
    blocks, setup_name = _members(block, options, ctx.blocks), options.get("setup", "plain")
    args = _program(ctx.tmp, blocks, setup_name)
    ref_args = _program(ctx.tmp, blocks, setup_name, (f"s3://{name}/", f"s3://{name}-ref/"))
    assert ref_args != args, f"{block.where}: no s3://{name}/ in the block"

    def run_on(machine: Machine, command: list[str], **env: str) -> Child:
        full = {**server.env(), **machine.env, **env}
        return ctx.spawn(command, cwd=machine.cwd, env=full)

    _fresh_bucket(server, name)
    _fresh_bucket(server, f"{name}-ref")
    ref_out, out = ctx.tmp / "uninterrupted.pt", ctx.tmp / "interrupted.pt"
    ref = run_on(Machine(ctx.tmp / "ref"), ref_args, README_OUT=str(ref_out))
    one = Machine(ctx.tmp / "one")
    first = run_on(one, args, README_OUT=str(out), README_STEP_SLEEP="0.05")
    _wait_step(first, at, block)
    first.signal(signal.SIGTERM)
    rc = first.wait(60)
    assert rc == stop_exit, f"{block.where}: SIGTERM: exit {rc}, not {stop_exit}\n{first.output}"
    manifests = [k for k in server.objects(name) if "/manifests/" in f"/{k}"]
    assert manifests, f"{block.where}: nothing committed in s3://{name}\n{first.output}"
    stopped = _steps(first)[-1]
    one.gone()
    second = run_on(Machine(ctx.tmp / "two"), args, README_OUT=str(out))
    assert second.wait(120) == 0, f"{block.where}: the resumed run failed\n{second.output}"
    resumed = _steps(second)
    assert resumed and resumed[0] == stopped + 1, (
        f"{block.where}: stopped after step {stopped}, the new machine started at "
        f"{resumed[:1]}\n{second.output}"
    )
    assert ref.wait(120) == 0, f"{block.where}: the uninterrupted run failed\n{ref.output}"
    differ = _same(ref_out, out)
    assert not differ, (
        f"{block.where}: resumed on a new machine from the bucket, the run ends with other "
        f"values than an uninterrupted one: {', '.join(differ)}"
    )


# -- torchrun -------------------------------------------------------------------------------

TORCHRUN_STEP = re.compile(r"\bstep (\d+) loss")  # searched: ranks share one stream


def _run_torchrun(block: Block, options: dict[str, str], ctx: Ctx) -> None:
    """The block is a whole script for two processes: ``torchrun --standalone
    --nproc-per-node 2`` (``launcher=accelerate``: ``accelerate launch --multi_gpu
    --num_processes 2``, which is torchrun inside). It prints ``step N ...`` now and then on
    rank 0 and writes ``final.pt``. SIGTERM to the launcher once it printed step ``at`` or
    later: it passes it to both ranks, which stop at the same step with a checkpoint; run
    again, it resumes and ends with the weights of an uninterrupted run."""
    tmp, spawn = ctx.tmp, ctx.spawn
    at = int(options.get("at", "300"))
    launcher = options.get("launcher", "torchrun")
    assert launcher in ("torchrun", "accelerate"), f"{block.where}: launcher={launcher!r}"
    name = "train_ddp.py" if launcher == "torchrun" else "train_accelerate.py"
    tool = str(Path(sys.executable).with_name(launcher))
    ref_dir, run_dir = tmp / "uninterrupted", tmp / "interrupted"

    def args() -> list[str]:
        """The launch; under accelerate a port of its own for each launch (two run at once,
        and its default port would be shared)."""
        if launcher == "torchrun":
            return [tool, "--standalone", "--nproc-per-node", "2", name]
        port = str(_free_port())
        return [
            tool,
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--main_process_port",
            port,
            name,
        ]

    for d in (ref_dir, run_dir):
        d.mkdir()
        (d / name).write_text(block.text)
    env = {"OMP_NUM_THREADS": "1"}
    ref = spawn(args(), cwd=ref_dir, env=env)
    first = spawn(args(), cwd=run_dir, env=env)

    def reached(line: str) -> bool:
        return any(int(m.group(1)) >= at for m in TORCHRUN_STEP.finditer(line))

    first.wait_line(reached, timeout=120)
    first.signal(signal.SIGTERM)  # the launcher alone: it forwards the signal to its workers
    rc = first.wait(120)
    want = int(options.get("exit", "1"))
    assert rc == want, f"{block.where}: SIGTERM to {launcher}: exit {rc}, expected {want}\n" + (
        first.output
    )
    saved = [*run_dir.glob("ckpt/step-*.ckpt"), *run_dir.glob("ckpt/checkpoint-*")]
    assert saved, f"no checkpoint after the stop\n{first.output}"
    assert not (run_dir / "final.pt").exists(), f"the run was not stopped early\n{first.output}"
    second = spawn(args(), cwd=run_dir, env=env)
    assert second.wait(180) == 0, f"{block.where}: the resumed run failed\n{second.output}"
    assert ref.wait(180) == 0, f"{block.where}: the uninterrupted run failed\n{ref.output}"
    differ = _same(ref_dir / "final.pt", run_dir / "final.pt")
    assert not differ, (
        f"{block.where}: stopped and resumed under {launcher}, the run ends with other values "
        f"than an uninterrupted one: {', '.join(differ)}"
    )


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- the Hugging Face Trainer -------------------------------------------------------------

TRAINER_LOG = re.compile(r"'loss'")


def _run_trainer(block: Block, options: dict[str, str], ctx: Ctx) -> None:
    """The block is a whole Trainer script (``python train_hf.py``) that saves the final model
    with ``trainer.save_model("final")``. SIGTERM once it logged its loss ``at`` times: it
    exits 143 with a committed ``checkpoint-N``; run again, it resumes, and the final model
    equals an uninterrupted run's, bit for bit."""
    from safetensors.torch import load_file

    tmp, spawn = ctx.tmp, ctx.spawn
    at = int(options.get("at", "3"))
    ref_dir, run_dir = tmp / "uninterrupted", tmp / "interrupted"
    for d in (ref_dir, run_dir):
        d.mkdir()
        (d / "train_hf.py").write_text(block.text)
    args = [sys.executable, "train_hf.py"]
    ref = spawn(args, cwd=ref_dir)
    first = spawn(args, cwd=run_dir)
    seen = [0]

    def logged(line: str) -> bool:
        seen[0] += bool(TRAINER_LOG.search(line))
        return seen[0] >= at

    first.wait_line(logged, timeout=120)
    first.signal(signal.SIGTERM)
    rc = first.wait(120)
    assert rc == 143, f"{block.where}: SIGTERM: exit {rc}, expected 143\n{first.output}"
    assert sorted(run_dir.glob("out/checkpoint-*")), f"no checkpoint after the stop\n{first.output}"
    assert not (run_dir / "final").exists(), f"code after train() ran\n{first.output}"
    second = spawn(args, cwd=run_dir)
    assert second.wait(180) == 0, f"{block.where}: the resumed run failed\n{second.output}"
    assert ref.wait(180) == 0, f"{block.where}: the uninterrupted run failed\n{ref.output}"
    wa = load_file(str(ref_dir / "final" / "model.safetensors"))
    wb = load_file(str(run_dir / "final" / "model.safetensors"))
    import torch

    differ = sorted(set(wa) ^ set(wb)) + [
        k for k in set(wa) & set(wb) if not torch.equal(wa[k], wb[k])
    ]
    assert not differ, (
        f"{block.where}: stopped and resumed, the Trainer ends with other weights than an "
        f"uninterrupted run: {', '.join(differ)}"
    )


# -- shell, script, synopsis, yaml ---------------------------------------------------------


def _path_env() -> dict[str, str]:
    return {"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def _run_shell(block: Block, options: dict[str, str], ctx: Ctx) -> None:
    tmp, spawn = ctx.tmp, ctx.spawn
    script = tmp / "readme-block.sh"
    script.write_text(block.text)
    (tmp / "train.py").write_text(
        f"import runpy\nrunpy.run_path({str(HELPERS / 'train.py')!r}, run_name='__main__')\n"
    )
    _check_preemptible_lines(block)
    sig = options.get("signal")
    env = _path_env()
    if sig:
        env["README_STEP_SLEEP"] = "0.05"
    child = spawn(["bash", str(script)], cwd=tmp, env=env)
    if sig:
        _wait_step(child, int(options.get("at", "10")), block)
        child.signal(signal.Signals[f"SIG{sig.upper().removeprefix('SIG')}"])
    rc = child.wait(120)
    want = int(options.get("exit", "0"))
    assert rc == want, f"{block.where}: exit {rc}, expected {want}\n{child.output}"
    if sig:
        assert list(tmp.rglob("step-*.ckpt")), f"{block.where}: no checkpoint\n{child.output}"


@functools.cache
def _help(command: tuple[str, ...]) -> tuple[dict[str, bool], frozenset[str]]:
    """The options of ``preemptible COMMAND --help`` (name -> takes a value) and subcommands."""
    done = subprocess.run(
        [sys.executable, "-m", "preemptible", *command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"preemptible {' '.join(command)} --help: {done.stderr}"
    options: dict[str, bool] = {}
    commands = set()
    section = ""
    for line in done.stdout.splitlines():
        if line and not line[0].isspace():
            section = line
            continue
        if section.startswith("Options"):
            m = re.match(r"^  (?:(-\w), )?(--[\w-]+)( [A-Z][A-Z_ ]*?[A-Z])?(?:\s{2,}|$)", line)
            if m:
                for name in filter(None, (m.group(1), m.group(2))):
                    options[name] = m.group(3) is not None
        elif section.startswith("Commands") and (m := re.match(r"^  (\S+)", line)):
            commands.add(m.group(1))
    return options, frozenset(commands)


def _shell_commands(text: str, where: str) -> list[list[str]]:
    """The shell lines of ``text`` (continuations joined), as word lists, comments dropped."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError as exc:
            raise AssertionError(f"{where}: cannot split {line!r} into words: {exc}") from None
        if words:
            out.append(words)
    return out


def check_options(words: list[str], where: str) -> None:
    """``words`` start at ``preemptible``; every option shown must be in that command's help.

    Synopsis brackets (``[--max-failures N]``) and alternatives (``stop|pause``) are allowed.
    """
    words = [w.strip("[]") for w in words[1:]]
    words = [w for w in words if w]
    path: list[str] = []
    while words:
        _, commands = _help(tuple(path))
        names = words[0].split("|")
        if not commands or not all(n in commands for n in names):
            break
        for name in names[1:]:
            _help((*path, name))  # each alternative is a real command
        path.append(names[0])
        words = words[1:]
    assert path, f"{where}: `preemptible {' '.join(words)}`: no such command"
    options, _ = _help(tuple(path))
    command = f"preemptible {' '.join(path)}"
    i = 0
    while i < len(words) and words[i] != "--":
        word = words[i]
        i += 1
        if not word.startswith("-"):
            continue
        name, eq, _ = word.partition("=")
        assert name in options, (
            f"{where}: `{command} {name}`: no such option in `{command} --help` "
            f"({', '.join(sorted(options))})"
        )
        if options[name] and not eq:
            assert i < len(words) and not words[i].startswith("-"), (
                f"{where}: `{command} {name}` takes a value"
            )
            i += 1


PREFIXES = {"exec", "time", "nohup", "env", "srun", "sudo"}


def _check_preemptible_lines(block: Block) -> int:
    """Check the options of each command line that runs ``preemptible``; how many there were."""
    found = 0
    for words in _shell_commands(block.text, block.where):
        rest = list(words)
        while rest and (rest[0] in PREFIXES or re.match(r"^\w+=", rest[0])):
            rest.pop(0)  # `exec preemptible run ...`, `FOO=1 preemptible ...`
        if rest and Path(rest[0]).name == "preemptible":
            check_options(rest, block.where)
            found += 1
    return found


def _run_script(block: Block, options: dict[str, str], ctx: Ctx) -> None:
    script = ctx.tmp / "readme-block.sh"
    script.write_text(block.text)
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, f"{block.where}: bash -n: {done.stderr}"
    _check_preemptible_lines(block)


def _run_synopsis(block: Block, options: dict[str, str], ctx: Ctx) -> None:
    assert _check_preemptible_lines(block), f"{block.where}: no `preemptible` command in it"


def _walk(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        return [node, *(d for v in node.values() for d in _walk(v))]
    if isinstance(node, list):
        return [d for v in node for d in _walk(v)]
    return []


def _run_yaml(block: Block, options: dict[str, str], ctx: Ctx) -> None:
    import yaml

    for doc in yaml.safe_load_all(block.text):
        nodes = _walk(doc)
        key = "terminationGracePeriodSeconds"
        grace = next((n[key] for n in nodes if key in n), None)
        for node in nodes:
            command = node.get("command")
            if command is None:
                continue
            assert isinstance(command, list), f"{block.where}: use the exec form of command"
            assert "-c" not in command[1:2], (
                f"{block.where}: {command[:2]}: a shell as PID 1 does not pass SIGTERM on"
            )
            if command and command[0] == "preemptible":
                check_options([str(c) for c in command], block.where)
            env = {e.get("name"): e.get("value") for e in node.get("env", [])}
            if grace is not None and "PREEMPTIBLE_GRACE_PERIOD" in env:
                assert str(env["PREEMPTIBLE_GRACE_PERIOD"]) == str(grace), (
                    f"{block.where}: PREEMPTIBLE_GRACE_PERIOD={env['PREEMPTIBLE_GRACE_PERIOD']} "
                    f"but terminationGracePeriodSeconds: {grace}"
                )


def _run_sweep(block: Block, options: dict[str, str], ctx: Ctx) -> None:
    """A sweep spec: ``preemptible sweep create`` must take it as it is, with nothing ignored."""
    from preemptible.sweeps.spec._spec import load_spec

    path = ctx.tmp / "sweep.yaml"
    path.write_text(block.text)
    spec = load_spec(path)  # a ConfigError names the key
    assert not spec.ignored, f"{block.where}: keys without effect: {spec.ignored}"


# -- make and output -----------------------------------------------------------------------


def makefile_recipes(text: str, overrides: dict[str, str]) -> dict[str, list[str]]:
    """Target -> its recipe lines with ``$(VAR)`` expanded (``VAR = / := / ?=`` assignments)."""
    variables: dict[str, str] = {}
    recipes: dict[str, list[str]] = {}
    current: list[str] | None = None

    def expand(s: str) -> str:
        for _ in range(10):
            s = re.sub(r"\$\((\w+)\)", lambda m: {**variables, **overrides}.get(m[1], ""), s)
        return s

    for line in text.splitlines():
        if line.startswith("\t") and current is not None:
            current.append(expand(line.strip()))
            continue
        if m := re.match(r"^(\w+)\s*[:?]?=\s*(.*)$", line):
            variables[m[1]] = m[2].strip()
            current = None
        elif (m := re.match(r"^([^\s:#=][^:=]*):(?!=)", line)) and not line.startswith("."):
            current = []
            for target in expand(m[1]).split():
                recipes[target] = current
        elif line.strip() and not line.startswith("#"):
            current = None
    return recipes


class Background:
    """A README command (``make T``: T's recipe) run once, in the background, in a session
    of its own; ``output()`` waits for it."""

    def __init__(self, command: str, workdir: Path) -> None:
        self.command, self.log = command, workdir / "output.txt"
        words = shlex.split(command)
        if words[0] == "make":
            recipes = makefile_recipes((ROOT / "Makefile").read_text(), {"BIN": str(BIN)})
            # our interpreter's bin, not a rebuilt .venv; a missing target fails in output()
            script, cwd = " && ".join(recipes.get(words[1], ["exit 127"])), ROOT
        else:
            script, cwd = command, workdir
        env = {**os.environ, **_path_env(), "TMPDIR": str(workdir), "PYTHONUNBUFFERED": "1"}
        # as on a first run: libraries build their caches (matplotlib's font list logs
        # "generated new fontManager"), and not one of their lines may reach the output
        env["MPLCONFIGDIR"] = str(workdir / "matplotlib")
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                ["bash", "-c", script],
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self, timeout: float = 420) -> str:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"`{self.command}` still running after {timeout} s") from None
        text = self.log.read_text()
        assert rc == 0, f"`{self.command}`: exit {rc}\n{text}"
        return text

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


_background: dict[str, Background] = {}


def command_output(command: str, factory: pytest.TempPathFactory) -> str:
    if command not in _background:
        _background[command] = Background(command, factory.mktemp("command"))
    return _background[command].output()


def commands_of(block: Block) -> list[str]:
    what = _plan_or_none(block)
    if what is None:
        return []
    if what.kind == "make":
        return [f"make {t}" for t in what.options.get("run", "").split(",") if t]
    if what.kind == "output" and what.options.get("of"):
        return [what.options["of"]]
    return []


def start_commands(commands: set[str], factory: pytest.TempPathFactory) -> None:
    """Start ``commands`` (each once) in the background now; ``command_output`` waits for one."""
    for command in sorted(commands):
        if command not in _background:
            _background[command] = Background(command, factory.mktemp("command"))


def stop_commands() -> None:
    """Kill what is left of the background commands, and forget them."""
    for run in _background.values():
        run.kill()
    _background.clear()


def _run_make(block: Block, options: dict[str, str], ctx: Ctx) -> None:
    run = set(filter(None, options.get("run", "").split(",")))
    skip = set(filter(None, options.get("skip", "").split(",")))
    assert not skip or options.get("why"), f'{block.where}: skip= needs why="REASON"'
    recipes = makefile_recipes((ROOT / "Makefile").read_text(), {})
    for words in _shell_commands(block.text, block.where):
        assert words[0] == "make", f"{block.where}: `{' '.join(words)}` is not a make command"
        target = words[1] if len(words) > 1 else next(iter(recipes))
        assert target in recipes, f"{block.where}: `make {target}`: no such target in Makefile"
        assert target in run | skip, f"{block.where}: `make {target}`: add it to run= or skip="
        if target in run:
            command_output(f"make {target}", ctx.factory)


def shape(text: str) -> list[str]:
    """Lines with paths and numbers replaced and spaces collapsed: what must not drift."""
    out = []
    for line in text.splitlines():
        line = re.sub(r"\S*/\S*", "PATH", line)
        line = re.sub(r"(?<![\w-])[a-z0-9]{8}(?=-\d|\b)", "ID", line)  # sweep and run ids
        line = re.sub(r"\b\d+[smhd](\d+[smhd])?\b", "AGE", line)  # status ages: 47s, 1m02s
        line = re.sub(r"\d+(\.\d+)?", "N", line)
        line = " ".join(line.split())
        if line:
            out.append(line)
    return out


def _run_output(block: Block, options: dict[str, str], ctx: Ctx) -> None:
    command = options.get("of")
    if not command:
        pytest.skip("output, not code")
    real = command_output(command, ctx.factory)
    assert shape(block.text) == shape(real), (
        f"{block.where}: the sample differs from what `{command}` prints:\n{real}"
    )


def _run_skip(block: Block, options: dict[str, str], ctx: Ctx) -> None:
    pytest.skip(options["why"])


PY, SH, YAML = frozenset({"python"}), frozenset({"bash", "sh", "shell"}), frozenset({"yaml", "yml"})
KINDS: dict[str, Kind] = {
    "python": Kind(_run_python, frozenset({"setup", "exit", "group"}), PY, 150),
    "loop": Kind(_run_loop, frozenset({"setup", "exit", "at", "group", "bucket"}), PY, 240),
    "shell": Kind(_run_shell, frozenset({"signal", "at", "exit"}), SH, 150),
    "torchrun": Kind(_run_torchrun, frozenset({"at", "exit", "launcher"}), PY, 300),
    "trainer": Kind(_run_trainer, frozenset({"at"}), PY, 300),
    "script": Kind(_run_script, frozenset(), SH),
    "synopsis": Kind(_run_synopsis, frozenset(), SH),
    "yaml": Kind(_run_yaml, frozenset(), YAML),
    "sweep": Kind(_run_sweep, frozenset(), YAML),
    "make": Kind(_run_make, frozenset({"run", "skip", "why"}), SH, 300),
    "output": Kind(_run_output, frozenset({"of"}), None, 480),
    "skip": Kind(_run_skip, frozenset(), None),
}


def timeout_of(block: Block) -> int:
    """The time limit of ``block``'s test: its kind's (60 s where it has no valid marker)."""
    try:
        return KINDS[plan(block).kind].timeout
    except AssertionError:
        return 60
