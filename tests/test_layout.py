"""The package's shape: no import cycles between its modules (function-level imports
included, ``if TYPE_CHECKING:`` ones not: they never run); the library's folders depend on
each other one way (:data:`LAYERS`, ``TYPE_CHECKING`` imports counted: a type named is a
dependency too); no module over :data:`MAX_LINES` lines."""

from __future__ import annotations

import ast
from pathlib import Path

import boost_jax

PACKAGE = Path(boost_jax.__file__).parent
#: the issue's bound on a module's length (issue 33): a module says what it holds
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


#: the library's folders that must not import each other both ways
LAYERS = ("models", "parallel", "optim", "checkpointing", "operations", "train", "data",
          "evaluation", "analysis", "compiled", "tools", "bench", "interop", "commands")


def _runtime_imports(tree: ast.AST, type_checking: bool = False):
    """Every import statement of ``tree`` outside ``if TYPE_CHECKING:`` blocks (inside them
    too with ``type_checking``)."""
    for node in ast.iter_child_nodes(tree):
        if (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                and not type_checking):
            yield from _runtime_imports(ast.Module(node.orelse, []))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _runtime_imports(node, type_checking)


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """``module -> the package modules it imports`` (``from a import b`` counts ``a.b`` when
    that is a module, else ``a``); ``type_checking``: the imports under ``if
    TYPE_CHECKING:`` too."""
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text()), type_checking):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative import
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                    + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for target in targets:
                if target.startswith("boost_jax") and (found := owner(target)) not in (
                        None, module):
                    graph[module].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = import_graph()
    assert "boost_jax.config" in graph and graph["boost_jax.train.loop"]  # the graph is read
    found = cycles(graph)
    assert not found, "\n".join(
        " <-> ".join(c) + ": " + "; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c)
        for c in found)


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_over_the_line_bound():
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def folder_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """``(folder, folder) -> the module imports`` between two of :data:`LAYERS`."""
    def folder(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 2 and parts[1] in LAYERS else None

    out: dict[tuple[str, str], list[str]] = {}
    for module, targets in graph.items():
        for target in targets:
            a, b = folder(module), folder(target)
            if a and b and a != b:
                out.setdefault((a, b), []).append(f"{module} -> {target}")
    return out


def test_the_folders_depend_one_way():
    """No two of :data:`LAYERS` import each other, ``TYPE_CHECKING`` imports counted
    (``models`` knows no parallelism: ``parallel`` implements the plan interface of
    ``models/boundaries.py``)."""
    every = import_graph(type_checking=True)
    assert sum(map(len, every.values())) > sum(map(len, import_graph().values()))
    edges = folder_edges(every)
    assert ("parallel", "models") in edges and ("train", "parallel") in edges  # it reads them
    two_way = {tuple(sorted(pair)) for pair in edges if pair[::-1] in edges}
    assert not two_way, "\n".join(
        f"{a} <-> {b}: {edges[(a, b)][:3]} / {edges[(b, a)][:3]}" for a, b in sorted(two_way))



def _importers(library: str) -> set[str]:
    """The package modules that import ``library`` (anywhere in the module)."""
    out = set()
    for module, path in _modules().items():
        for node in _runtime_imports(ast.parse(path.read_text()), type_checking=True):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""])
            if any(n == library or n.startswith(library + ".") for n in names):
                out.add(module)
    return out


def test_only_gin_io_reads_gin():
    """Configuration is read once, at the entry point: the config classes are plain
    dataclasses and ``boost_jax/gin_io.py`` is the one module that imports gin (it registers
    the groups and builds the Config a command passes down), so no library function sees the
    bindings. Seen failing with ``@gin.configurable`` back on ``Model``."""
    assert _importers("gin") == {"boost_jax.gin_io"}


def test_no_frozen_instance_is_changed():
    """No ``object.__setattr__`` in the package: a frozen config is made complete by its
    factory (config_fields.Derived: ``derive`` fills what follows from the given fields)
    before it exists, never changed afterwards (it is an ``lru_cache`` and static-argument
    key). Seen failing with Train's warm-up set in ``__post_init__`` again."""
    found = [f"{module}:{node.lineno}" for module, path in _modules().items()
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "__setattr__"
             and ast.unparse(node.value) == "object"]
    assert not found, found


