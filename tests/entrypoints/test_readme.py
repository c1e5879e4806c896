"""Every `draftwise ...` command in the README's code blocks parses: its subcommand and flags are
accepted (run with --help, so nothing heavy starts)."""
import os
import re
import shlex

import pytest

from draftwise.entrypoints.cli import main
from tests.helpers import REPO_ROOT

README = os.path.join(REPO_ROOT, "README.md")


def _commands() -> list[str]:
    text = open(README).read()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith("draftwise "):
                    out.append(part)
    return out


def test_readme_has_draftwise_commands():
    assert len(_commands()) >= 6


@pytest.mark.parametrize("cmd", _commands())
def test_readme_command_parses(cmd, capsys):
    argv = shlex.split(cmd)[1:]
    argv = [a for a in argv if not (a.startswith("[") or a.endswith("]"))]
    with pytest.raises(SystemExit) as e:
        main(argv + ["--help"])
    assert e.value.code == 0, capsys.readouterr().err
