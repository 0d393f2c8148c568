"""The parts depend on each other one way: every product import points down the declared order.

The modules are the ones the wheel installs (pyproject's `packages` and `package-dir`); every import
in them counts, including those inside functions and `importlib.import_module("m3_agent....")`.
Within a part too, no two modules import each other, however indirectly (imports under
`TYPE_CHECKING` aside).
"""

from __future__ import annotations

import ast
import graphlib
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The parts, lowest first. A module may import its own part and the parts of lower layers; never a
# part of its own layer or a higher one, so there can be no cycle between parts.
LAYERS: list[tuple[str, ...]] = [
    ("m3_agent.errors", "m3_agent.redact"),  # exceptions and exit codes; how a secret may be shown
    ("m3_agent.hostgit",),  # host-side git (GitPython), for fix and evals
    ("m3_agent.sandbox",),  # Docker: images, containers, exec
    ("m3_agent.tools",),  # each tool runs against a sandbox
    ("m3_agent.agent",),  # the loop: model <-> tools <-> sandbox, the repository context, the endpoint client
    # the layered config (the parts' own config models, from files, env and flags); launching, planning
    # and benchmarking M3 servers. Neither needs the other.
    ("m3_agent.settings", "m3_agent.serving"),
    ("m3_agent.standin",),  # the scripted test double and its simulators (its KV model asks the planner)
    # the ways to run the agent, and the commands `pack`, `env` and `config` (they read settings)
    ("m3_agent.fix", "m3_agent.evals", "m3_agent.pack_cli", "m3_agent.env_cli", "m3_agent.config_cli"),
    ("m3_agent.cli", "m3_agent.api", "m3_agent"),  # the command and the library API over all of it
]
RANK = {part: rank for rank, layer in enumerate(LAYERS) for part in layer}
PARTS_OUTSIDE_THE_ROOT = ("agent", "tools", "sandbox", "evals", "fix", "serving", "standin")
# Old names kept for one release: each re-exports, from where it moved, what a higher part now holds.
DEPRECATED_SHIMS = {"m3_agent.serving.standin": "m3_agent.standin.server"}


