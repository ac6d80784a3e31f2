"""README.md and docs/ against the code: every repository path they name exists, every module path imports, every
relative link and its anchor resolves, and every `--option` of a command is one that command's parser (or script)
takes. So the documentation cannot drift from the tree it describes."""

from __future__ import annotations

import functools
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser as torchrun_parser

from fastformer.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200
CODE_SUFFIXES = (".py", ".sh", ".cpp", ".cu", ".md")
# External programs whose options the documentation quotes: their own --help is the oracle.
TOOL_HELP = {"pip": [sys.executable, "-m", "pip", "install", "--help"], "cmake": ["cmake", "--help"],
             "ctest": ["ctest", "--help"], "sacrebleu": [sys.executable, "-m", "sacrebleu", "--help"]}
SHELL_WORDS = {"echo", "kill", "wait", "sleep", "time", "cd", "export", "tail", "head", "cat", "ls", "grep", "#"}


def _tracked_files() -> set[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    return set(listed.stdout.split())


TRACKED = _tracked_files()
TRACKED_DIRS = {str(parent) for name in TRACKED for parent in Path(name).parents if str(parent) != "."}
TOP_LEVEL = {name.split("/")[0] for name in TRACKED}
BASENAMES = {Path(name).name for name in TRACKED}


def _code_texts(markdown: str) -> list[str]:
    """The code in a page: fenced and indented blocks (continuation lines joined), then inline spans."""
    texts, block, fenced = [], [], False
    for line in markdown.splitlines() + [""]:
        if line.startswith("```"):
            if fenced:
                texts.append("\n".join(block))
                block = []
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            block.append(line[0 if fenced else 4:])
        elif block and not fenced:
            texts.append("\n".join(block))
            block = []
    prose = re.sub(r"```.*?```", "", markdown, flags=re.S)
    prose = "\n".join(line for line in prose.splitlines() if not line.startswith("    "))
    texts += re.findall(r"`([^`\n]+)`", prose)
    return [text.replace("\\\n", " ") for text in texts]


def _commands(code: str) -> list[list[str]]:
    """Shell commands in a piece of code, each a list of words (comments, pipes, && and ; split them apart)."""
    commands = []
    for line in code.splitlines():
        line = line.split(" #")[0]
        if line.lstrip().startswith("#"):
            continue
        for part in re.split(r"\s*(?:&&|\|\||\||;)\s*", line):
            try:
                words = shlex.split(part)
            except ValueError:
                words = part.split()
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]
            if words:
                commands.append([word.strip("[]") for word in words if word.strip("[]")])
    return commands


def _long_options(words: list[str]) -> list[str]:
    return [word.split("=")[0] for word in words if re.fullmatch(r"--[a-z][a-z0-9_-]*(=.*)?", word)]


