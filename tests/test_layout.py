"""The shape a reader opens: the method and its commands at the top level, the plumbing in one folder that imports
none of the commands, every folder's README naming its files, the installed modules matching the tree, and the
algorithm path short enough to read in one sitting."""
import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONCEPTS = {"protocol", "rollout", "code_tool", "reward", "grpo_roc", "schedule", "mismatch"}
COMMANDS = {"sft", "train", "eval"}
FOLDERS = ("plumbing", "samplers", "sandbox", "smol", "tiny", "tools")
ALGORITHM_PATH = ("protocol", "rollout", "grpo_roc", "schedule", "train")
ALGORITHM_PATH_MAX_LINES = 1000

pytestmark = pytest.mark.spec


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not inside a docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    ignored = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in ignored:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def test_code_lines_by_hand():
    source = '"""Doc\nstring."""\n\n# a comment\nx = 1  # trailing\n\n\ndef f():\n    """One."""\n    return (1,\n            2)\n'
    assert code_lines(source) == 4  # x = 1, def f():, and the two lines of the return


def test_the_top_level_is_the_method_and_its_commands():
    top = {p.stem for p in ROOT.glob("*.py")}
    assert top == CONCEPTS | COMMANDS and len(top) <= 10


def test_each_folder_s_readme_names_every_module_in_it():
    for folder in FOLDERS:
        readme = (ROOT / folder / "README.md").read_text()
        for module in sorted((ROOT / folder).glob("*.py")):
            if module.name != "__init__.py":
                assert f"`{module.name}`" in readme, f"{folder}/README.md does not name {module.name}"


def test_the_install_lists_the_tree():
    pyproject = (ROOT / "pyproject.toml").read_text()
    modules = set(re.findall(r'"(\w+)"', re.search(r"py-modules = \[([^\]]*)\]", pyproject).group(1)))
    packages = set(re.findall(r'"(\w+)"', re.search(r"packages = \[([^\]]*)\]", pyproject).group(1)))
    assert modules == {p.stem for p in ROOT.glob("*.py")}
    assert packages == {p.parent.name for p in ROOT.glob("*/__init__.py")} == set(FOLDERS)


def test_the_plumbing_imports_no_command():
    """Machinery serves the commands, never the other way round: no module under plumbing/ imports sft, train or
    eval (the record of a trajectory, which the RL stage writes in eval's format, lives in rollout.py)."""
    for module in (ROOT / "plumbing").glob("*.py"):
        imports = re.findall(r"^\s*(?:import|from) (\w+)", module.read_text(), re.M)
        assert not COMMANDS & set(imports), module.name


def test_the_algorithm_path_reads_in_one_sitting():
    counts = {name: code_lines((ROOT / f"{name}.py").read_text()) for name in ALGORITHM_PATH}
    assert sum(counts.values()) <= ALGORITHM_PATH_MAX_LINES, counts


def test_each_top_level_module_reads_as_its_concept_in_450_lines():
    """The machinery a concept or a command stands on (the tool's backends, the reward's process pool, the
    tokenizer's side of the protocol; SFT's and the evaluation's configs, ranks and output folders) lives in
    plumbing/, so each top-level module, concept or command, stays short enough to read whole."""
    lengths = {p.stem: len(p.read_text().splitlines()) for p in sorted(ROOT.glob("*.py"))}
    assert set(lengths) == CONCEPTS | COMMANDS
    assert max(lengths.values()) <= 450, lengths
