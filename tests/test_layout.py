"""Layout: the engine imports neither Dagster nor Spark, no module imports a layer above its own, no import cycle;
the Dagster definitions load."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import dagster as dg

# Dagster rooms inside the package; every other module of it is engine (found by walking the package, so a new
# module is checked without being listed). assets/ and resources/ join it through outbox_pipeline/'s symbolic links.
DAGSTER_ROOMS = (
    "outbox_pipeline.orchestration",
    "outbox_pipeline.definitions",
    "outbox_pipeline.assets",
    "outbox_pipeline.resources",
)


def _engine_modules() -> list[str]:
    import outbox_pipeline

    found = ["outbox_pipeline"]
    for info in pkgutil.walk_packages(outbox_pipeline.__path__, "outbox_pipeline."):
        if not info.name.startswith(DAGSTER_ROOMS):
            found.append(info.name)
    return found


ENGINE_MODULES = _engine_modules()


def test_the_engine_is_every_module_outside_the_dagster_rooms() -> None:
    assert {
        "outbox_pipeline.relay.loop",
        "outbox_pipeline.strategies.positions.offsets",
        "outbox_pipeline.bench.writers",
    } <= set(ENGINE_MODULES)
    assert not [m for m in ENGINE_MODULES if m.startswith(DAGSTER_ROOMS)]


def test_engine_modules_import_neither_dagster_nor_spark() -> None:
    code = (
        "import importlib, sys\n"
        f"for m in {ENGINE_MODULES!r}: importlib.import_module(m)\n"
        "leaked = sorted(m for m in sys.modules if m.split('.')[0] in ('dagster', 'pyspark', 'dagster_pyspark'))\n"
        "print(','.join(leaked))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def module_imports(package: Path, name: str = "outbox_pipeline") -> dict[str, set[str]]:
    """Each module of ``package`` -> the package's modules it imports at module level, ``if TYPE_CHECKING:`` blocks
    included (a cycle there is one in the design too); imports inside functions are deliberate and left out."""
    graph: dict[str, set[str | tuple[str, str]]] = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        here = module if is_package else module.rpartition(".")[0]
        targets: set[str | tuple[str, str]] = set()
        body = ast.parse(path.read_text()).body
        for node in [*body, *(n for stmt in body if isinstance(stmt, ast.If) for n in stmt.body)]:
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = here.rsplit(".", node.level - 1)[0] if node.level else ""
                source = ".".join(p for p in (base, node.module or "") if p)
                targets |= {(source, f"{source}.{alias.name}") for alias in node.names}  # a module, or a name of one
        graph[module] = targets
    modules = set(graph)
    return {
        m: {t for t in (_imported(t, modules) for t in targets) if t in modules and t != m}
        for m, targets in graph.items()
    }


def _imported(target: str | tuple[str, str], modules: set[str]) -> str:
    """``from a import b``: module ``a.b`` where it is one, else module ``a`` (which defines ``b``)."""
    if isinstance(target, str):
        return target
    source, submodule = target
    return submodule if submodule in modules else source


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` (empty: none), found by a depth-first walk."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[module] = "done"
        path.pop()
        return []

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return []


def test_the_packages_modules_import_one_another_without_a_cycle() -> None:
    """A cycle is a layer that imports a higher one: e.g. the write path's message checks and the migrations that
    create the table's checks, each needing the other's rules (the rules now live below both)."""
    graph = module_imports(Path(__file__).resolve().parents[1] / "outbox_pipeline")

    assert "outbox_pipeline.store.record_size" in graph["outbox_pipeline.store.messages"]  # the graph is read
    assert import_cycle(graph) == []


# The package's layers, lowest first (docs/architecture.md says what each is for, a section each, in this order): a
# module may import its own layer and those below. The package's __init__ is the public API and re-exports from
# store, so it is left out.
LAYERS = ("", "store", "strategies", "observe", "relay", "operate", "drain", "runs", "commands", "dagster")
COMMAND_ROOMS = ("cli", "bench", "verify", "localstack")


def layer_of(module: str) -> int:
    room = module.split(".")[1] if module.count(".") else ""
    if room in ("orchestration", "definitions"):
        return LAYERS.index("dagster")
    if room in COMMAND_ROOMS:
        return LAYERS.index("commands")
    return LAYERS.index(room) if room in LAYERS else 0  # a top-level module: config, settings, errors, ...


def imports_up(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module != "outbox_pipeline"
        for target in targets
        if layer_of(target) > layer_of(module)
    )


def test_no_module_imports_a_layer_above_its_own() -> None:
    graph = module_imports(Path(__file__).resolve().parents[1] / "outbox_pipeline")

    assert {layer_of(m) for m in graph} == set(range(len(LAYERS)))  # every layer is found: the rule is applied
    assert imports_up(graph) == []


def test_an_import_from_a_lower_layer_to_a_higher_one_is_named() -> None:
    graph = {"outbox_pipeline.store.enqueue": {"outbox_pipeline.relay.publisher", "outbox_pipeline.config"}}

    assert imports_up(graph) == ["outbox_pipeline.store.enqueue -> outbox_pipeline.relay.publisher"]


ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# The Dagster rooms at the repository's top, described in the dagster layer's section.
TOP_ROOMS = ("assets", "resources")


def layer_sections(doc: str) -> dict[str, str]:
    """The doc's "## Layers" cut at its ``### `` headings: a layer's name -> its section, in the doc's order."""
    layers = doc.split("\n## Layers\n", 1)[-1].split("\n## ", 1)[0]
    sections = {}
    for chunk in layers.split("\n### ")[1:]:
        heading, _, body = chunk.partition("\n")
        sections[heading.strip()] = body
    return sections


