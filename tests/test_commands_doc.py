"""docs/commands.md documents the command line as it is: every command and every option of the typer
app appears in its command's section, and the option tables name no option the command lacks."""
import re
from pathlib import Path

import typer

from kvsim.sim.cli import app

DOC = Path(__file__).resolve().parents[1] / "docs" / "commands.md"


def commands(group=None, path=()):
    """(path, click command) of every leaf command of the app, e.g. (('trace', 'stats'), <command>)."""
    group = group or typer.main.get_command(app)
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from commands(command, (*path, name))
        else:
            yield (*path, name), command


def doc_sections() -> dict[str, str]:
    parts = re.split(r"(?m)^### `kvsim ([^`]+)`\n", DOC.read_text())
    return dict(zip(parts[1::2], parts[2::2], strict=False))


def names(param) -> list[str]:
    if param.param_type_name == "argument":
        return [param.name.upper()]
    return [*param.opts, *param.secondary_opts]


def test_every_command_and_option_is_documented():
    sections = doc_sections()
    for path, command in commands():
        key = " ".join(path)
        assert key in sections, f"docs/commands.md has no section for `kvsim {key}`"
        for param in command.params:
            for name in names(param):
                assert f"`{name}" in sections[key], f"`kvsim {key}`: {name} is not documented"


def test_documented_options_exist():
    sections = doc_sections()
    every = {" ".join(path): {n for p in command.params for n in names(p)} for path, command in commands()}
    assert set(sections) == set(every)
    for key, text in sections.items():
        for row in re.findall(r"(?m)^\| (`[^|]+) \|", text):
            for name in re.findall(r"`([^`.]+?)(?:\.\.\.)?`", row):
                assert name in every[key], f"`kvsim {key}` documents {name}, which it does not have"


def test_every_option_says_what_it_does():
    """`kvsim reference vllm --help` listed --max-model-len, --long-prefill-token-threshold and
    --chunked-prefill with no text (and commands.md's table with empty cells): --help must say what
    every option does."""
    blank = [f"kvsim {' '.join(path)} {names(p)[0]}" for path, command in commands() for p in command.params
             if p.param_type_name == "option" and not (p.help or "").strip() and names(p)[0] != "--help"]
    assert not blank, f"options without help text: {blank}"
