"""The config builder page: compose a configuration from conf/'s groups, see the command line, the composed
config and the validated DeepSpeed JSON as fields change, whether it fits a card (the planner), save it as an
experiment, import a DeepSpeed or accelerate file, and open a sweep's results. `python -m zerotune.builder`.

form.py (fields from conf/), preview.py, fit.py, experiments.py, importing.py and results.py each serve one
panel; app.py routes to them; paths.py keeps every file the page touches inside the project's folders."""
