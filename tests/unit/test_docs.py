"""The docs against the code: every CLI flag and config key is in docs/configuration.md, every
documented one still exists; the README stays a short landing page; no link leaves the repository.

docs/configuration.md has one section per command (a heading naming `pdserve <command>`) and one per
config model (a heading naming `<ModelClass>`). Each section's table lists its flags or keys in
the first column, in backticks. No process is started: the parsers are built, not run.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import typing
from pathlib import Path
from unittest import mock

import pytest
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
CONFIGURATION = ROOT / "docs" / "configuration.md"
README_MAX_LINES = 150

# pdserve.cli.main argv -> the section of docs/configuration.md that documents that parser
COMMANDS = {
    "launch": ["launch"],
    "serve": ["serve"],
    "bench": ["bench"],
    "bench plot": ["bench", "plot"],
    "bench advise": ["bench", "advise"],
    "bench-engine": ["bench-engine"],
    "make-tiny-model": ["make-tiny-model"],
    "health": ["health"],
}


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parser_of(argv: list[str]) -> argparse.ArgumentParser:
    """The parser `pdserve <argv>` would parse its flags with: the CLI runs up to parse_args, which
    raises with the parser instead of parsing (so nothing is served, benchmarked or written)."""
    from pdserve import cli

    def grab(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Parsed(self if self.prog != "pdserve" else _subparser(self, argv))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", grab):
        try:
            cli.main(list(argv))
        except _Parsed as got:
            return got.parser
    raise AssertionError(f"pdserve {' '.join(argv)} never parsed its arguments")


def _subparser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and argv[0] in action.choices:
            return action.choices[argv[0]]
    raise AssertionError(f"{parser.prog} has no subcommand {argv[0]}")


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}


def _sections() -> dict[str, str]:
    """Heading line -> the text up to the next heading."""
    out: dict[str, str] = {}
    heading, body = "", []
    for line in CONFIGURATION.read_text().splitlines():
        if line.startswith("#"):
            out[heading] = "\n".join(body)
            heading, body = line, []
        else:
            body.append(line)
    out[heading] = "\n".join(body)
    return out


def _section(name: str) -> str:
    found = [text for heading, text in _sections().items() if f"`{name}`" in heading]
    assert len(found) == 1, f"docs/configuration.md: want one heading naming `{name}`, found {len(found)}"
    return found[0]


def _first_cells(section: str) -> list[list[str]]:
    """The backticked names in the first cell of each table row."""
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return [re.findall(r"`([^`]+)`", cell) for cell in rows]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_documented(command: str) -> None:
    flags = _flags(_parser_of(COMMANDS[command]))
    names = [n for cell in _first_cells(_section(f"pdserve {command}")) for n in cell]
    missing = sorted(flags - set(names))
    assert not missing, f"pdserve {command}: flags missing from docs/configuration.md: {missing}"
    gone = sorted(n for n in names if n.startswith("-") and n not in flags)
    assert not gone, f"pdserve {command}: docs/configuration.md documents flags that do not exist: {gone}"


def _models() -> list[type[BaseModel]]:
    """Every config model a user sets: the cluster YAML and what it nests, a component's serve
    file, the offline engine's keyword arguments, and the nixl backend's transfer.options."""
    from pdserve.config import ClusterConfig
    from pdserve.engine.config import EngineConfig
    from pdserve.serve_config import RouterServeConfig, WorkerServeConfig

    seen: list[type[BaseModel]] = []
    todo: list[type[BaseModel]] = [ClusterConfig, WorkerServeConfig, RouterServeConfig, EngineConfig, _nixl_options()]
    while todo:
        model = todo.pop(0)
        if model in seen:
            continue
        seen.append(model)
        for field in model.model_fields.values():
            todo.extend(_nested_models(field.annotation))
    return seen


def _nested_models(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) is not None:
        return [m for arg in typing.get_args(annotation) for m in _nested_models(arg)]
    return []


def _nixl_options() -> type[BaseModel]:
    """NixlOptions, wherever the nixl backend keeps it in pdserve.disagg."""
    import pdserve.disagg as disagg

    for info in pkgutil.walk_packages(disagg.__path__, "pdserve.disagg."):
        if "nixl" in info.name:
            found = getattr(importlib.import_module(info.name), "NixlOptions", None)
            if found is not None:
                return found
    raise AssertionError("no NixlOptions in pdserve.disagg")


def test_every_config_key_is_documented() -> None:
    problems = []
    for model in _models():
        cells = _first_cells(_section(model.__name__))
        names = {cell[0] for cell in cells if cell}
        missing = sorted(set(model.model_fields) - names)
        gone = sorted(names - set(model.model_fields))
        if missing:
            problems.append(f"{model.__name__}: keys missing: {missing}")
        if gone:
            problems.append(f"{model.__name__}: documented keys that do not exist: {gone}")
    assert not problems, "docs/configuration.md:\n" + "\n".join(problems)


def test_readme_is_short_and_undated() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has {len(text.splitlines())} lines"
    dates = re.findall(r"\b\d{4}-\d{2}-\d{2}\b", text)
    assert not dates, f"README.md holds dates (history belongs in docs/): {dates}"
    hexes = re.findall(r"(?<![\w-])[0-9a-f]{7,40}(?![\w-])", text)
    hashes = [h for h in hexes if re.search(r"[a-f]", h) and re.search(r"\d", h)]
    assert not hashes, f"README.md holds what look like commit hashes: {hashes}"


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_in_the_repository(path: Path) -> None:
    bad = []
    for target in LINK.findall(path.read_text()):
        file = target.split("#", 1)[0]
        if not file:
            continue  # an anchor in the same page
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", file) or file.startswith(("/", "~")):
            bad.append(f"{target} (outside the repository)")
            continue
        resolved = (path.parent / file).resolve()
        if not resolved.is_relative_to(ROOT):
            bad.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            bad.append(f"{target} (no such file)")
    assert not bad, f"{path.relative_to(ROOT)}: links that do not resolve: {bad}"
