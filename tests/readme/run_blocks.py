"""Run code blocks of one page (README.md or docs/**/*.md) as one program:
``python run_blocks.py SPEC.json``.

SPEC is ``{"setup": "plain", "page": "README.md", "blocks": [[line, text], ...]}``. The setup
module (a file beside this one) and then each block run in one namespace, named ``__main__``;
a block is compiled as its page at its own line numbers, so a traceback points at the page.
The setup's ``finish()`` runs after the last block (it writes what the test compares).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    namespace: dict[str, object] = {"__name__": "__main__"}
    setup = HERE / f"{spec['setup']}.py"
    exec(compile(setup.read_text(), str(setup), "exec"), namespace)
    for line, text in spec["blocks"]:
        exec(compile("\n" * (line - 1) + text, spec.get("page", "README.md"), "exec"), namespace)
    finish = namespace.get("finish")
    if callable(finish):
        finish()
    print("readme-blocks-done", flush=True)


if __name__ == "__main__":
    main()