def _main_block(tree: ast.Module) -> list[ast.stmt] | None:
    """The body of ``tree``'s ``if __name__ == "__main__":``, or None."""
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            return node.body
    return None


def test_every_command_lives_in_commands():
    """Every command is a module of ``boost_jax/commands/``; a documented name elsewhere
    (``python -m boost_jax.train``, ``boost_jax.data.prepare``, ``boost_jax.tools.comm_report``,
    ...) is an alias whose only code runs one of them with ``runpy``. Seen failing with the
    trainer's entry point back in ``train/__main__.py``."""
    commands, aliases = set(), {}
    for module, path in _modules().items():
        tree = ast.parse(path.read_text())
        block = tree.body if path.name == "__main__.py" else _main_block(tree)
        if block is None:
            continue
        if module.startswith("boost_jax.commands."):
            commands.add(module)
            continue
        runs = [ast.literal_eval(n.args[0]) for n in ast.walk(ast.Module(block, []))
                if isinstance(n, ast.Call) and ast.unparse(n.func) == "runpy.run_module"]
        calls = [n for n in ast.walk(ast.Module(block, [])) if isinstance(n, ast.Call)]
        assert len(runs) == len(calls) == 1, f"{module}: its __main__ is more than an alias"
        aliases[module] = runs[0]
    assert set(aliases.values()) <= commands, aliases
    assert {"boost_jax.train.__main__", "boost_jax.data.prepare",
            "boost_jax.tools.comm_report"} <= set(aliases)


#: the modules that change process-wide state (a JAX option, an environment variable, a signal
#: handler, the process's exit), each with why it may: entry points, and the set-up functions
#: only they call
PROCESS_WIDE = {
    "boost_jax.cli": "what every command's entry point shares",
    "boost_jax.commands.eval": "an entry point",
    "boost_jax.commands.gpu_compile": "an entry point",
    "boost_jax.commands.plan": "an entry point",
    "boost_jax.commands.train": "an entry point (its hang watchdog's exit)",
    "boost_jax.bench.memory": "the body of the bench command's memory benchmark",
    "boost_jax.parallel.mesh": "request_host_devices, called by cli.setup_devices only",
    "boost_jax.parallel.distributed": "initialize, called by cli.setup_devices only",
    "boost_jax.operations.signals": "StopRequest, entered by commands/train.py only",
    "boost_jax.data.tokenize_chunks": "the initializer of the tokenizer's own worker processes",
}


def _process_wide(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node) == "os._exit":
            return True  # called, or handed to code that calls it
        if isinstance(node, ast.Call) and ast.unparse(node.func) in (
                "jax.config.update", "signal.signal", "os.environ.setdefault", "os.putenv"):
            return True
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(ast.unparse(t).startswith("os.environ[") for t in targets):
                return True
    return False


def test_process_wide_effects_only_where_listed():
    """Library code changes no process-wide state on its own: ``jax.config.update``,
    environment variables, signal handlers and ``os._exit`` appear only in the modules of
    :data:`PROCESS_WIDE`. Seen failing with the hang watchdog's ``os._exit`` inside the
    training loop's own default (operations/watchdog.py)."""
    found = {module for module, path in _modules().items()
             if _process_wide(ast.parse(path.read_text()))}
    assert found == set(PROCESS_WIDE), (sorted(found - set(PROCESS_WIDE)),
                                        sorted(set(PROCESS_WIDE) - found))


def test_models_and_parallel_read_their_own_config_groups():
    """``models/`` and ``parallel/`` import ``Model`` and ``Parallel`` from their own
    ``config.py``, never the top-level ``boost_jax.config`` (which imports the plans to
    validate a Config): otherwise the model would reach the parallelism through it.
    ``TYPE_CHECKING`` imports counted. Seen failing with models/decoder.py importing
    ``boost_jax.config.Model``."""
    graph = import_graph(type_checking=True)
    through = sorted(m for m, targets in graph.items()
                     if m.split(".")[1:2] in (["models"], ["parallel"])
                     and "boost_jax.config" in targets)
    assert not through, through
