"""The README and docs/ hold to the code: every relative link reaches a file (an ``#anchor``, a heading
of it), and every ``gr`` command in a shell block names a command, and flags, that its parser accepts.

The parsers are the commands' own, taken in-process: each command's ``main`` runs with argparse's
``parse_args`` / ``parse_known_args`` replaced by a stop that hands back the parser it was called on.
A command that parses with ``parse_known_args`` takes ``--section.key VALUE`` config overrides, which
are checked against the config reference (``gr.train.config_reference.config_keys``).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from functools import lru_cache
from pathlib import Path
from typing import Dict, FrozenSet, Iterator, List, NamedTuple, Optional, Tuple
from unittest import mock

from gr.commands import cli
from gr.train.config_reference import config_keys

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "custom_project" / "README.md"]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
# The commands that take config overrides, and the sections they accept (None: every section).
OVERRIDE_SECTIONS: Dict[str, Optional[FrozenSet[str]]] = {
    "train": None,
    "plan": None,
    "evaluate": frozenset({"data"}),
    "data prepare": frozenset({"data"}),
}
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "<"}
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# An inline code span, which may continue on the next line of its paragraph but never past a blank line.
CODE_SPAN = re.compile(r"`(?:[^`\n]|\n(?![ \t]*\n))*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
GR_WORD = re.compile(r"(^|\s)(\S*/)?(gr|train\.py)(\s|$)")


class Block(NamedTuple):
    """A fenced block: its language (lower case, may be empty), first line number (1-based) and text."""

    language: str
    line: int
    text: str


class Page(NamedTuple):
    """A Markdown page split into the prose outside fences (fenced lines blanked, so line numbers
    hold) and its fenced blocks."""

    prose: str
    blocks: List[Block]


def split_page(text: str) -> Page:
    prose: List[str] = []
    blocks: List[Block] = []
    fence: Optional[str] = None
    language, start, body = "", 0, list[str]()
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence, language, start, body = match.group(1), match.group(2).lower(), number + 1, []
            prose.append("")
        elif fence is not None and line.strip().startswith(fence) and not line.strip()[len(fence) :].strip():
            blocks.append(Block(language, start, "\n".join(body)))
            fence = None
            prose.append("")
        elif fence is not None:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    return Page("\n".join(prose), blocks)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> FrozenSet[str]:
    """The anchors of a page's headings (a repeated one gets -1, -2, ... as on GitHub)."""
    seen: Dict[str, int] = {}
    found = set()
    for line in split_page(path.read_text(encoding="utf-8")).prose.splitlines():
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def page_name(path: Path) -> str:
    """A page's path as messages name it: from the repository root where it lies inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def link_problems(page_path: Path, text: str) -> Iterator[str]:
    """'<page>:<line>: <what is wrong>' for each relative link of ``text`` that leads nowhere."""
    prose = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), split_page(text).prose)
    for match in LINK.finditer(prose):
        target = match.group(1)
        where = f"{page_name(page_path)}:{prose.count(chr(10), 0, match.start()) + 1}"
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):
            continue  # https:, mailto:: not ours to check
        path_part, _, anchor = target.partition("#")
        if path_part.startswith("/"):
            yield f"{where}: {target}: make the link relative to the page"
            continue
        resolved = (page_path.parent / path_part).resolve() if path_part else page_path
        if not resolved.exists():
            yield f"{where}: {target}: no such file {page_name(resolved)}"
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            yield f"{where}: {target}: no heading #{anchor} in {resolved.name}"


class Invocation(NamedTuple):
    where: str
    args: List[str]


def logical_lines(block: Block) -> Iterator[Tuple[int, str]]:
    """(line number, text) of each shell line of a block, a line ending in a backslash joined to the next."""
    number, parts = block.line, list[str]()
    for offset, line in enumerate(block.text.splitlines()):
        if not parts:
            number = block.line + offset
        if line.endswith("\\"):
            parts.append(line[:-1])
            continue
        yield number, " ".join([*parts, line])
        parts = []
    if parts:
        yield number, " ".join(parts)


def invocations(page: str, block: Block) -> Iterator[Invocation]:
    """Each ``gr ...`` (also ``.venv/bin/gr``, ``python -m gr``, ``train.py`` = ``gr train``) of a shell block:
    its arguments, continuation lines joined, comments and a ``$`` prompt dropped, cut at a shell operator."""
    for number, line in logical_lines(block):
        where = f"{page}:{number}"
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            if GR_WORD.search(line.split("#")[0]):
                raise AssertionError(f"{where}: cannot split the shell line {line!r}") from None
            continue  # e.g. a curl body that goes on over several lines
        for i, token in enumerate(tokens):
            if os.path.basename(token) == "gr" or (token == "gr" and i > 0 and tokens[i - 1] == "-m"):
                args = tokens[i + 1 :]
            elif os.path.basename(token) == "train.py":
                args = ["train", *tokens[i + 1 :]]
            else:
                continue
            cut = next((j for j, arg in enumerate(args) if arg in SHELL_OPERATORS), len(args))
            yield Invocation(where, args[:cut])
            break


class _Parsed(BaseException):
    """Raised instead of parsing: the parser a command built, and whether it takes unknown arguments."""

    def __init__(self, parser: argparse.ArgumentParser, known: bool):
        super().__init__()
        self.parser, self.known = parser, known


def _stop_known(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
    raise _Parsed(self, known=True)


def _stop(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
    raise _Parsed(self, known=False)


@lru_cache(maxsize=None)
def command_parser(words: Tuple[str, ...]) -> Tuple[argparse.ArgumentParser, bool]:
    """(the argparse parser of ``gr <words>``, whether it takes config overrides), from the command's own
    ``main``, stopped where it parses."""
    function, rest, error = cli.resolve(list(words))
    assert function is not None, error
    with (
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", _stop_known),
        mock.patch.object(argparse.ArgumentParser, "parse_args", _stop),
    ):
        try:
            function(rest)
        except _Parsed as parsed:
            parser, known = parsed.parser, parsed.known
        else:
            raise AssertionError(f"gr {' '.join(words)} returned without parsing its arguments")
    for action in parser._actions:  # gr serve | rank | recommend | generate: one parser, a subparser each
        if isinstance(action, argparse._SubParsersAction):
            parser = action.choices[rest[0]]
    return parser, known


@lru_cache(maxsize=None)
def config_key_types() -> Dict[str, str]:
    return {key.path: key.type for key in config_keys()}


def config_key_known(dotted: str, sections: Optional[FrozenSet[str]]) -> bool:
    """Whether ``--<dotted>`` overrides a config key: one of the reference's (list items by index,
    ``model.tables.0.embedding_dim``), a whole section or list, or a key inside a mapping-valued one."""
    if sections is not None and dotted.split(".")[0] not in sections:
        return False
    path = re.sub(r"\.\d+(?=\.|$)", "[]", dotted)
    keys = config_key_types()
    return (
        path in keys
        or any(key.startswith((path + ".", path + "[]")) for key in keys)
        or any(path.startswith((key + ".", key + "[]")) for key, kind in keys.items() if "mapping" in kind)
    )


def command_problems(invocation: Invocation) -> Iterator[str]:
    """What is wrong with one ``gr`` invocation: an unknown command or subcommand, or a flag its parser lacks."""
    where, args = invocation
    if not args or args[0] in ("-h", "--help"):
        return
    name, rest = args[0], args[1:]
    if name not in cli.COMMANDS:
        yield f"{where}: gr {name}: no such command (expected one of {sorted(cli.COMMANDS)})"
        return
    words: Tuple[str, ...] = (name,)
    if name in cli.SUBCOMMANDS:
        subcommands = cli.SUBCOMMANDS[name][0]
        if not rest or rest[0] not in subcommands:
            yield f"{where}: gr {name}: expected a subcommand {sorted(subcommands)}"
            return
        words, rest = (name, rest[0]), rest[1:]
    command = " ".join(words)
    parser, _ = command_parser(words)
    for arg in rest:
        if not arg.startswith("-") or arg == "-" or re.fullmatch(r"-\d[\d.e+-]*", arg):
            continue  # a positional argument or a value
        flag = arg.split("=", 1)[0]
        if flag in parser._option_string_actions:
            continue
        if flag.startswith("--") and "." in flag and command in OVERRIDE_SECTIONS:
            if not config_key_known(flag[2:], OVERRIDE_SECTIONS[command]):
                sections = OVERRIDE_SECTIONS[command]
                scope = "a config key" if sections is None else f"a key of {sorted(sections)}"
                yield f"{where}: gr {command} {flag}: not {scope} (gr train --help lists them)"
            continue
        yield f"{where}: gr {command} {flag}: no such option"


def page_texts() -> Iterator[Tuple[Path, str]]:
    for path in PAGES:
        yield path, path.read_text(encoding="utf-8")


def test_relative_links_reach_a_file_and_heading() -> None:
    problems = [problem for path, text in page_texts() for problem in link_problems(path, text)]
    assert not problems, "\n".join(problems)


def test_shell_blocks_name_commands_and_flags_that_exist() -> None:
    found = [
        invocation
        for path, text in page_texts()
        for block in split_page(text).blocks
        if block.language in SHELL_LANGUAGES
        for invocation in invocations(page_name(path), block)
    ]
    assert len({tuple(i.args[:1]) for i in found}) >= 10, "the shell blocks should show most commands"
    problems = [problem for invocation in found for problem in command_problems(invocation)]
    assert not problems, "\n".join(problems)


def test_override_taking_commands_are_the_ones_checked_against_the_config() -> None:
    words = [(name,) for name in cli.COMMANDS if name not in cli.SUBCOMMANDS]
    words += [(name, sub) for name, (subs, _) in cli.SUBCOMMANDS.items() for sub in subs]
    takes_overrides = {" ".join(w) for w in words if command_parser(w)[1]}
    assert takes_overrides == set(OVERRIDE_SECTIONS)


def test_checker_reports_a_broken_link_anchor_command_and_flag(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    text = (
        "# Title\n\nSee [a](missing.md), [b](#title), [c](#no-such-heading) and `[d](in-code.md)`.\n\n"
        "```bash\ngr train --config c.yaml --trainer.max_epochs 3 --trainer.max_epoch 3  # a comment --nope\n"
        "gr evaluate runs/x --data.path d --model.hstu.num_layers 2\ngr frob x\ngr data fetch x\n"
        "gr serve exports/e --port 8000 \\\n    --no-such-flag\n.venv/bin/gr check e --overwrite\n```\n"
    )
    page.write_text(text)
    links = [problem.split(": ", 1)[1] for problem in link_problems(page, text)]
    assert [link.split(":")[0] for link in links] == ["missing.md", "#no-such-heading"]
    block = split_page(text).blocks[0]
    problems = [p for invocation in invocations("page.md", block) for p in command_problems(invocation)]
    assert problems == [
        "page.md:6: gr train --trainer.max_epoch: not a config key (gr train --help lists them)",
        "page.md:7: gr evaluate --model.hstu.num_layers: not a key of ['data'] (gr train --help lists them)",
        f"page.md:8: gr frob: no such command (expected one of {sorted(cli.COMMANDS)})",
        "page.md:9: gr data: expected a subcommand ['download', 'prepare']",
        "page.md:10: gr serve --no-such-flag: no such option",
        "page.md:12: gr check --overwrite: no such option",
    ]