def _parser_options(parser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


@functools.cache
def cli_options() -> dict[str, set[str]]:
    """The fastformer CLI's options, by subcommand."""
    subcommands = next(action for action in build_parser()._actions if action.choices and action.dest == "command")
    return {name: _parser_options(parser) for name, parser in subcommands.choices.items()}


@functools.cache
def help_options(command: tuple[str, ...]) -> set[str]:
    """The long options a program's --help lists."""
    shown = subprocess.run(list(command), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, f"{' '.join(command)} failed: {shown.stderr[-500:]}"
    return set(re.findall(r"--[a-z][a-z0-9_-]*", shown.stdout))


def script_options(script: str) -> set[str]:
    if script.endswith(".py"):
        return help_options((sys.executable, script, "--help"))
    return set(re.findall(r"--[a-z][a-z0-9_-]*", (ROOT / script).read_text()))


@functools.cache
def every_option() -> set[str]:
    """What an option quoted on its own may belong to: the CLI, the benchmark scripts, torchrun, sacreBLEU."""
    options = set().union(*cli_options().values(), _parser_options(torchrun_parser()),
                          help_options(tuple(TOOL_HELP["sacrebleu"])))
    for script in sorted(TRACKED):
        if script.startswith("benchmarks/") and (script.endswith(".sh") or (
                script.endswith(".py") and '__name__ == "__main__"' in (ROOT / script).read_text())):
            options |= script_options(script)
    return options


def unknown_options(words: list[str]) -> list[str]:
    """The options of one command that its program does not take; [] for a program this project does not own."""
    program = "" if words[0].endswith("/") else Path(words[0]).name
    if program in ("python", "python3") and len(words) > 2 and words[1] == "-m":
        if words[2] != "fastformer":
            return []
        words, program = ["fastformer", *words[3:]], "fastformer"
    elif program in ("python", "python3") and len(words) > 1:
        words, program = words[1:], words[1]
    if program == "bash" and len(words) > 1:
        words, program = words[1:], words[1]
    if program == "torchrun":
        script_at = next((i for i, word in enumerate(words[1:], 1) if not word.startswith("-")), len(words))
        bad = [option for option in _long_options(words[1:script_at])
               if option not in _parser_options(torchrun_parser())]
        return bad + (unknown_options(words[script_at:]) if script_at < len(words) else [])
    if program == "fastformer":
        if len(words) < 2 or words[1].startswith("-"):
            return [option for option in _long_options(words) if option not in build_parser()._option_string_actions]
        if words[1] not in cli_options():
            return [f"subcommand {words[1]}"]
        return [option for option in _long_options(words[2:]) if option not in cli_options()[words[1]]]
    if program in TOOL_HELP:
        return [option for option in _long_options(words) if option not in help_options(tuple(TOOL_HELP[program]))]
    if program in TRACKED and program.endswith((".py", ".sh")):
        if program == "tests/run.sh":  # its arguments go to pytest
            return []
        own = words[1:words.index("--")] if "--" in words else words[1:]  # after "--": another program's
        return [option for option in _long_options(own) if option not in script_options(program)]
    if words[0].startswith("--"):  # an option quoted on its own, in prose
        return [option for option in _long_options(words) if option not in every_option()]
    return []


def _path_words(text: str) -> list[str]:
    return [word.rstrip(".,:;)") for word in re.findall(r"[\w./*{}~+-]+", text)]


def missing_paths(text: str) -> list[str]:
    """Repository paths (their first part a top-level entry of the tree) that name nothing tracked, and bare source
    file names that no tracked file has."""
    missing = []
    for word in _path_words(text):
        if "/" in word:
            first = word.split("/")[0]
            if first not in TOP_LEVEL or "{" in word or "*" in word:
                continue
            path = word.rstrip("/")
            if path not in TRACKED and path not in TRACKED_DIRS:
                missing.append(word)
        elif word.endswith(CODE_SUFFIXES) and not word.startswith((".", "-")) and word not in BASENAMES:
            missing.append(word)
    return missing


def unimportable_modules(text: str) -> list[str]:
    """Dotted names under fastformer or triton_kernels that neither import nor resolve as attributes."""
    bad = []
    for name in sorted(set(re.findall(r"\b(?:fastformer|triton_kernels)(?:\.[A-Za-z_]\w*)+", text))):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                target = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        try:
            for attribute in parts[cut:]:
                target = getattr(target, attribute)
        except AttributeError:
            bad.append(name)
    return bad


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
            if anchor not in {_anchor(heading) for heading in headings}:
                broken.append(target)
    return broken


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_path_a_page_names_exists(page):
    markdown = re.sub(r"\]\([^)]*\)", "]", page.read_text())  # link targets are checked on their own
    assert missing_paths(markdown) == [], f"{_page_id(page)} names paths that are not in the tree"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_module_a_page_names_imports(page):
    assert unimportable_modules(page.read_text()) == [], f"{_page_id(page)} names modules that do not exist"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_relative_link_resolves(page):
    assert broken_links(page) == [], f"{_page_id(page)} links to files or anchors that do not exist"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_option_of_a_command_exists(page):
    unknown = {}
    for code in _code_texts(page.read_text()):
        for words in _commands(code):
            if Path(words[0]).name not in SHELL_WORDS:
                unknown.update({option: " ".join(words)[:100] for option in unknown_options(words)})
    assert unknown == {}, f"{_page_id(page)}: options no parser takes (option: in command)"


def test_readme_is_short_and_each_docs_page_starts_from_a_command():
    assert len(PAGES[0].read_text().splitlines()) <= README_MAX_LINES
    for page in PAGES[1:]:
        before_sections = page.read_text().split("\n## ")[0]
        assert "\n    " in before_sections or "\n```" in before_sections, \
            f"{_page_id(page)} does not start from a command (a code block before its first section)"


# The checkers themselves, on text with known faults: each must catch what it is for.
def test_the_checkers_catch_a_stale_path_module_link_and_option(tmp_path):
    assert missing_paths("see `fastformer/train.py` and `fastformer/training/trainer.py`") == ["fastformer/train.py"]
    assert missing_paths("`search_rules.py` next to `rules.py`") == ["search_rules.py"]
    assert unimportable_modules("`fastformer.export.to_ctranslate2`, `fastformer.translation.export.to_ctranslate2`"
                                ) == ["fastformer.export.to_ctranslate2"]
    page = tmp_path / "page.md"
    page.write_text("# Page\n## A section\n[ok](#a-section) [gone](#nowhere) [file](missing.md)\n")
    assert broken_links(page) == ["#nowhere", "missing.md"]
    assert unknown_options(["fastformer", "translate", "--beam", "4", "--beam-width", "4"]) == ["--beam-width"]
    assert unknown_options([".venv/bin/torchrun", "--nproc_per_node=2", "--no-python", ".venv/bin/fastformer",
                            "train", "--max-step", "3"]) == ["--max-step"]
    assert unknown_options(["python", "benchmarks/cpu_decoding.py", "--rounds", "2", "--round", "2"]) == ["--round"]
    assert unknown_options(["--no-such-option"]) == ["--no-such-option"]
    assert unknown_options(["--resume"]) == []
