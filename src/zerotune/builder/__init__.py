"""The config builder page: compose a configuration from the config groups (the packaged ones and the user's
folder's), see the command line, the composed config and the validated DeepSpeed JSON as fields change,
whether it fits a card (the planner), save it as an experiment in the user's folder, import a DeepSpeed or
accelerate file, and open a sweep's results. `zerotune builder` (or `python -m zerotune builder`).

form.py (fields from the config groups), preview.py, fit.py, experiments.py, importing.py and results.py each
serve one panel; app.py routes to them; paths.py keeps every file the page touches inside the working
directory's multirun/ and outputs/, and experiments.py writes only in the user's experiment folder."""
