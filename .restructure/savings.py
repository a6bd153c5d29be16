import ast, json, os, sys, collections
from pathlib import Path
sys.path.insert(0, "/tmp/restructure")
from mapping_src import DISSOLVED
SRC = Path("/work/main/src")
mapping = json.load(open("mapping.json"))
info = json.load(open("graph.json"))["info"]
def path(m):
    return SRC / info[m]["path"]
def top_imports(tree):
    """[(lines, key set)] for module-level imports (incl. under `if TYPE_CHECKING`)."""
    out = []
    for n in tree.body:
        nodes = [n] + (n.body if isinstance(n, ast.If) else [])
        for x in nodes:
            if isinstance(x, ast.Import):
                out.append((x.end_lineno - x.lineno + 1, {("import", a.name, a.asname) for a in x.names}, x))
            elif isinstance(x, ast.ImportFrom):
                out.append((x.end_lineno - x.lineno + 1, {(x.module, a.name, a.asname) for a in x.names}, x))
    return out
total_doc = total_imp = total_fut = total_blank = 0
rows = []
for new, olds in mapping.items():
    olds = [o for o in olds]
    if len(olds) < 2: continue
    trees = {o: ast.parse(path(o).read_text()) for o in olds}
    # primary = largest
    prim = max(olds, key=lambda o: info[o]["lines"])
    doc = imp = fut = 0
    seen_mods = set()
    allkeys = collections.Counter()
    import_lines = 0
    for o in olds:
        t = trees[o]
        ds = ast.get_docstring(t, clean=False)
        if o != prim and ds:
            doc += len(ds.splitlines()) - 1  # keep one line as a section comment
        for ln, keys, x in top_imports(t):
            if isinstance(x, ast.ImportFrom) and x.module == "__future__":
                if o != prim: fut += 1
                continue
            import_lines += ln
    # merged import block: one line per distinct from-module (wrapped ~100 chars), imports among the merged sources gone
    merged_mods = set(olds)
    frm = collections.defaultdict(set); plain = set()
    for o in olds:
        for ln, keys, x in top_imports(trees[o]):
            if isinstance(x, ast.ImportFrom):
                if x.module == "__future__": continue
                mod = x.module or ""
                if mod in merged_mods or any(f"{mod}.{a.name}" in merged_mods for a in x.names): continue
                frm[mod] |= {(a.name, a.asname) for a in x.names}
            else:
                for a in x.names:
                    if a.name not in merged_mods: plain.add((a.name, a.asname))
    est = len(plain) + sum(max(1, (sum(len(n) + 2 for n, _ in names) + len(m) + 12) // 105 + 1) for m, names in frm.items())
    imp = max(0, import_lines - est)
    blank = 3 * (len(olds) - 1)  # separators between module header blocks
    rows.append((new, len(olds), doc, imp, fut, blank))
    total_doc += doc; total_imp += imp; total_fut += fut; total_blank += blank
facade = sum(info[m]["lines"] for m in DISSOLVED)
mains = sum(info[m]["lines"] for m in info if m.endswith("__main__") and m != "zerotune.__main__" and m != "zerotune.ops.__main__")
print(f"merged modules: {len(rows)}; docstrings of secondary sources: {total_doc} lines; import lines: {total_imp}; "
      f"__future__ lines: {total_fut}; header blank lines: {total_blank}; dissolved facades: {facade}; __main__ forwarders: {mains}")
print("total estimate:", total_doc + total_imp + total_fut + total_blank + facade + mains)
json.dump(rows, open("/tmp/restructure/savings.json", "w"))
for r in sorted(rows, key=lambda r: -(r[2] + r[3]))[:10]: print(r)
