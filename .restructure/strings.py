"""String references to zerotune module paths (not import statements) across the checkout, and their new spelling."""
import ast, json, re, os, sys, collections
from pathlib import Path
ROOT = Path("/work/main")
mapping = json.load(open("/tmp/restructure/mapping.json"))
new_of = {o: n for n, olds in mapping.items() for o in olds}
# renamed symbols (class/func names stay); module path rewrite only
PAT = re.compile(r"(?<![\w/.])zerotune(?:\.[A-Za-z_][A-Za-z_0-9]*)+")
def rewrite(ref):
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in new_of:
            return ".".join([new_of[head]] + parts[i:]), head
    return None, None
rows = collections.defaultdict(list)
skip = {".venv", ".git", "outputs", "multirun", "__pycache__", ".mypy_cache", "zerotune.egg-info", "node_modules", ".pytest_cache"}
for dp, dns, fns in os.walk(ROOT):
    dns[:] = [d for d in dns if d not in skip]
    for fn in fns:
        p = Path(dp) / fn
        if p.suffix not in (".py", ".yaml", ".yml", ".toml", ".md", ".sh", ".cfg", ".ini", ".txt", ".json", ".html") and fn != "Makefile":
            continue
        try: text = p.read_text()
        except Exception: continue
        rel = str(p.relative_to(ROOT))
        if p.suffix == ".py":
            try: tree = ast.parse(text)
            except SyntaxError: continue
            consts = [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            # docstrings are prose: count separately
            docs = set()
            for n in ast.walk(tree):
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and n.body and isinstance(n.body[0], ast.Expr) and isinstance(getattr(n.body[0], "value", None), ast.Constant):
                    docs.add(id(n.body[0].value))
            consts = [(n.lineno, n.value, id(n) in docs) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            for ln, v, isdoc in consts:
                for m in PAT.findall(v):
                    new, head = rewrite(m)
                    if new and new != m:
                        rows["docstring" if isdoc else "code-string"].append((rel, ln, m, new))
            # comments
            for i, line in enumerate(text.splitlines(), 1):
                if "#" in line:
                    for m in PAT.findall(line.split("#", 1)[1]):
                        new, head = rewrite(m)
                        if new and new != m: rows["comment"].append((rel, i, m, new))
        else:
            for i, line in enumerate(text.splitlines(), 1):
                for m in PAT.findall(line):
                    new, head = rewrite(m)
                    if new and new != m: rows["file:" + (p.suffix or fn)].append((rel, i, m, new))
out = {k: v for k, v in rows.items()}
json.dump(out, open("/tmp/restructure/strings.json", "w"), indent=0)
for k, v in sorted(rows.items()):
    by_area = collections.Counter(r[0].split("/")[0] for r in v)
    print(k, len(v), dict(by_area))
