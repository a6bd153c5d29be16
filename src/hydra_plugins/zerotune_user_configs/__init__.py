"""Hydra's search path for zerotune: the user's config folder first, then the packaged configs.

Hydra searches its primary folder (zerotune's packaged conf/) before anything added with `--config-dir` or
`hydra.searchpath`, so a user's `optimizer/adamw.yaml` would never be read. A SearchPathPlugin is Hydra's own
way to place a folder before the primary one. Hydra loads every plugin for every app, so this one acts only
when the primary folder is zerotune's.
"""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath, SearchPathQuery
from hydra.plugins.search_path_plugin import SearchPathPlugin


class ZerotuneUserConfigs(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from zerotune.config import search

        main = SearchPathQuery(provider="main", path=f"pkg://{search.PACKAGED_CONF}")
        if not any(entry.provider == main.provider and entry.path == main.path for entry in search_path.get_path()):
            return
        search_path.append("zerotune experiments", f"pkg://{search.PACKAGED_EXPERIMENTS}", anchor=main)
        user = search.current().user
        if user is not None:
            search_path.prepend(f"zerotune user folder ({user.how})", f"file://{user.path}", anchor=main)
