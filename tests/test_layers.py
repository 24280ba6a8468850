"""The package's shape: imports point down the layers only (lazy imports included), no module
outgrows one concern (600 lines), and exactly one module of models/ sequences a decoder layer.
Reads the source; no GPU."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "webgpu_engine"

# lowest first; a module may import its own layer and those before it
LAYERS = [("errors", "config", "protocol", "cache", "loaders", "gpu"), ("kernels",), ("models",), ("pipelines",),
          ("engine",), ("server", "cli", "browser", "ray")]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
MAX_LINES = 600


def _modules():
    for f in sorted(PKG.rglob("*.py")):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        yield f, parts[:-1] if parts[-1] == "__init__" else parts, f.name == "__init__.py"


def _layer(parts) -> str | None:
    if len(parts) < 2:
        return None                              # the package root (__init__, __main__)
    return parts[1] if parts[1] in RANK else None


def _imports(f: Path, parts, is_pkg: bool):
    """(line, imported name parts) of every import in f, lazy ones included: `from .x import name`
    gives x's parts + [name] (name may be a submodule, a function, a class...)."""
    pkg = list(parts) if is_pkg else list(parts[:-1])
    for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - (node.level - 1)]
                target = base + (node.module.split(".") if node.module else [])
            else:
                target = (node.module or "").split(".")
            for a in node.names:
                yield node.lineno, target + [a.name]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name.split(".")


def test_imports_point_down_the_layers():
    bad = []
    for f, parts, is_pkg in _modules():
        me = _layer(parts)
        if me is None:
            continue
        for line, target in _imports(f, parts, is_pkg):
            if target[0] != "webgpu_engine":
                continue
            other = _layer(target)
            if other is not None and RANK[other] > RANK[me]:
                bad.append(f"{f.relative_to(PKG.parent)}:{line} ({me}) imports {'.'.join(target)} ({other})")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def _import_graph() -> dict:
    """{module: {module it imports: first line}} among the package's modules. An imported name counts
    as its longest prefix that is a module: a package's __init__ is the package's module, and
    `from .x import name` imports the submodule x.name where there is one, else x."""
    modules = {tuple(parts): (f, is_pkg) for f, parts, is_pkg in _modules()}
    graph = {}
    for me, (f, is_pkg) in modules.items():
        edges = graph[me] = {}
        for line, target in _imports(f, me, is_pkg):
            t = tuple(target)
            while t and t not in modules:
                t = t[:-1]
            if t and t != me:
                edges.setdefault(t, line)
    return graph


def _cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each as a list of modules."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on_stack.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    """No two modules import each other, directly or round a longer circle (lazy imports and
    TYPE_CHECKING ones count: a circle means the shared piece lives in the wrong module)."""
    graph = _import_graph()
    found = []
    for comp in _cycles(graph):
        inside = set(comp)
        found.append("cycle of " + ", ".join(".".join(m) for m in comp) + ":\n" + "\n".join(
            f"    {'.'.join(m)} (line {line}) imports {'.'.join(t)}"
            for m in comp for t, line in sorted(graph[m].items()) if t in inside))
    assert not found, "import cycles:\n" + "\n".join(found)


def test_no_module_outgrows_one_concern():
    long = [f"{f.relative_to(PKG.parent)}: {n} lines" for f, _, _ in _modules()
            if (n := len(f.read_text(encoding="utf-8").splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines:\n" + "\n".join(long)


def test_one_module_sequences_a_decoder_layer():
    """The layer recipe (qkv, attention, o, gate/up, down) is written once: only models/decoder.py
    names the layer weights' matmuls."""
    writers = []
    for f in sorted((PKG / "models").glob("*.py")):
        src = f.read_text(encoding="utf-8")
        if all(s in src for s in ("L.qkv", "L.o", "L.gate_up", "L.down")):
            writers.append(f.name)
    assert writers == ["decoder.py"]


def test_every_package_is_in_the_distribution():
    """pyproject.toml lists every package of the tree (a subpackage left out is missing from the wheel
    the page installs, and from any non-editable install)."""
    import tomllib
    listed = set(tomllib.loads((PKG.parent / "pyproject.toml").read_text(encoding="utf-8"))
                 ["tool"]["setuptools"]["packages"])
    tree = {".".join(p.parent.relative_to(PKG.parent).parts) for p in PKG.rglob("__init__.py")}
    assert tree <= listed, f"packages missing from pyproject.toml: {sorted(tree - listed)}"


def _class_table() -> dict:
    """name -> [(module file, ClassDef)] of every class in the package."""
    out: dict = {}
    for f, _, _ in _modules():
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append((f, node))
    return out


def _own_names(node: ast.ClassDef) -> tuple[set, set]:
    """(names the class defines or declares: methods, class attributes, annotations and self.X
    assignments; names its methods read as self.X / cls.X)."""
    defined, read = set(), set()
    for st in node.body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(st.name)
        elif isinstance(st, ast.Assign):
            defined |= {t.id for t in st.targets if isinstance(t, ast.Name)}
        elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
            defined.add(st.target.id)
    for fn in (st for st in node.body if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef))):
        if any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list):
            continue
        me = fn.args.args[0].arg if fn.args.args else None
        for sub in ast.walk(fn):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == me:
                (defined if isinstance(sub.ctx, ast.Store) else read).add(sub.attr)
    return defined, read


def test_no_class_reads_what_another_defines():
    """Parts, not mixins: every attribute a class's methods read on self is defined or declared (an
    annotation, a method) by the class or its bases. A base that reads what its subclass sets up is a
    mixin standing in for a part with its own state (abstract hooks are declared in the base)."""
    table = _class_table()

    def defined(name: str, seen: tuple = ()) -> set | None:    # None: a base outside the package
        if len(table.get(name, ())) != 1 or name in seen:
            return None
        node = table[name][0][1]
        names = _own_names(node)[0]
        for b in node.bases:
            b = b.id if isinstance(b, ast.Name) else getattr(b, "attr", None)
            if b in ("object", "Generic"):
                continue
            more = defined(b, seen + (name,))
            if more is None:
                return None
            names |= more
        return names

    bad = []
    for name, found in sorted(table.items()):
        names = defined(name)
        if names is None:
            continue
        f, node = found[0]
        missing = _own_names(node)[1] - names - {"__class__", "__dict__"}
        if missing:
            bad.append(f"{f.relative_to(PKG.parent)}:{node.lineno} {name} reads {sorted(missing)}")
    assert not bad, "classes reading attributes they neither define nor declare:\n" + "\n".join(bad)
