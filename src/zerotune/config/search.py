"""Where configs are found: the user's folder (`--config-dir DIR`, $ZEROTUNE_CONFIG_DIR, else ./zerotune/) first,
then the packaged ones (read through importlib.resources, as an installed wheel holds them). A user's file with a
packaged option's name is used in its place, with a warning naming both."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from zerotune.config.errors import ConfigError

log = logging.getLogger(__name__)

PACKAGED_CONF = "zerotune.config.conf"              # Hydra's primary folder (config.yaml)
PACKAGED_EXPERIMENTS = "zerotune.config.experiments"
PACKAGED = (PACKAGED_CONF, PACKAGED_EXPERIMENTS)
USER_FOLDER = "zerotune"  # looked for in the working directory
CONFIG_DIR_ENV = "ZEROTUNE_CONFIG_DIR"
NOT_GROUPS = frozenset({"hydra", "__pycache__"})  # Hydra's own settings, and what importing a package leaves


def packaged_folder(package: str) -> Path:
    """A packaged config folder on disk (wheels install unzipped; an editable install points into the checkout)."""
    return Path(str(resources.files(package)))


def packaged_conf() -> Path:
    return packaged_folder(PACKAGED_CONF)


@dataclass(frozen=True)
class UserFolder:
    path: Path
    how: str  # "--config-dir" | "$ZEROTUNE_CONFIG_DIR" | "found in the working directory"


def find_user_folder(config_dir: str | Path | None = None, cwd: Path | None = None) -> UserFolder | None:
    """`--config-dir`'s folder, else $ZEROTUNE_CONFIG_DIR's (either must exist), else ./zerotune/ if any."""
    named = [(config_dir, "--config-dir"), (os.environ.get(CONFIG_DIR_ENV) or None, f"${CONFIG_DIR_ENV}")]
    for value, how in named:
        if value is None:
            continue
        path = Path(value).expanduser().resolve()
        if not path.is_dir():
            key = how.lstrip("$")
            raise ConfigError(key, f"{value} is not a folder",
                              f"create it (mkdir -p {value}) or name an existing folder of configs")
        return UserFolder(path, how)
    found = (cwd or Path.cwd()) / USER_FOLDER
    # A zerotune/ holding __init__.py is the package's source (a checkout's src/), not a folder of configs.
    if found.is_dir() and not (found / "__init__.py").exists():
        return UserFolder(found.resolve(), "found in the working directory")
    return None


@dataclass(frozen=True)
class ConfigSearch:
    """The folders configs come from, in the order Hydra searches them."""

    user: UserFolder | None = None

    def folders(self) -> list[Path]:
        user = [self.user.path] if self.user else []
        return [*user, *(packaged_folder(package) for package in PACKAGED)]

    def group_options(self) -> dict[str, list[str]]:
        """{group: [option, ...]} over every folder (experiment included), sorted by group."""
        options: dict[str, set[str]] = {}
        for folder in self.folders():
            for group in folder.iterdir():
                if group.is_dir() and group.name not in NOT_GROUPS:
                    options.setdefault(group.name, set()).update(p.stem for p in group.glob("*.yaml"))
        return {group: sorted(names) for group, names in sorted(options.items())}

    def option_file(self, group: str, option: str) -> Path | None:
        """The file Hydra reads for `group=option`: the first folder's."""
        for folder in self.folders():
            if (folder / group / f"{option}.yaml").is_file():
                return folder / group / f"{option}.yaml"
        return None

    def shadowed(self) -> list[tuple[Path, Path]]:
        """(the user's file, the packaged file it is used in place of), for every name in both."""
        if self.user is None:
            return []
        pairs = []
        for mine in sorted(self.user.path.rglob("*.yaml")):
            relative = mine.relative_to(self.user.path)
            for folder in self.folders()[1:]:
                if (folder / relative).is_file():
                    pairs.append((mine, folder / relative))
                    break
        return pairs

    def experiments_folder(self, cwd: Path | None = None) -> Path:
        """Where a new experiment is written: the user's experiment/ folder (./zerotune/experiment/ when the
        user has no folder yet), never the installed package."""
        root = self.user.path if self.user else (cwd or Path.cwd()) / USER_FOLDER
        return root / "experiment"

    def describe(self) -> dict:
        """For summary.json's config_sources and `zerotune doctor`; the search path as Hydra shows it
        (`--info searchpath`), less Hydra's own entries."""
        user = [f"file://{self.user.path}"] if self.user else []
        return {"user_folder": {"path": str(self.user.path), "how": self.user.how} if self.user else None,
                "search_path": [*user, *(f"pkg://{package}" for package in PACKAGED)],
                "shadowed": [{"yours": str(mine), "packaged": str(theirs)} for mine, theirs in self.shadowed()]}


_chosen: ConfigSearch | None = None
_warned: set[tuple[Path, Path]] = set()


def add_config_dir_option(parser) -> None:
    """`--config-dir DIR` on an argparse command, as `zerotune train` takes it."""
    parser.add_argument("--config-dir", "-cd", default=None, metavar="DIR", help="your own configs and "
                        "experiments, searched before the packaged ones (default: ./zerotune/)")


def choose(config_dir: str | Path | None) -> ConfigSearch:
    """A command's `--config-dir`, for this process and those it starts (through the environment). Without one
    ./zerotune/ is looked for at each use; a bad $ZEROTUNE_CONFIG_DIR is refused here all the same."""
    global _chosen
    search = ConfigSearch(find_user_folder(config_dir))
    if config_dir is not None:
        assert search.user is not None  # a named folder is found, or refused above
        _chosen = search
        os.environ[CONFIG_DIR_ENV] = str(search.user.path)
    return search


def choose_and_warn(config_dir: str | Path | None) -> ConfigSearch:
    """A command's start: its folder chosen, and any packaged option it hides named (once per process and
    pair: the user's file is used in place of a packaged one of the same name)."""
    search = choose(config_dir)
    for mine, theirs in search.shadowed():
        if (mine, theirs) not in _warned:
            _warned.add((mine, theirs))
            log.warning("%s is used in place of the packaged %s (same name); rename yours to keep both",
                        mine, theirs)
    return search


def current() -> ConfigSearch:
    """The search a command chose, else the working directory's ./zerotune/ (looked for now: a folder the
    builder page just created counts)."""
    return _chosen if _chosen is not None else ConfigSearch(find_user_folder())