def heading_of(layer: str) -> str:
    return layer or "top level"


def documented_modules(root: Path) -> dict[str, str]:
    """Each module's path as the doc names it (from the repository's top, ``outbox_pipeline/`` left out) -> the
    heading of the section that must name it."""
    found = {}
    for path in sorted((root / "outbox_pipeline").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[path.relative_to(root / "outbox_pipeline").as_posix()] = heading_of(LAYERS[layer_of(module)])
    for room in TOP_ROOMS:
        for path in sorted((root / room).rglob("*.py")):
            found[path.relative_to(root).as_posix()] = heading_of("dagster")
    return found


def undocumented(doc: str, modules: dict[str, str]) -> list[str]:
    """The modules the doc does not name, in backticks, in their own layer's section."""
    sections = layer_sections(doc)
    return sorted(
        f"{path} (under ### {heading})"
        for path, heading in modules.items()
        if f"`{path}`" not in sections.get(heading, "")
    )


def test_docs_architecture_describes_the_layers_in_their_order() -> None:
    assert list(layer_sections(ARCHITECTURE.read_text())) == [heading_of(layer) for layer in LAYERS]


def test_docs_architecture_names_every_module_in_its_own_layer() -> None:
    modules = documented_modules(ROOT)

    assert {"relay/loop.py", "model.py", "strategies/positions/offsets.py", "assets/spark/drain_job.py"} <= set(modules)
    assert modules["definitions.py"] == modules["resources/kafka.py"] == "dagster"
    assert undocumented(ARCHITECTURE.read_text(), modules) == []


def test_each_layer_exports_the_names_its_all_declares() -> None:
    """Layers re-export what the others use (some on first use, PEP 562): a renamed name must not leave a stale one."""
    import outbox_pipeline

    packages = [info.name for info in pkgutil.walk_packages(outbox_pipeline.__path__, "outbox_pipeline.") if info.ispkg]
    layers = [importlib.import_module(name) for name in ["outbox_pipeline", *packages]]
    exported = {layer.__name__: layer.__all__ for layer in layers if hasattr(layer, "__all__")}

    expected = {"outbox_pipeline.store", "outbox_pipeline.relay", "outbox_pipeline.bench", "outbox_pipeline.resources"}
    assert expected <= set(exported)
    stale = {name: [n for n in names if not hasattr(sys.modules[name], n)] for name, names in exported.items()}
    assert {name: names for name, names in stale.items() if names} == {}


def test_a_module_missing_from_its_layers_section_is_named() -> None:
    doc = "# A\n\n## Layers\n\n### store\n\n- `store/schema.py`: ...\n\n### relay\n\n- `store/enqueue.py`\n\n## Words\n"
    modules = {"store/schema.py": "store", "store/enqueue.py": "store", "relay/loop.py": "relay"}

    assert list(layer_sections(doc)) == ["store", "relay"]
    assert undocumented(doc, modules) == ["relay/loop.py (under ### relay)", "store/enqueue.py (under ### store)"]


# What a reader holds in mind at once: a function of at most this many lines, and blocks nested at most this deep (an
# ``elif`` is not deeper than its ``if``). Modules are cut by concept, not by size.
MAX_FUNCTION_LINES = 60
MAX_FUNCTION_DEPTH = 4
# The functions allowed past it, each with its reason (none today).
LONG_FUNCTIONS: set[str] = set()
_NESTING = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.Match)


