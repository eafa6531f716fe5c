"""Issue 34: the top README's examples use one form for the project's commands:
`.venv/bin/pd-...` (where `make setup` installs them), as the README says."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"^```(?:bash|sh)\n(.*?)^```", re.MULTILINE | re.DOTALL)
COMMAND = re.compile(r"(?<![\w./-])(pd-(?:serve|router|prefill|decode|client|generate|bench))\b")


def test_readme_shell_examples_run_the_commands_from_the_venv() -> None:
    text = README.read_text(encoding="utf-8")
    assert ".venv/bin/pd-" in text and "drop the `.venv/bin/`" in text  # the form, said once
    bare = []
    for block in BLOCK.findall(text):
        for line in block.splitlines():
            command = line.split("#", 1)[0]  # comments may name a command in words
            for match in COMMAND.finditer(command):
                if not command[: match.start()].endswith(".venv/bin/"):
                    bare.append(line.strip())
    assert not bare, f"README examples run a pd- command without .venv/bin/: {bare}"
