"""The package's import graph: no module imports another in a circle (at module level or inside a
function, where a circle hides until the function runs), and no module imports another module's
private (_underscored) names. Read from the source with ast, so it holds for code paths no other
test happens to import."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "kbench"
EXTENSIONS = {"kbench._C", "kbench._fast"}   # the compiled modules: private by name, public by design


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def is_package(name: str) -> bool:
    return MODULES.get(name, pathlib.Path()).name == "__init__.py"


def resolve(current: str, level: int, target: str | None) -> str:
    """The absolute name of a relative import's base."""
    if level == 0:
        return target or ""
    base = current.split(".")
    if not is_package(current):
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(name: str):
    """(imported kbench module, imported names or None, line) for every import statement in the
    module, wherever it stands."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kbench":
                    yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = resolve(name, node.level, node.module)
            if base.split(".")[0] != "kbench":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in MODULES or sub in EXTENSIONS:
                    yield sub, None, node.lineno       # from package import module
                else:
                    yield base, alias.name, node.lineno


def graph():
    edges = {}
    for name in MODULES:
        edges[name] = {target for target, _, _ in imports_of(name) if target in MODULES and target != name}
    return edges


def find_cycle(edges):
    """One import circle as a list of modules, or None (iterative depth-first search)."""
    color, parent = {}, {}
    for start in sorted(edges):
        if start in color:
            continue
        stack = [(start, iter(sorted(edges[start])))]
        color[start] = "grey"
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                color[node] = "black"
                stack.pop()
                continue
            if color.get(nxt) == "grey":
                cycle = [nxt]
                for frame, _ in reversed(stack):
                    cycle.append(frame)
                    if frame == nxt:
                        break
                return cycle[::-1]
            if nxt not in color:
                color[nxt] = "grey"
                parent[nxt] = node
                stack.append((nxt, iter(sorted(edges[nxt]))))
    return None


def test_the_package_is_found():
    assert {"kbench", "kbench.api", "kbench.capture.export", "kbench.runtime.module", "kbench.tune.search",
            "kbench.verify"} <= set(MODULES)


def test_no_import_circles():
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_circle_finder_finds_circles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_every_kbench_import_names_a_module_that_exists():
    """An import inside a function is checked only when it runs: a moved module must not leave
    one behind that names it at its old place."""
    bad = [f"{name}:{line} imports {target}" for name in MODULES for target, _, line in imports_of(name)
           if target not in MODULES and target not in EXTENSIONS]
    assert not bad, "\n".join(bad)


def test_no_private_names_imported_across_modules():
    bad = []
    for name in MODULES:
        for target, imported, line in imports_of(name):
            if imported is None:
                leaf = target.rsplit(".", 1)[-1]
                if leaf.startswith("_") and not leaf.startswith("__") and target not in EXTENSIONS:
                    bad.append(f"{name}:{line} imports module {target}")
            elif imported.startswith("_") and not imported.startswith("__") and target != name:
                bad.append(f"{name}:{line} imports {target}.{imported}")
    assert not bad, "\n".join(bad)