def nesting(node: ast.AST, depth: int = 0) -> int:
    """How deep blocks nest inside ``node`` (nested functions and classes are measured on their own)."""
    elif_ = node.orelse[0] if isinstance(node, ast.If) and len(node.orelse) == 1 else None
    deepest = depth
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        deeper = isinstance(child, _NESTING) and not (child is elif_ and isinstance(child, ast.If))
        deepest = max(deepest, nesting(child, depth + deeper))
    return deepest


def long_or_deep_functions(root: Path, folders: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """``path:function`` -> (lines, depth) for every function past MAX_FUNCTION_LINES or MAX_FUNCTION_DEPTH."""
    found: dict[str, tuple[int, int]] = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines, depth = (node.end_lineno or node.lineno) - node.lineno + 1, nesting(node)
                    if lines > MAX_FUNCTION_LINES or depth > MAX_FUNCTION_DEPTH:
                        found[f"{path.relative_to(root).as_posix()}:{node.name}"] = (lines, depth)
    return found


def test_functions_are_short_and_shallow_but_the_named_few() -> None:
    found = long_or_deep_functions(Path(__file__).resolve().parents[1], ("outbox_pipeline", "assets", "resources"))

    assert {name: size for name, size in found.items() if name not in LONG_FUNCTIONS} == {}
    assert sorted(LONG_FUNCTIONS - set(found)) == []  # an exception no longer needed is dropped from the list


def test_an_elif_chain_is_as_deep_as_its_if_and_a_nested_loop_is_deeper() -> None:
    chain = ast.parse("def f(x):\n    if x:\n        pass\n    elif x:\n        pass\n    elif x:\n        pass\n")
    loops = ast.parse("def f(x):\n    for a in x:\n        for b in a:\n            if b:\n                pass\n")

    assert nesting(chain.body[0]) == 1
    assert nesting(loops.body[0]) == 3


def test_dagster_definitions_load() -> None:
    from outbox_pipeline.definitions import defs

    dg.Definitions.validate_loadable(defs)


def test_spark_executors_import_the_data_sources_without_dagster() -> None:
    code = (
        "import sys, outbox_pipeline.assets.spark.datasource, outbox_pipeline.assets.spark.drain_job\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] == 'dagster')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_asset_package_exports_are_definitions_even_after_their_modules_were_imported() -> None:
    import outbox_pipeline.assets.spark.bulk_drain_asset  # noqa: F401 - a submodule import must not shadow the export
    from outbox_pipeline.assets.spark import bulk_drain, spark_assets

    assert isinstance(bulk_drain, dg.AssetsDefinition)
    assert all(isinstance(a, dg.AssetsDefinition) for a in spark_assets)


def test_the_dagster_rooms_install_inside_the_package_from_the_repositorys_top() -> None:
    """Top-level ``assets`` and ``resources`` packages would collide with other distributions' (docs/architecture.md,
    Packaging): the project installs ``outbox_pipeline`` alone, and its rooms are the repository's folders."""
    root = Path(__file__).resolve().parents[1]

    assert (metadata.distribution("outbox-pipeline").read_text("top_level.txt") or "").split() == ["outbox_pipeline"]
    for room in ("assets", "resources"):
        spec = importlib.util.find_spec(f"outbox_pipeline.{room}")
        assert spec is not None and spec.origin is not None
        assert Path(spec.origin).resolve() == root / room / "__init__.py"