def product_modules() -> dict[str, Path]:
    """Dotted name -> file of every module the wheel installs."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = config["package-dir"]
    modules = {}
    for package in config["packages"]:
        base = max((name for name in folders if package == name or package.startswith(name + ".")), key=len)
        folder = ROOT / folders[base] / Path(*package[len(base):].split(".")[1:])
        for file in sorted(folder.glob("*.py")):
            modules[package if file.stem == "__init__" else f"{package}.{file.stem}"] = file
    return modules


def imports(module: str, file: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in `file`, wherever it is in the code."""
    package = module if file.stem == "__init__" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            # `from m3_agent import errors` imports the module m3_agent.errors.
            names = [f"{base}.{alias.name}" for alias in node.names] if base == "m3_agent" else [base]
            found += [(name, node.lineno) for name in names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            name = _leading_text(node.args[0]) if node.args else ""
            if name:
                found.append((name.rstrip("."), node.lineno))
    return found


def _leading_text(arg: ast.expr) -> str:
    """The constant start of a string or f-string argument: enough to tell which part it names."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value)
    return ""


def part_of(module: str) -> str | None:
    """The declared part a module belongs to (its longest declared prefix); None when undeclared.

    The root package `m3_agent` is only its own __init__: a new module beside errors.py must be declared.
    """
    candidates = [part for part in RANK if module == part or (part != "m3_agent" and module.startswith(part + "."))]
    return max(candidates, key=len) if candidates else None


def edges() -> list[tuple[str, str, str]]:
    """(importing part, imported part, where) for every import between two different parts."""
    found = []
    for module, file in product_modules().items():
        source = part_of(module)
        if module in DEPRECATED_SHIMS:
            continue
        for name, line in imports(module, file):
            target = part_of(name)
            if target is not None and target != source:
                found.append((source, target, f"{file.relative_to(ROOT)}:{line} imports {name}"))
    return found


def test_every_product_module_belongs_to_a_declared_part():
    modules = product_modules()
    assert "m3_agent.agent.loop" in modules and "m3_agent.fix.gitwork" in modules  # the walk finds the parts
    assert [m for m in modules if part_of(m) is None] == []


def test_parts_import_only_lower_layers():
    upward = [
        f"{where}: {source} (layer {RANK[source]}) -> {target} (layer {RANK[target]})"
        for source, target, where in edges()
        if RANK[target] >= RANK[source]
    ]
    assert upward == [], "imports against the declared order:\n" + "\n".join(upward)


def test_a_deprecated_shim_imports_nothing_of_the_product_but_what_it_re_exports():
    """The layer check skips the shims: this keeps one from hiding any other import against the order."""
    modules = product_modules()
    for shim, target in DEPRECATED_SHIMS.items():
        assert target in modules
        imported = {name for name, _ in imports(shim, modules[shim]) if part_of(name) is not None}
        assert imported == {target.rpartition(".")[0]}, f"{shim} imports {sorted(imported)}"


def test_the_check_sees_imports_inside_functions_and_lazy_imports():
    seen = {(source, target) for source, target, _ in edges()}
    assert ("m3_agent.cli", "m3_agent.fix") in seen  # cli imports each sub-command inside a function
    assert ("m3_agent.tools", "m3_agent.sandbox") in seen


def test_product_code_imports_the_parts_only_through_m3_agent():
    bare = [
        f"{file.relative_to(ROOT)}:{line} imports {name}"
        for module, file in product_modules().items()
        for name, line in imports(module, file)
        if name.split(".")[0] in PARTS_OUTSIDE_THE_ROOT
    ]
    assert bare == [], "import through m3_agent. instead:\n" + "\n".join(bare)


MAX_FUNCTION_LINES = 60


def long_functions(source: str, where: str) -> list[str]:
    """`where:line name (N lines)` for each function or method in `source` longer than the limit."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{where}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_module_imports_another_modules_private_name():
    """A name another module needs is public in one module: `from m3_agent.x import _name` is a leak."""
    leaks = []
    for module, file in product_modules().items():
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("m3_agent"):
                leaks += [f"{file.relative_to(ROOT)}:{node.lineno} imports {node.module}.{a.name}"
                          for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert leaks == [], "\n".join(leaks)


MAX_PARAMETERS = 7

def _typer_apps(tree: ast.Module) -> set[str]:
    """Names a module binds to `typer.Typer(...)` at its top level."""
    return {target.id for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func) in ("typer.Typer", "Typer")
            for target in node.targets if isinstance(target, ast.Name)}


def _is_typer_command(node: ast.FunctionDef | ast.AsyncFunctionDef, apps: set[str]) -> bool:
    """Decorated `@app.command(...)` or `@app.callback(...)`, where `app` is one of the module's typer apps."""
    return any(isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr in ("command", "callback")
               and isinstance(d.func.value, ast.Name) and d.func.value.id in apps for d in node.decorator_list)


def _functions(body: list[ast.stmt], prefix: str = "", in_class: bool = False):
    """(qualified name, function, is a method) for every function and method, nested ones included."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            static = any(ast.unparse(d) == "staticmethod" for d in node.decorator_list)
            yield prefix + node.name, node, in_class and not static
            yield from _functions(node.body, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node.body, f"{prefix}{node.name}.", in_class=True)
        else:
            for child in ast.iter_child_nodes(node):  # functions inside if/try/with blocks
                if isinstance(child, ast.stmt):
                    yield from _functions([child], prefix, in_class)


def parameter_counts(source: str, where: str) -> dict[str, int]:
    """`where:qualified.name` -> parameters of each function in `source` over the limit that is not a typer command.

    Counted: positional and keyword-only parameters; not a method's self or cls, not *args or **kwargs.
    """
    tree = ast.parse(source)
    apps = _typer_apps(tree)
    found = {}
    for name, node, is_method in _functions(tree.body):
        a = node.args
        n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - (1 if is_method and (a.posonlyargs or a.args) else 0)
        if n > MAX_PARAMETERS and not _is_typer_command(node, apps):
            found[f"{where}:{name}"] = n
    return found


def test_no_product_function_is_longer_than_sixty_lines():
    """Short functions keep the flow readable (the stall rules and relevance signals are the model)."""
    too_long = [hit for name, file in product_modules().items()
                for hit in long_functions(file.read_text(), str(file.relative_to(ROOT)))]
    assert too_long == []


def test_the_length_check_counts_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def short():\n    return 1\n\ndef long():\n{body}\n", "m.py") == [
        f"m.py:4 long ({MAX_FUNCTION_LINES + 1} lines)"]


def test_no_product_function_takes_more_than_seven_parameters():
    """Seven parameters is the most a reader holds; values that travel together become one typed object.

    Exempt: typer command functions (decorated `@app.command(...)` or `@app.callback(...)` of a typer
    app). Typer builds the command line from their signature, one parameter per flag, so their length
    is the command's interface; each hands its values to a library function that keeps to the limit.
    """
    over = {}
    for _, file in product_modules().items():
        over.update(parameter_counts(file.read_text(), str(file.relative_to(ROOT))))
    assert sorted(f"{name} ({n} parameters)" for name, n in over.items()) == []


def test_the_parameter_check_counts_what_a_caller_passes():
    source = """
import typer
app = typer.Typer()
other = object()

def eight(a, b, c, d, e, f, g, *, h): ...
def seven_and_the_rest(a, b, c, d, e, f, g, *args, **kwargs): ...

class C:
    def method(self, a, b, c, d, e, f, g): ...
    @classmethod
    def build(cls, a, b, c, d, e, f, g): ...
    @staticmethod
    def static(a, b, c, d, e, f, g, h): ...

def outer():
    def inner(a, b, c, d, e, f, g, h): ...

@app.command("run")
def run_command(a, b, c, d, e, f, g, h): ...

@app.callback()
def root(a, b, c, d, e, f, g, h): ...

@other.command("x")
def not_typer(a, b, c, d, e, f, g, h): ...
"""
    assert parameter_counts(source, "m.py") == {"m.py:eight": 8, "m.py:C.static": 8, "m.py:outer.inner": 8,
                                                "m.py:not_typer": 8}


def test_the_four_questions_name_functions_that_exist():
    """docs/ARCHITECTURE.md answers a newcomer's questions with `file`: `function`: each must be there."""
    table = (ROOT / "docs" / "ARCHITECTURE.md").read_text().split("## A newcomer's four questions")[1].split("\n## ")[0]
    named = re.findall(r"`([\w/]+\.py)`: `([\w.]+)`", table)
    assert len(named) >= 4
    missing = []
    for path, name in named:
        tree = ast.parse((ROOT / path).read_text())
        defined = {f"{c.name}.{f.name}" for c in tree.body if isinstance(c, ast.ClassDef) for f in c.body
                   if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
        defined |= {f.name for f in tree.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
        missing += [f"{path}: {name}"] if name not in defined else []
    assert missing == []


def module_imports(module: str, file: Path, modules: set[str]) -> set[str]:
    """The product modules `module` imports, anywhere in its code but under `if TYPE_CHECKING:`;
    `from pkg import mod` is an import of `pkg.mod`, `from pkg import name` one of `pkg`."""
    package = module if file.stem == "__init__" else module.rpartition(".")[0]
    tree = ast.parse(file.read_text(), str(file))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return found & modules - {module}


def test_no_import_circle_between_product_modules():
    modules = product_modules()
    graph = {module: module_imports(module, file, set(modules)) for module, file in modules.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        pytest.fail("import circle: " + " -> ".join(e.args[1]))


def test_the_circle_check_sees_a_function_level_import_and_skips_type_checking_ones(tmp_path):
    file = tmp_path / "a.py"
    file.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from m3_agent.fix import flow\n"
                    "def f():\n    from m3_agent.agent import model\n    from m3_agent.errors import UsageError\n")
    modules = {"m3_agent.x.a", "m3_agent.fix.flow", "m3_agent.agent.model", "m3_agent.errors"}
    assert module_imports("m3_agent.x.a", file, modules) == {"m3_agent.agent.model", "m3_agent.errors"}
