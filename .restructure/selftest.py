"""Self-test of check.py's machinery: today's tree under the identity mapping and today's layers."""
import runpy, sys, types, json
sys.path.insert(0, "/tmp/restructure")
import mapping_src
ids = json.load(open("/tmp/restructure/graph.json"))["info"]
M = {}
for m in ids:
    if not m.startswith("zerotune"): continue
    short = "__init__" if m == "zerotune" else m[len("zerotune."):]
    M[short] = [short]
mapping_src.M, mapping_src.MOVES, mapping_src.DISSOLVED = M, {}, set()
src = open("/tmp/restructure/check.py").read()
src = src.replace('LAYERS = [', 'LAYERS_NEW = [')
src = src.replace('layer_of = {', '''LAYERS = [["command"],["cli"],["builder"],["import_config","doctor","tune"],["launch"],["slurm"],["training","plan","export"],["preflight"],["resolved"],["compose"],["user_config"],["sampling","quality","ops"],["ds_config","data","telemetry","loggers","diffusion","checkpoints","validation"],["models"],["rundir"],["config_search"],["platform","errors","files","folders","schema","exiting","units","console"]]
layer_of = {''', 1)
src = src.replace('json.dump(', 'pass; (lambda *a, **k: None)(')
exec(compile(src, "check", "exec"), {"__name__": "__main__"})
