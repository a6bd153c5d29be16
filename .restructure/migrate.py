"""Apply the module map (mapping_src.py) to a checkout, deterministically.

Run from the repository root on a clean tree:  python .restructure/migrate.py
It rewrites imports and dotted references everywhere, then moves (git mv) or merges the modules of src/zerotune.
Prints what needs a hand: name clashes between merged sources, bare uses of a dissolved facade, `-m` forwarders.
"""
from __future__ import annotations

import ast
import collections
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path.cwd()
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from mapping_src import DISSOLVED, MOVES, M  # noqa: E402

SRC = ROOT / "src"
PKG = SRC / "zerotune"
NOTES: list[str] = []


def note(msg: str) -> None:
    NOTES.append(msg)


# ---------------------------------------------------------------- the old tree
def modname(p: Path) -> str:
    parts = list(p.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


files: dict[str, Path] = {}
for root, dirs, fs in os.walk(PKG, followlinks=True):
    dirs[:] = [d for d in dirs if d != "__pycache__"]
    for f in fs:
        if f.endswith(".py"):
            files[modname(Path(root) / f)] = Path(root) / f
for p in (SRC / "hydra_plugins").rglob("*.py"):
    files[modname(p)] = p
# names two merged sources both define: the one renamed here (module, name) -> new name; and its users outside
CLASH_RENAMES = {("zerotune.plan.render", "micro_batch"): "micro_batch_lines"}
USER_SUBS = [("tests/test_plan.py", "render.micro_batch(", "render.micro_batch_lines(")]
mods = set(files)
is_pkg = {m: files[m].name == "__init__.py" for m in files}
texts = {m: files[m].read_text() for m in files}
for (cm, cn), cnew in CLASH_RENAMES.items():
    texts[cm] = re.sub(rf"(?<![\w.'\"]){cn}(?=\()", cnew, texts[cm])
for rel, a, b in USER_SUBS:
    if (ROOT / rel).exists():
        (ROOT / rel).write_text((ROOT / rel).read_text().replace(a, b))
trees = {m: ast.parse(texts[m]) for m in files}


def longest(t: str) -> str | None:
    parts = t.split(".")
    while parts and ".".join(parts) not in mods:
        parts.pop()
    return ".".join(parts) if parts else None


defined: dict[str, set[str]] = {}
reexport: dict[str, dict[str, tuple[str, str | None]]] = {}
for m, t in trees.items():
    d: set[str] = set()
    r: dict[str, tuple[str, str | None]] = {}
    for n in t.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            d.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            for tg in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                for x in ast.walk(tg):
                    if isinstance(x, ast.Name):
                        d.add(x.id)
        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
            for a in n.names:
                full = f"{n.module}.{a.name}"
                r[a.asname or a.name] = (full, None) if full in mods else (n.module, a.name)
    defined[m], reexport[m] = d, r


def resolve(target: str, name: str | None, depth: int = 0) -> str:
    if name is None or depth > 6 or target not in mods:
        return target
    if f"{target}.{name}" in mods:
        return f"{target}.{name}"
    if name in defined[target]:
        return target
    if name in reexport[target]:
        t2, n2 = reexport[target][name]
        if t2 in mods:
            return resolve(t2, n2, depth + 1)
    return target


# ---------------------------------------------------------------- the mapping
new_of: dict[str, str] = {}
sources: dict[str, list[str]] = {}
for new, olds in M.items():
    nn = "zerotune" if new == "__init__" else "zerotune." + new
    sources[nn] = []
    for o in olds:
        if o.endswith("placeholder"):
            continue
        on = "zerotune" if o == "__init__" else "zerotune." + o
        if on not in mods:
            note(f"mapping names {on}, which this tree lacks")
            continue
        new_of[on] = nn
        sources[nn].append(on)
for m in sorted(mods):
    if m.startswith("hydra_plugins"):
        new_of[m] = m
    elif m not in new_of:
        raise SystemExit(f"unmapped module {m}: add it to mapping_src.py")
new_pkgs = {n for n in sources if any(o.startswith(n + ".") for o in sources)} | {
    "zerotune.config", "zerotune.config.conf", "zerotune.config.experiments"}


def home(mod: str, name: str | None) -> tuple[str, bool]:
    """(old module, imported name) -> (new module, whether the name is itself a module)."""
    if name is not None and f"{mod}.{name}" in mods:
        return new_of[f"{mod}.{name}"], True
    d = resolve(mod, name)
    if name is not None and (d, name) in MOVES:
        return MOVES[(d, name)], False
    if name is not None and (mod, name) in MOVES:
        return MOVES[(mod, name)], False
    if d in DISSOLVED and name is not None:
        note(f"{mod}.{name}: not found behind the facade")
    return new_of.get(d, d), False


def new_dotted(s: str) -> str:
    """A dotted reference zerotune.a.b[.name...] spelled under the new map."""
    parts = s.split(".")
    lm = longest(s)
    if lm is None or not lm.startswith("zerotune"):
        return s
    rest = parts[len(lm.split(".")):]
    if rest:
        h, _ = home(lm, rest[0])
        return ".".join([h, *rest])
    return new_of.get(lm, lm)


def new_path(mod: str) -> Path:
    return SRC.joinpath(*mod.split(".")) / "__init__.py" if mod in new_pkgs else SRC.joinpath(
        *mod.split(".")).with_suffix(".py")


# ---------------------------------------------------------------- rewriting one python file
def line_offsets(text: str) -> list[int]:
    offs, o = [0], 0
    for line in text.splitlines(keepends=True):
        o += len(line)
        offs.append(o)
    return offs


def pos(offs: list[int], line: int, col: int, text_lines: list[str]) -> int:
    # ast columns are utf-8 byte offsets
    raw = text_lines[line - 1].encode()[:col].decode(errors="ignore")
    return offs[line - 1] + len(raw)


DOTTED = re.compile(r"(?<![\w.])zerotune(?:\.[A-Za-z_]\w*)+")
PATHREF = re.compile(r"(?<![\w])(?:src/)?zerotune/([\w/]+)\.py")


def path_sub(mt: re.Match) -> str:
    rel = mt.group(1)
    old = "zerotune." + rel.replace("/", ".")
    if old.endswith(".__init__"):
        old = old[: -len(".__init__")]
    if old not in new_of:
        return mt.group(0)
    p = new_path(new_of[old]).relative_to(SRC)
    prefix = "src/" if mt.group(0).startswith("src/") else ""
    return prefix + str(p)


def rewrite_strings(s: str) -> str:
    s = PATHREF.sub(path_sub, s)
    return DOTTED.sub(lambda mt: new_dotted(mt.group(0)), s)


def fmt_from(indent: str, mod: str, names: list[tuple[str, str | None]], tail: str) -> str:
    items = [n if not a or a == n else f"{n} as {a}" for n, a in names]
    line = f"{indent}from {mod} import {', '.join(items)}{tail}"
    if len(line) <= 110:
        return line
    out = f"{indent}from {mod} import ({tail}\n"
    cur = indent + "    "
    for i, it in enumerate(items):
        piece = it + ("," if i < len(items) - 1 else "")
        if len(cur) + len(piece) + 1 > 110 and cur.strip():
            out += cur.rstrip() + "\n"
            cur = indent + "    "
        cur += piece + " "
    return out + cur.rstrip() + f"\n{indent})"


def rewrite_py(text: str, self_new: str | None, label: str) -> str:
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    offs = line_offsets(text)
    edits: list[tuple[int, int, str]] = []
    all_names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
        for a in [*n.args, *n.kwonlyargs, *n.posonlyargs]} | {
        n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))}
    renames: dict[str, str] = {}          # local module alias -> new local name ('' = now this module)
    facade: dict[str, str] = {}           # local alias of a dissolved facade -> old facade module
    import_ranges: list[tuple[int, int]] = []
    parents: dict[int, list[ast.stmt]] = {}
    for n in ast.walk(tree):
        for fld in ("body", "orelse", "finalbody", "handlers"):
            body = getattr(n, fld, None)
            if isinstance(body, list):
                for c in body:
                    parents[id(c)] = body
    taken_new: dict[str, str] = {}
    stored = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)} | {
        a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
        for a in [*n.args, *n.kwonlyargs, *n.posonlyargs]} | {
        n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))}
    attr_vals = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    bare = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in attr_vals}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.ImportFrom) and (node.level or not node.module or
                                                 not node.module.startswith(("zerotune", "hydra_plugins"))):
            continue
        if isinstance(node, ast.Import) and not any(a.name.startswith("zerotune") for a in node.names):
            continue
        start = pos(offs, node.lineno, node.col_offset, lines)
        end = pos(offs, node.end_lineno, node.end_col_offset, lines)
        import_ranges.append((start, end))
        indent = " " * node.col_offset
        tail = ""
        if node.lineno == node.end_lineno:
            rest = lines[node.end_lineno - 1][len(lines[node.end_lineno - 1].encode()[:node.end_col_offset].decode(
                errors="ignore")):].rstrip("\n")
            if rest.strip().startswith("#"):
                tail = rest
                end += len(rest)
        out: list[str] = []
        if isinstance(node, ast.Import):
            for a in node.names:
                lm = longest(a.name)
                nm = new_of.get(lm, lm) if lm else a.name
                out.append(f"{indent}import {nm}" + (f" as {a.asname}" if a.asname else "") + tail)
        else:
            groups: dict[str, list[tuple[str, str | None]]] = collections.OrderedDict()
            mod = node.module
            for a in node.names:
                local = a.asname or a.name
                sub = f"{mod}.{a.name}"
                if sub in DISSOLVED:
                    facade[local] = sub
                    continue
                h, is_mod = home(mod, a.name)
                if is_mod:
                    parent, last = h.rsplit(".", 1)
                    safe = local not in stored and local not in bare
                    if h == self_new and safe:
                        renames[local] = ""
                        continue
                    if h == self_new:
                        note(f"{label}: imports itself as {local} (a name it also binds or uses bare)")
                    if local != last and (not safe or last in all_names or taken_new.get(last, h) != h):
                        groups.setdefault(parent, []).append((last, local))
                    else:
                        if local != last:
                            renames[local] = last
                        taken_new[last] = h
                        groups.setdefault(parent, []).append((last, None))
                else:
                    if h == self_new:
                        if a.asname and a.asname != a.name:
                            note(f"{label}: self-import {a.name} as {a.asname}: kept as an assignment")
                            out.append(f"{indent}{a.asname} = {a.name}")
                        continue
                    groups.setdefault(h, []).append((a.name, a.asname))
            for g, names in groups.items():
                seen = []
                for x in names:
                    if x not in seen:
                        seen.append(x)
                out.append(fmt_from(indent, g, seen, tail))
        # facade aliases: imports added per attribute later (placed here)
        marker = f"\x00FACADE{start}\x00" if any(facade_alias_in(node, facade) for _ in [0]) else ""
        body = "\n".join(out)
        if marker:
            body = (body + "\n" + indent if body else "") + marker
        if not body.strip():
            siblings = parents.get(id(node), [])
            body = f"{indent}pass" if len(siblings) == 1 else ""
        edits.append((start, end, body.lstrip(" ") if body else ""))
    # attribute uses of renamed module aliases and dissolved facades
    facade_imports: dict[str, set[tuple[str, str]]] = collections.defaultdict(set)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            v = node.value.id
            if v in facade:
                h, is_mod = home(facade[v], node.attr)
                parent, last = h.rsplit(".", 1)
                local = last if last not in stored else f"{parent.rsplit('.', 1)[-1]}_{last}"
                facade_imports[v].add((parent, last if local == last else f"{last} as {local}"))
                s = pos(offs, node.value.lineno, node.value.col_offset, lines)
                e = pos(offs, node.value.end_lineno, node.value.end_col_offset, lines)
                edits.append((s, e, local))
                continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "setattr", "delattr") and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and \
                node.args[0].id in facade and isinstance(node.args[1], ast.Constant):
            v = node.args[0].id
            h, _ = home(facade[v], node.args[1].value)
            parent, last = h.rsplit(".", 1)
            local = last if last not in stored else f"{parent.rsplit('.', 1)[-1]}_{last}"
            facade_imports[v].add((parent, last if local == last else f"{last} as {local}"))
            a0 = node.args[0]
            edits.append((pos(offs, a0.lineno, a0.col_offset, lines),
                          pos(offs, a0.end_lineno, a0.end_col_offset, lines), local))
            continue
    attr_value_ids = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    setattr_ids = {id(n.args[0]) for n in ast.walk(tree) if isinstance(n, ast.Call) and n.args and isinstance(
        n.func, ast.Attribute) and n.func.attr in ("setattr", "delattr")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in facade and id(node) not in attr_value_ids and \
                id(node) not in setattr_ids:
            note(f"{label}:{node.lineno}: bare use of the dissolved facade {facade[node.id]} as {node.id}")
        if isinstance(node, ast.Name) and node.id in renames:
            new = renames[node.id]
            s = pos(offs, node.lineno, node.col_offset, lines)
            e = pos(offs, node.end_lineno, node.end_col_offset, lines)
            if new == "":
                # module merged into this one: `alias.attr` -> `attr`
                if id(node) in attr_value_ids:
                    edits.append((s, e + 1, ""))   # also the dot
                else:
                    note(f"{label}:{node.lineno}: bare use of {node.id}, now this module")
            else:
                edits.append((s, e, new))
    # strings and comments (not inside rewritten imports)
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except tokenize.TokenError:
        toks = []
    for tk in toks:
        if tk.type not in (tokenize.STRING, tokenize.COMMENT) and tokenize.tok_name.get(tk.type) != "FSTRING_MIDDLE":
            continue
        if "zerotune" not in tk.string:
            continue
        s = offs[tk.start[0] - 1] + tk.start[1]
        e = offs[tk.end[0] - 1] + tk.end[1]
        if any(a <= s < b for a, b in import_ranges):
            continue
        new = rewrite_strings(tk.string)
        if new != tk.string:
            edits.append((s, e, new))
    edits.sort(key=lambda x: (x[0], x[1]))
    out_text = text
    last_start = len(text) + 1
    for s, e, r in sorted(edits, key=lambda x: -x[0]):
        if e > last_start:
            continue
        out_text = out_text[:s] + r + out_text[e:]
        last_start = s
    # facade imports
    for mk in re.findall(r"\x00FACADE\d+\x00", out_text):
        idx = out_text.index(mk)
        line_start = out_text.rfind("\n", 0, idx) + 1
        indent = re.match(r"\s*", out_text[line_start:idx]).group(0) if out_text[line_start:idx].strip() == "" \
            else ""
        imps = sorted({x for v in facade_imports.values() for x in v
                       if f"{x[0]}.{x[1].split(' ')[0]}" != self_new})
        txt = "\n".join(f"{indent if i else ''}from {p} import {lst}" for i, (p, lst) in enumerate(imps))
        out_text = out_text.replace(mk, txt, 1)
    out_text = re.sub(r"\n[ \t]*\n(?=[ \t]*\n)", "\n", out_text) if False else out_text
    out_text = re.sub(r"^[ \t]+$\n", "", out_text, flags=re.M) if False else out_text
    return out_text


def facade_alias_in(node: ast.AST, facade: dict[str, str]) -> bool:
    return isinstance(node, ast.ImportFrom) and any(f"{node.module}.{a.name}" in DISSOLVED for a in node.names)


# ---------------------------------------------------------------- merging
def split_module(text: str) -> tuple[str | None, list[str], list[str], str]:
    """(docstring, header import statements, TYPE_CHECKING imports, body)."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    body = tree.body
    doc = None
    i = 0
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
            body[0].value.value, str):
        doc = body[0].value.value
        i = 1
    imps: list[str] = []
    tc: list[str] = []
    while i < len(body):
        n = body[i]
        seg = "".join(lines[n.lineno - 1:n.end_lineno])
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            imps.append(seg.rstrip("\n"))
        elif isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test) and not n.orelse and all(
                isinstance(c, (ast.Import, ast.ImportFrom)) for c in n.body):
            for c in n.body:
                tc.append("".join(lines[c.lineno - 1:c.end_lineno]).strip())
        else:
            break
        i += 1
    if i < len(body):
        first = body[i]
        start = first.lineno - 1
        if hasattr(first, "decorator_list") and first.decorator_list:
            start = first.decorator_list[0].lineno - 1
        # keep comments right above the first statement
        while start > 0 and lines[start - 1].lstrip().startswith("#"):
            start -= 1
        rest = "".join(lines[start:])
    else:
        rest = ""
    return doc, imps, tc, rest


def top_names(text: str) -> set[str]:
    t = ast.parse(text)
    d = set()
    for n in t.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            d.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            for tg in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                for x in ast.walk(tg):
                    if isinstance(x, ast.Name):
                        d.add(x.id)
    return d


def extract_function(text: str, name: str) -> tuple[str, str]:
    t = ast.parse(text)
    lines = text.splitlines(keepends=True)
    for n in t.body:
        if isinstance(n, ast.FunctionDef) and n.name == name:
            s = (n.decorator_list[0].lineno if n.decorator_list else n.lineno) - 1
            seg = "".join(lines[s:n.end_lineno])
            return "".join(lines[:s] + lines[n.end_lineno:]), seg
    raise SystemExit(f"no function {name}")


def order_sources(new: str, olds: list[str]) -> list[str]:
    deps = {o: set() for o in olds}
    for o in olds:
        for n in trees[o].body:
            if isinstance(n, ast.ImportFrom) and n.module and not n.level:
                for a in n.names:
                    d = resolve(n.module, a.name) if f"{n.module}.{a.name}" not in mods else f"{n.module}.{a.name}"
                    if d in deps and d != o:
                        deps[o].add(d)
    done: list[str] = []
    while len(done) < len(olds):
        for o in olds:
            if o not in done and deps[o] <= set(done):
                done.append(o)
                break
        else:
            rest = [o for o in olds if o not in done]
            note(f"{new}: sources import each other at module level: {rest}")
            done += rest
    return done


def merge(new: str, olds: list[str], rewritten: dict[str, str], moved_in: list[str]) -> str:
    docs, imps, tcs, bodies = [], [], [], []
    future = False
    names_by_src: dict[str, set[str]] = {}
    for o in order_sources(new, olds):
        doc, im, tc, rest = split_module(rewritten[o])
        if doc:
            docs.append(doc.strip())
        if o.endswith(".__main__") and new.startswith("zerotune.cli."):
            continue  # a `python -m zerotune.<command>` forwarder: `python -m zerotune <command>` stays
        if o in DISSOLVED:
            rest = re.sub(r"(?ms)^__all__\s*=.*?\]\n?", "", rest)
            if rest.strip():
                bodies.append(rest.strip("\n"))
            continue
        for s in im:
            if s.strip() == "from __future__ import annotations":
                future = True
            else:
                imps.append(s)
        tcs += tc
        if rest.strip():
            bodies.append(rest.strip("\n"))
            names_by_src[o] = top_names(rest)
    for extra_imps, seg in moved_in:
        imps += extra_imps
        bodies.append(seg.strip("\n"))
    seen_names: dict[str, str] = {}
    for o, ns in names_by_src.items():
        for n in ns:
            if n in seen_names and n not in ("logger", "log", "_log", "LOG", "__all__"):
                note(f"CLASH in {new}: {n} defined by {seen_names[n]} and {o}")
            seen_names.setdefault(n, o)
    out = ['"""' + "\n\n".join(docs).replace('"""', "'''") + '"""\n' if docs else '"""' + new + '."""\n']
    if future:
        out.append("from __future__ import annotations\n")
    ded: list[str] = []
    for s in imps:
        if s not in ded:
            ded.append(s)
    if ded:
        out.append("\n".join(ded) + "\n")
    if tcs:
        tcd: list[str] = []
        for s in tcs:
            if s not in tcd:
                tcd.append(s)
        if not any("TYPE_CHECKING" in s for s in ded):
            out.append("from typing import TYPE_CHECKING\n")
        out.append("if TYPE_CHECKING:\n" + "\n".join("    " + s.replace("\n", "\n    ") for s in tcd) + "\n")
    text = "\n".join(out)
    kept: set[str] = set()
    for b in bodies:
        blines = b.split("\n")
        keep = []
        for ln in blines:
            if re.match(r"^[A-Z_][A-Z0-9_]* = [^\n]+$", ln) and ln in kept:
                continue
            if re.match(r"^[A-Z_][A-Z0-9_]* = [^\n]+$", ln):
                kept.add(ln)
            keep.append(ln)
        text += "\n\n" + "\n".join(keep) + "\n"
    # dedupe identical logger lines
    log_lines = re.findall(r"^(\w+ = logging\.getLogger\(__name__\))$", text, flags=re.M)
    for ln in set(log_lines):
        first = text.index(ln) + len(ln)
        text = text[:first] + text[first:].replace("\n" + ln + "\n", "\n")
    return text


# `python -m` names of the forwarders that go (the command is `python -m zerotune <command>`), after the rewrite
COMMANDS = {"report": "report", "rundir.export": "export", "cli.doctor": "doctor", "builder": "builder",
            "plan.import_config": "import-config", "plan": "plan", "config.deepspeed_blocks": "ds-config"}
POST_SUBS: list[tuple[str, str]] = []
for mod, cmd in COMMANDS.items():
    m_ = re.escape("zerotune." + mod)
    POST_SUBS += [(rf'"-m", "{m_}"', f'"-m", "zerotune", "{cmd}"'),
                  (rf'run_cli\((.*?)module="{m_}"', rf'run_cli("{cmd}", \1module="zerotune"'),
                  (rf"-m {m_}(?![\w.])", f"-m zerotune {cmd}")]
POST_SUBS += [(r"-m zerotune\.host(?![\w.])", "-m zerotune.host.ops"),
              (r'"-m", "zerotune\.host"', '"-m", "zerotune.host.ops"'),
              (r"(?<![\w/])zerotune/conf(?=[/\"' ])", "zerotune/config/conf"),
              (r"src/zerotune/conf\b", "src/zerotune/config/conf"),
              (r"\.\.\./zerotune/conf\b", ".../zerotune/config/conf"),
              (r"\.\.\./zerotune/experiments\b", ".../zerotune/config/experiments"),
              (r"src/zerotune/experiments/", "src/zerotune/config/experiments/"),
              (r"(?<![\w/])zerotune/experiments(?=[/\"' ])", "zerotune/config/experiments")]


def post_subs(paths: list[Path]) -> None:
    for p in paths:
        t = p.read_text()
        n = t
        for a, b in POST_SUBS:
            n = re.sub(a, b, n)
        if n != t:
            p.write_text(n)


# ---------------------------------------------------------------- the run
def git(*args: str) -> None:
    subprocess.run(["git", *args], check=True, cwd=ROOT)


def main() -> None:
    # 1. rewrite every python file outside src/zerotune and every text file (in place)
    py_roots = [ROOT / d for d in ("tests", "benchmarks", "experiments", "scripts", "conf")] + [SRC / "hydra_plugins"]
    py_files = [p for r in py_roots if r.exists() for p in r.rglob("*.py") if "__pycache__" not in p.parts]
    py_files += [ROOT / "train.py"]
    for p in py_files:
        if p.is_symlink():
            continue
        t = p.read_text()
        n = rewrite_py(t, new_of.get(modname(p)) if p.is_relative_to(SRC) else None, str(p.relative_to(ROOT)))
        if n != t:
            p.write_text(n)
    other = [ROOT / "pyproject.toml", ROOT / "Makefile", ROOT / "mkdocs.yml"]
    for d in ("docs", "conf", "experiments", "scripts", "tests", "benchmarks"):
        if (ROOT / d).exists():
            other += [p for p in (ROOT / d).rglob("*") if p.is_file() and not p.is_symlink() and p.suffix in (
                ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".cfg", ".json", ".ini") and "__pycache__" not in p.parts]
    for p in other:
        if not p.exists():
            continue
        t = p.read_text()
        n = rewrite_strings(t)
        if n != t:
            p.write_text(n)
    # 2. the package's modules, rewritten in memory
    rewritten = {}
    for m in sorted(mods):
        if m.startswith("hydra_plugins"):
            continue
        rewritten[m] = rewrite_py(texts[m], new_of[m], m)
    # 3. moves and merges
    moved: dict[str, list[tuple[list[str], str]]] = collections.defaultdict(list)
    for (om, name), nm in MOVES.items():
        rest, seg = extract_function(rewritten[om], name)
        rewritten[om] = rest
        _, im, _, _ = split_module(rest)
        im = [x for x in im if not x.startswith(f"from {nm} import") and "__future__" not in x]
        moved[nm].append((im, seg))
        note(f"moved {om}.{name} to {nm}: check its imports, and that {om} imports it back if it uses it")
    links = {m: files[m] for m in mods if any(part.is_symlink() for part in [files[m].parent])}
    real_files = {m: p for m, p in files.items() if not m.startswith("hydra_plugins") and not any(
        q.is_symlink() for q in [p, *p.parents] if q.is_relative_to(PKG) and q != PKG)}
    for new, olds in sorted(sources.items()):
        dst = new_path(new)
        olds_real = [o for o in olds if o in real_files]
        if not olds and new == "zerotune.config":
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text('"""The config: its types, where it is found, its Hydra composition, the user\'s own '
                           'files folded in, the\nDeepSpeed blocks config keys map to, the user-facing error, atomic '
                           'file writes, and the packaged YAML."""\n')
            continue
        if len(olds_real) == 1 and not moved.get(new) and olds_real[0] not in DISSOLVED:
            src = real_files[olds_real[0]]
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.resolve() != dst.resolve():
                staging = dst.with_name(dst.name + ".migrating")
                git("mv", str(src), str(staging))
            else:
                staging = src
            staging.write_text(rewritten[olds_real[0]])
            continue
        if not olds_real and not moved.get(new):
            continue
        stage = dst.with_name(dst.name + ".migrating")
        stage.parent.mkdir(parents=True, exist_ok=True)
        stage.write_text(merge(new, olds_real, rewritten, moved.get(new, [])))
        for o in olds_real:
            if real_files[o].exists():
                git("rm", "-q", "--cached", str(real_files[o]))
                real_files[o].unlink()
    # the staged files take their names (after every source is gone)
    for st in sorted(PKG.rglob("*.migrating")):
        final = st.with_name(st.name[: -len(".migrating")])
        if final.exists() and final.resolve() != st.resolve():
            raise SystemExit(f"{final} still exists")
        st.rename(final)
        git("add", str(final))
    # symlinks
    git("mv", str(PKG / "conf"), str(PKG / "config" / "conf"))
    os.remove(PKG / "config" / "conf")
    os.symlink("../../../conf", PKG / "config" / "conf")
    git("add", str(PKG / "config" / "conf"))
    exp_link = PKG / "experiments" / "experiment"
    if exp_link.is_symlink():
        git("mv", str(exp_link), str(PKG / "config" / "experiments" / "experiment"))
        os.remove(PKG / "config" / "experiments" / "experiment")
        os.symlink("../../../../experiments/experiment", PKG / "config" / "experiments" / "experiment")
        git("add", str(PKG / "config" / "experiments" / "experiment"))
    # empty old directories
    dirs = [Path(r) / x for r, ds, _ in os.walk(PKG) for x in ds]
    for d in sorted(dirs, key=lambda p: -len(p.parts)):
        if d.is_dir() and not d.is_symlink():
            rest = [x for x in d.iterdir() if x.name != "__pycache__"]
            if not rest:
                for x in d.iterdir():
                    subprocess.run(["rm", "-rf", str(x)])
                d.rmdir()
    post_subs([p for d in ("src", "tests", "benchmarks", "docs", "experiments", "scripts", "conf") if (ROOT / d).exists()
               for p in (ROOT / d).rglob("*") if p.is_file() and not p.is_symlink() and p.suffix in (".py", ".md")
               and not any(q.is_symlink() for q in p.parents)] + [ROOT / "Makefile", ROOT / "pyproject.toml"])
    # 4. pyproject: the contracts of the design
    py = (ROOT / "pyproject.toml").read_text()
    contracts = (HERE / "contracts.toml").read_text()
    py = re.sub(r"(?ms)^\[tool\.importlinter\].*?(?=^\[tool\.mypy\])", contracts.rstrip("\n") + "\n\n", py)
    (ROOT / "pyproject.toml").write_text(py)
    for n in NOTES:
        print(n)
    _ = links


if __name__ == "__main__":
    main()
