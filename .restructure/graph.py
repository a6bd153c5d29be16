"""Today's import graph of src/zerotune (+ hydra_plugins as sources), all imports (module and function level)."""
import ast, json, os, sys
from pathlib import Path
SRC = Path("/work/main/src")
def modname(p: Path) -> str:
    rel = p.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__": parts = parts[:-1]
    return ".".join(parts)
files = {}
for root, dirs, fs in os.walk(SRC / "zerotune", followlinks=True):
    for f in fs:
        if f.endswith(".py"):
            p = Path(root) / f
            files[modname(p)] = p
for p in (SRC / "hydra_plugins").rglob("*.py"):
    files[modname(p)] = p
mods = set(files)
def is_pkg(m): return files[m].name == "__init__.py"
def resolve(m, name, level, cur):
    if level:
        base = cur.split(".") if is_pkg(cur) else cur.split(".")[:-1]
        base = base[: len(base) - (level - 1)] if level > 1 else base
        m = ".".join(base + ([name] if name else []))
    return m
edges = {}   # (src, dst) -> list of (lineno, toplevel:bool)
info = {}
for m, p in sorted(files.items()):
    text = p.read_text()
    tree = ast.parse(text)
    # mark function-level nodes
    func_nodes = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for c in ast.walk(n):
                func_nodes.add(id(c))
    fns = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    info[m] = {"lines": text.count("\n"), "path": str(p.relative_to(SRC)), "maxfn": max([l for _, l in fns], default=0),
               "doc": len((ast.get_docstring(tree, clean=False) or "").splitlines()) + (1 if ast.get_docstring(tree) else 0)}
    for n in ast.walk(tree):
        targets = []
        if isinstance(n, ast.Import):
            for a in n.names:
                targets.append(a.name)
        elif isinstance(n, ast.ImportFrom):
            base = resolve(n.module or "", None, n.level, m) if n.level else n.module
            if n.level:
                b = (m.split(".") if is_pkg(m) else m.split(".")[:-1])
                b = b[: len(b) - (n.level - 1)]
                base = ".".join(b + ([n.module] if n.module else []))
            for a in n.names:
                full = f"{base}.{a.name}"
                targets.append(full if full in mods else base)
        for t in targets:
            # resolve to the longest existing module prefix
            parts = t.split(".")
            while parts and ".".join(parts) not in mods:
                parts.pop()
            if not parts: continue
            d = ".".join(parts)
            if d == m: continue
            edges.setdefault((m, d), []).append((n.lineno, id(n) not in func_nodes))
json.dump({"info": info, "edges": [[a, b, v] for (a, b), v in edges.items()]}, open("/tmp/restructure/graph.json", "w"), indent=0)
print(len([m for m in info if m.startswith("zerotune")]), "zerotune modules;", len(edges), "edges;",
      sum(i["lines"] for m, i in info.items() if m.startswith("zerotune")), "lines")
