"""`hydra/sweeper=tune` (conf/hydra/sweeper/tune.yaml): the fastest configuration that fits, by measured trials
under Optuna's successive halving (zerotune/tune). Hydra takes sweepers from the hydra_plugins package only;
the work is zerotune.tune's, this class hands it Hydra's launcher and composer.

hydra-optuna-sweeper is not used: its 1.3.0 requires optuna<3, and it tells Optuna only each job's final value,
so it cannot stop a trial at a rung, nor drop a configuration before it runs."""

# No `from __future__ import annotations`: Hydra executes this module without registering it in sys.modules.
import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.override_parser.types import Override
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, RunMode, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

if TYPE_CHECKING:
    from zerotune.config.compose.settle import Settled


class TuneSweeper(Sweeper):
    def __init__(self, **params: Any) -> None:
        super().__init__()
        self.params = params
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.launcher: Launcher | None = None
        self._by_groups: dict[tuple[str, ...], DictConfig] = {}  # _compose's cache: group overrides -> composed

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        from zerotune.config.errors import ConfigError, exit_config_error
        from zerotune.tune.space import read_settings
        from zerotune.tune.sweep import tune_sweep

        assert self.config is not None, "Hydra calls setup before sweep"
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        try:
            settings = read_settings(_plain(self.params))
            outcome = tune_sweep(settings, list(arguments), self._settle, self._launch, sweep_dir)
        except ConfigError as exc:
            exit_config_error(exc)
        return outcome

    def _settle(self, overrides: list[str]) -> "Settled":
        """The job's config as it will run (the user's files folded in), for the screen and the trials' batch."""
        from zerotune.config.compose.settle import settle

        return settle(self._compose(overrides), overrides)

    def _compose(self, overrides: list[str]) -> DictConfig:
        """The config `overrides` compose to, as a job of this sweep would get it. Composed by Hydra once per set
        of group choices (zero_stage, offload ...), the rest applied by Hydra's own step for value overrides:
        the screen composes every candidate, and Hydra's defaults tree is 0.17 s each (10 s of 12 for 60
        candidates), though the candidates differ in two or three groups."""
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from zerotune.config import search
        from zerotune.config.compose import check_resolves
        from zerotune.config.compose.overrides import normalize_overrides, typed_line

        assert self.config is not None and self.hydra_context is not None, "Hydra calls setup before sweep"
        args = normalize_overrides(list(overrides), search.current())
        loader = self.hydra_context.config_loader
        assert isinstance(loader, ConfigLoaderImpl)  # Hydra's one loader: its repository knows the groups
        # Hydra's own split (defaults_list.Overrides): a group's key, unless its value is a dict, picks a config
        # of the defaults list; any other override is applied to the composed config, in order, after it.
        picks: list[Override] = []
        values: list[Override] = []
        for o in OverridesParser.create().parse_overrides(args):
            is_pick = loader.repository.group_exists(o.key_or_group) and not isinstance(o.value(), dict)
            (picks if is_pick else values).append(o)
        key = tuple(typed_line(o) for o in picks)
        if key not in self._by_groups:
            self._by_groups[key] = loader.load_configuration(
                config_name=self.config.hydra.job.config_name, overrides=list(key), run_mode=RunMode.MULTIRUN)
        cfg = copy.deepcopy(self._by_groups[key])
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)  # noqa: SLF001  what load_configuration applies
        with open_dict(cfg):
            del cfg["hydra"]
        check_resolves(cfg, args)
        return cfg

    def _launch(self, overrides: list[str], job: int) -> Path:
        from zerotune.config import search
        from zerotune.config.compose.overrides import normalize_overrides

        assert self.launcher is not None, "Hydra calls setup before sweep"
        args = normalize_overrides(list(overrides), search.current())
        returned: JobReturn = self.launcher.launch([args], initial_job_idx=job)[0]
        assert returned.hydra_cfg is not None, "a launcher returns each job's Hydra config"
        return Path(returned.hydra_cfg.hydra.runtime.output_dir)


def _plain(params: dict[str, Any]) -> dict[str, Any]:
    return {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for k, v in params.items()}
