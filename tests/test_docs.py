"""The command lines the README and the docs show are ones the command line takes: each
``elmo-jax ...`` in a shell block parses with the real parser (a renamed or dropped flag fails
here, not in a new user's terminal). Nothing is run."""

import contextlib
import io
import pathlib
import re
import shlex

import pytest

from elmo_jax.cli.parser import build_parser

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "experiments" / "README.md"]
SHELL = {"", "bash", "sh", "shell", "console"}


def shell_blocks(text: str) -> list[str]:
    """The bodies of the fenced blocks whose language is a shell's (or none)."""
    blocks, body, language = [], None, ""
    for line in text.splitlines():
        fence = re.match(r"^\s*```(\S*)", line)
        if fence and body is None:
            body, language = [], fence[1].lower()
        elif fence:
            if language in SHELL:
                blocks.append("\n".join(body))
            body = None
        elif body is not None:
            body.append(line)
    return blocks


def commands(block: str) -> list[str]:
    """Each ``elmo-jax`` command of a block: continuation lines joined, split at ``&&``, ``;`` and
    pipes, comments dropped; a command with a placeholder (``...``) is left out."""
    found = []
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line)
        for part in re.split(r"&&|;|\|", line):
            command = re.search(r"(?:^|[\s/])elmo-jax\s+(.*)$", part.strip())
            if command and "..." not in command[1]:
                found.append(command[1].strip())
    return found


def refusal(command: str) -> str | None:
    """argparse's last line for a command it refuses, else None."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(shlex.split(command))
    except SystemExit as e:
        if e.code:
            return err.getvalue().strip().splitlines()[-1]
    return None


SHOWN = sorted(
    {
        (page.relative_to(ROOT).as_posix(), c)
        for page in PAGES
        for b in shell_blocks(page.read_text())
        for c in commands(b)
    }
)


def test_the_pages_show_commands_to_check():
    assert len(SHOWN) >= 15, SHOWN
    assert {page for page, _ in SHOWN} >= {"README.md", "docs/pretraining.md"}


@pytest.mark.parametrize(("page", "command"), SHOWN, ids=[f"{p}: {c[:60]}" for p, c in SHOWN])
def test_every_command_a_page_shows_parses(page, command):
    assert refusal(command) is None, f"{page}: elmo-jax {command}: {refusal(command)}"


def test_a_flag_the_command_line_does_not_have_is_caught():
    """The negative control: a renamed flag, a dropped command, a missing value."""
    assert refusal("train --steps 5") is None
    assert "unrecognized arguments: --stepz" in refusal("train --stepz 5")
    assert "invalid choice: 'pretrain'" in refusal("pretrain --steps 5")
    assert "expected one argument" in refusal("train --steps")
    block = "```bash\nelmo-jax train --stepz 5  # a comment\n```\n```python\nelmo-jax = 1\n```"
    assert [refusal(c) for b in shell_blocks(block) for c in commands(b)] == [
        "elmo-jax train: error: unrecognized arguments: --stepz 5 (see elmo-jax train --help)"
    ]
