"""Verify the restructure mapping against today's import graph (all imports: module-level, function-level,
TYPE_CHECKING), with names resolved through re-exporting packages (checkpoints/__init__ etc.), so a dissolved
facade's importers are charged to the module that defines the name."""
import ast, json, os, sys, collections
from pathlib import Path
sys.path.insert(0, "/tmp/restructure")
from mapping_src import M, MOVES, DISSOLVED

SRC = Path("/work/main/src")
def modname(p):
    parts = list(p.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
files = {}
for root, dirs, fs in os.walk(SRC / "zerotune", followlinks=True):
    for f in fs:
        if f.endswith(".py"):
            files[modname(Path(root) / f)] = Path(root) / f
for p in (SRC / "hydra_plugins").rglob("*.py"):
    files[modname(p)] = p
mods = set(files)
trees = {m: ast.parse(p.read_text()) for m, p in files.items()}
lines = {m: p.read_text().count("\n") for m, p in files.items()}
is_pkg = {m: files[m].name == "__init__.py" for m in files}

def longest(t):
    parts = t.split(".")
    while parts and ".".join(parts) not in mods:
        parts.pop()
    return ".".join(parts) if parts else None

def base_of(m, node):
    if not node.level:
        return node.module
    b = m.split(".") if is_pkg[m] else m.split(".")[:-1]
    b = b[: len(b) - (node.level - 1)]
    return ".".join(b + ([node.module] if node.module else []))

# names defined / re-exported at module level
defined, reexport = {}, {}
for m, t in trees.items():
    d, r = set(), {}
    for n in t.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            d.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            for tg in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                for x in ast.walk(tg):
                    if isinstance(x, ast.Name): d.add(x.id)
        elif isinstance(n, ast.ImportFrom):
            b = base_of(m, n)
            for a in n.names:
                full = f"{b}.{a.name}"
                r[a.asname or a.name] = (full, None) if full in mods else (b, a.name)
    defined[m], reexport[m] = d, r

def resolve(target, name, depth=0):
    """(module, name) -> the module that defines name."""
    if name is None or depth > 5 or target not in mods:
        return target
    if f"{target}.{name}" in mods:
        return f"{target}.{name}"
    if name in defined[target]:
        return target
    if name in reexport[target]:
        t2, n2 = reexport[target][name]
        return resolve(t2, n2, depth + 1) if t2 in mods else target
    return target

# edges: (src, dst_module, name) with toplevel flag
raw = []  # (src, dst_module, name, toplevel)
for m, t in trees.items():
    fn_nodes = set()
    for n in ast.walk(t):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            fn_nodes.update(id(c) for c in ast.walk(n))
    bound = {}  # local name -> module (for attribute resolution)
    for n in ast.walk(t):
        top = id(n) not in fn_nodes
        if isinstance(n, ast.Import):
            for a in n.names:
                d = longest(a.name)
                if d and d.startswith(("zerotune", "hydra_plugins")):
                    raw.append((m, d, None, top))
                    if a.asname: bound[a.asname] = d
        elif isinstance(n, ast.ImportFrom):
            b = base_of(m, n)
            if not b or not b.startswith(("zerotune", "hydra_plugins")):
                continue
            for a in n.names:
                full = f"{b}.{a.name}"
                if full in mods:
                    bound[a.asname or a.name] = full
                    if is_pkg[full]:
                        continue  # charged per attribute below (a package imported for its names)
                    raw.append((m, full, None, top))
                else:
                    d = longest(b)
                    if d: raw.append((m, d, a.name, top))
    # attribute uses of bound package names: pkg.attr
    used_attr = collections.defaultdict(set)
    for n in ast.walk(t):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in bound:
            used_attr[n.value.id].add(n.attr)
    for local, d in bound.items():
        if is_pkg.get(d):
            attrs = used_attr.get(local) or {None}
            for at in attrs:
                raw.append((m, d, at, True))
edges = set()
unresolved = []
for s, d, name, top in raw:
    if s in DISSOLVED:
        continue
    r = resolve(d, name)
    if r in DISSOLVED and r != s:
        unresolved.append((s, d, name))
    if (r, name) in MOVES:
        r = MOVES[(r, name)]
    elif (d, name) in MOVES:
        r = MOVES[(d, name)]
    if r != s:
        edges.add((s, r, name))

# ---- mapping
new_of = {}
mapping = {}
for new, olds in M.items():
    nn = "zerotune" if new == "__init__" else "zerotune." + new
    mapping[nn] = []
    for o in olds:
        if o.endswith("placeholder"): continue
        on = "zerotune" if o == "__init__" else "zerotune." + o
        assert on in mods, on
        assert on not in new_of, f"{on} mapped twice"
        new_of[on] = nn
        mapping[nn].append(on)
ours = sorted(m for m in mods if m.split(".")[0] == "zerotune")
missing = [m for m in ours if m not in new_of]
assert not missing, missing
for m in mods:
    if m.startswith("hydra_plugins"): new_of[m] = m
for mv in MOVES.values(): new_of.setdefault(mv, mv)
new_of.update({v: v for v in MOVES.values() if v in mapping})

LAYERS = [["cli"], ["builder", "tune"], ["job", "report"], ["train"], ["plan"], ["data", "rundir"],
          ["models", "host"], ["config"]]
layer_of = {p: i for i, ps in enumerate(LAYERS) for p in ps}
def pkg(n):
    parts = n.split(".")
    return parts[1] if parts[0] == "zerotune" and len(parts) > 1 else None

new_edges = collections.defaultdict(set)  # (a, b) -> {(old src, old dst, name)}
for s, d, name in edges:
    a, b = new_of[s], (MOVES.get((d, name)) or new_of.get(d, d))
    if a != b:
        new_edges[(a, b)].add((s, d, name))

report = []
viol = []
for (a, b), why in sorted(new_edges.items()):
    if a.startswith("hydra_plugins") or not b.startswith("zerotune"): continue
    pa, pb = pkg(a), pkg(b)
    if pa is None or pb is None or pa == pb or pa == "__main__": continue
    if pa not in layer_of or pb not in layer_of:
        viol.append(f"unlayered {a} -> {b}"); continue
    if layer_of[pa] >= layer_of[pb]:
        viol.append(f"{a} -> {b}   (from {sorted(why)})")
# cycles among new modules (Tarjan)
graph = collections.defaultdict(set)
for (a, b) in new_edges:
    if a.startswith("zerotune") and b.startswith("zerotune"):
        graph[a].add(b)
sys.setrecursionlimit(10000)
index, low, stack, on, sccs = {}, {}, [], set(), []
def visit(v):
    index[v] = low[v] = len(index); stack.append(v); on.add(v)
    for w in graph[v]:
        if w not in index: visit(w); low[v] = min(low[v], low[w])
        elif w in on: low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        g = []
        while True:
            w = stack.pop(); on.discard(w); g.append(w)
            if w == v: break
        if len(g) > 1: sccs.append(sorted(g))
for v in list(graph):
    if v not in index: visit(v)
# sizes
size = {n: sum(lines[o] for o in olds) for n, olds in mapping.items()}
big = {n: s for n, s in size.items() if s > 500}
pkgs = sorted({pkg(n) for n in mapping if pkg(n) and "." not in n[len("zerotune."):] and n != "zerotune.__main__"})
print("old modules:", len(ours), " new modules:", len(mapping), " top-level packages:", len(pkgs), pkgs)
print("layers:", len(LAYERS))
print("over 500 lines:", big)
print("layer violations:", len(viol)); print("\n".join(viol))
print("cycles:", sccs)
print("imports left on a dissolved facade:", unresolved)
json.dump({n: mapping[n] for n in sorted(mapping)}, open("/tmp/restructure/mapping.json", "w"), indent=1)
json.dump({"sizes": size, "new_edges": sorted([a, b] for a, b in new_edges),
           "old_edges": sorted([s, d, str(n)] for s, d, n in edges)},
          open("/tmp/restructure/new_graph.json", "w"), indent=0, default=str)

def explain(group):
    g = set(group)
    for (a, b), why in sorted(new_edges.items()):
        if a in g and b in g:
            print(f"  {a} -> {b}: " + "; ".join(f"{s}->{d}" + (f".{n}" if n else "") for s, d, n in sorted(why, key=str)))
if "-v" in sys.argv:
    for grp in sccs:
        print("CYCLE", grp); explain(grp)
