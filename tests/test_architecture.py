"""The layout's rules, checked on the source: no import cycle, Beam only in its layer, the layers
import downwards only, and no function longer than 100 lines."""

from __future__ import annotations

import ast
import io
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the import name it installs as (pyproject's package-dir)
PACKAGES = {"elmo_pipeline": "elmo_pipeline", "transforms": "elmo_pipeline.transforms",
            "pipelines": "elmo_pipeline.pipelines"}
BEAM_LAYER = ("elmo_pipeline.transforms", "elmo_pipeline.pipelines")
MAX_FUNCTION_LINES = 100


def _modules() -> dict[str, Path]:
    found = {}
    for folder, name in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


class Import:
    def __init__(self, target: str, line: int, in_function: bool) -> None:
        self.target, self.line, self.in_function = target, line, in_function


def _imports(path: Path) -> list[Import]:
    """Every import in the file, lazy ones inside functions included (they hid today's cycle),
    `if TYPE_CHECKING:` blocks excluded (they never run)."""
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.extend(Import(a.name, child.lineno, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                for a in child.names:  # `from package import module` depends on the module
                    full = f"{child.module}.{a.name}"
                    found.append(Import(full if full in MODULES else child.module, child.lineno, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text()), False)
    return found


GRAPH = {m: [i for i in _imports(p) if i.target != m] for m, p in MODULES.items()}


def _part(module: str) -> str:
    """The architecture part a module belongs to: `elmo_pipeline.model.lstm` -> `model`,
    `elmo_pipeline.transforms.embed` -> `transforms`, root modules -> their own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "elmo_pipeline"


def test_the_scan_sees_the_package():
    assert {"elmo_pipeline.model.bilm", "elmo_pipeline.formats.native", "elmo_pipeline.transforms.embed",
            "elmo_pipeline.pipelines.extract", "elmo_pipeline.cli.main"} <= set(MODULES)
    assert any(i.target == "elmo_pipeline.formats.pretrained" for i in GRAPH["elmo_pipeline.model.bilm"])


def test_no_import_cycle_between_modules():
    edges = {m: {i.target for i in imports if i.target in MODULES} for m, imports in GRAPH.items()}
    # Tarjan's strongly connected components; any component of two or more modules is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for d in edges[m]:
            if d not in index:
                connect(d)
                low[m] = min(low[m], low[d])
            elif d in stack:
                low[m] = min(low[m], index[d])
        if low[m] == index[m]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == m:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in sorted(edges):
        if m not in index:
            connect(m)
    assert cycles == []


def test_beam_is_imported_only_by_transforms_and_pipelines():
    offenders = [f"{m}:{i.line}" for m, imports in GRAPH.items() for i in imports
                 if i.target.split(".")[0] == "apache_beam" and not m.startswith(BEAM_LAYER)]
    assert offenders == []


def test_the_library_reaches_the_beam_layer_only_from_the_cli_and_only_lazily():
    """The CLI is the one library part that launches pipelines; it imports them inside the
    command's function, so `elmo-pipeline --help` and `import elmo_pipeline` stay Beam-free."""
    offenders = []
    for m, imports in GRAPH.items():
        if m.startswith(BEAM_LAYER):
            continue
        for i in imports:
            if i.target.startswith(BEAM_LAYER) and (_part(m) != "cli" or not i.in_function):
                offenders.append(f"{m}:{i.line} imports {i.target}")
    assert offenders == []


# part -> the parts it may import besides itself and the root helpers; anything else is an
# upward or sideways reach. The root helpers (strict JSON, runtime, progress, how a command
# ends, file systems) import no part.
ALLOWED = {
    "elmo_pipeline": {"model"},  # the package's __init__: the public API
    "model": {"formats"},  # only bilm.py, only the Pretrained entry points (checked below)
    "formats": {"model"},  # only model.config and model.vocabulary (checked below)
    "corpus": set(),
    "embedding": {"corpus", "formats", "model"},
    "training": {"corpus", "formats", "model"},
    "downstream": {"corpus", "model", "embedding"},
    "feast": {"corpus"},
    "transforms": {"corpus", "embedding", "model", "formats", "downstream"},
    "pipelines": {"transforms", "corpus", "embedding", "model", "formats", "training", "downstream"},
    "cli": {"pipelines", "corpus", "embedding", "model", "formats", "training", "downstream", "feast"},
}
ROOT_HELPERS = {"strict", "runtime", "runtime_choices", "progress", "commands", "filesystems", "exports"}


def test_each_part_imports_only_the_parts_below_it():
    offenders = []
    for m, imports in GRAPH.items():
        part = _part(m)
        for i in imports:
            if i.target not in MODULES or _part(i.target) == part or i.target == "elmo_pipeline":
                continue  # every module imports its own part and the package (its version)
            used = _part(i.target)
            # a root helper may use another (runtime reads its choices), never a part
            allowed = ROOT_HELPERS if part in ROOT_HELPERS else ALLOWED[part] | ROOT_HELPERS
            if used not in allowed:
                offenders.append(f"{m}:{i.line} ({part}) imports {i.target} ({used})")
    assert offenders == []


def test_model_and_formats_meet_only_at_the_pretrained_entry_points():
    model_to_formats = sorted({(m, i.target) for m, imports in GRAPH.items() if _part(m) == "model"
                               for i in imports if _part(i.target) == "formats"})
    assert model_to_formats == [("elmo_pipeline.model.bilm", "elmo_pipeline.formats.pretrained")]
    formats_to_model = {i.target for m, imports in GRAPH.items() if _part(m) == "formats"
                        for i in imports if _part(i.target) == "model"}
    assert formats_to_model <= {"elmo_pipeline.model.config", "elmo_pipeline.model.vocabulary"}


def _python_prints(code: str) -> list[str]:
    """The lines a fresh interpreter prints running `code` (a test's own process has torch loaded)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, (code, out.stderr[-2000:])
    return out.stdout.splitlines()


def test_importing_the_library_and_its_cli_loads_no_beam():
    library = sorted(m for m in MODULES if not m.startswith(BEAM_LAYER))
    code = ("import importlib, sys\n"
            f"for name in {library!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'apache_beam')[:3])\n")
    assert _python_prints(code)[-1] == "[]"


def test_the_commands_help_loads_no_torch_beam_or_spacy():
    """--help was 5.5-7.1 s here under load, 1.0-1.7 s without torch (which the package's
    __init__ imported for BiLM) on the same machine, the same minute."""
    commands = [[], *([name] for name in ("extract", "embed-file", "import-allennlp", "import-formanylangs",
                                           "prepare", "pretrain", "evaluate", "export", "probe", "similarity",
                                           "feast-repo"))]
    code = ("import contextlib, io, sys\n"
            "from elmo_pipeline.cli.main import main\n"
            "import elmo_pipeline, elmo_pipeline.downstream\n"
            f"for command in {commands!r}:\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
            "        main([*command, '--help'])\n"
            "    assert 'usage: ' in out.getvalue(), command\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'apache_beam', 'spacy'}))\n"
            "print(elmo_pipeline.BiLM.__module__, elmo_pipeline.downstream.TrainableMix.__module__)\n")
    # the exports are still there, imported when first used
    assert _python_prints(code)[-2:] == ["[]", "elmo_pipeline.model.bilm elmo_pipeline.downstream.mix"]


def test_the_submodules_the_package_imported_are_still_its_attributes():
    """`import elmo_pipeline` imported elmo_pipeline.model (and formats, runtime, strict, filesystems)
    on its way to BiLM, so `elmo_pipeline.model.scalar_mix.load_mix_specs`, the reader a mix's error
    names, worked after it; once the exports were lazy (d28aeef) it was an AttributeError, and so
    was elmo_pipeline.downstream.mix after `import elmo_pipeline.downstream`."""
    code = ("import sys\n"
            "import elmo_pipeline, elmo_pipeline.downstream\n"
            "print(hasattr(elmo_pipeline, '__wrapped__'), 'torch' in sys.modules)\n"  # a probe loads nothing
            "print(elmo_pipeline.model.scalar_mix.load_mix_specs.__module__, elmo_pipeline.runtime.autocast.__name__,\n"
            "      elmo_pipeline.strict.__name__, elmo_pipeline.formats.__name__, elmo_pipeline.filesystems.__name__)\n"
            "print(elmo_pipeline.downstream.mix.TrainableMix.__name__, elmo_pipeline.downstream.dataset.__name__)\n"
            "print(hasattr(elmo_pipeline, 'no_such_part'), hasattr(elmo_pipeline.downstream, 'a.b'))\n")
    assert _python_prints(code) == [
        "False False",
        "elmo_pipeline.model.scalar_mix autocast elmo_pipeline.strict elmo_pipeline.formats elmo_pipeline.filesystems",
        "TrainableMix elmo_pipeline.downstream.dataset", "False False"]


def _defines_getattr(node: ast.stmt) -> bool:
    if isinstance(node, ast.FunctionDef):
        return node.name == "__getattr__"
    targets = node.targets if isinstance(node, ast.Assign) else []
    names = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
    return any(isinstance(n, ast.Name) and n.id == "__getattr__" for n in names)


def test_the_lazy_exports_are_hidden_from_type_checkers():
    """A module's __getattr__ tells mypy and pyright that it has every name: after d28aeef,
    `elmo_pipeline.BiLn` and `elmo_pipeline.downstream.TrainableMixx` passed mypy, which named both at
    83a31d1. Defined under `if not TYPE_CHECKING`, a checker sees the names the TYPE_CHECKING
    imports give, and Python still runs it (the exports' tests above)."""
    seen, hidden = [], []
    for path in sorted((ROOT / "elmo_pipeline").rglob("__init__.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            name = str(path.relative_to(ROOT))
            seen += [name] if _defines_getattr(node) else []
            if (isinstance(node, ast.If) and isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not)
                    and ast.unparse(node.test.operand) == "TYPE_CHECKING" and any(map(_defines_getattr, node.body))):
                hidden.append(name)
    assert seen == [] and hidden == ["elmo_pipeline/__init__.py", "elmo_pipeline/downstream/__init__.py"]


def _long_functions() -> list[str]:
    found = []
    for folder in (*PACKAGES, "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_longer_than_100_lines():
    assert _long_functions() == []


@pytest.mark.parametrize("source, expected", [
    ("def f():\n" + "    x = 1\n" * 100, ["f (101 lines)"]),
    ("def f():\n" + "    x = 1\n" * 99, []),
])
def test_the_length_rule_counts_lines_as_written(tmp_path, monkeypatch, source, expected):
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "long.py").write_text(source)
    for name in PACKAGES:
        (tmp_path / name).mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [f.split(" ", 1)[1] for f in _long_functions()] == expected


def test_every_import_the_readme_shows_resolves():
    """The README's Python snippets are what users copy: each import line in them must work."""
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```python")[1:]
    lines = sorted({line.strip() for block in blocks for line in block.split("```")[0].splitlines()
                    if line.strip().startswith(("from elmo_pipeline", "import elmo_pipeline"))})
    assert any("from elmo_pipeline import BiLM" in line for line in lines)
    _python_prints("\n".join(lines))


def test_pyflakes_finds_no_undefined_name_or_unused_import():
    """A name used but never imported fails only when its line runs, which for a benchmark or a
    rare error path may be in a user's hands first; pyflakes finds it on the source."""
    from pyflakes.api import checkPath
    from pyflakes.reporter import Reporter

    out, err = io.StringIO(), io.StringIO()
    reporter = Reporter(out, err)
    for folder in (*PACKAGES, "benchmarks", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            checkPath(str(path), reporter)
    assert (out.getvalue() + err.getvalue()).splitlines() == []
