"""The loss settings SDXL recipes use, each tested by its effect: Min-SNR-γ by the weights a known batch gets,
the noise offset by the noise's shift, the timestep range by the timesteps drawn, zero terminal SNR by the last
timestep's SNR. Each is off by default, and off it draws and computes exactly what a run did before."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.cli import compose_cfg, preflight, read_summary, run_cli
from tests.helpers.fixes import check_fix
from zerotune.config.errors import ConfigError
from zerotune.models.diffusion import diffusion_loss, make_sampler, min_snr_weights, noise_scheduler
from zerotune.train.distributed import global_batch_draws

SHAPE = (64, 4, 8, 8)


def schedule(*overrides: str):
    return noise_scheduler(compose_cfg(*overrides).diffusion)


class FixedPrediction:
    """A U-Net stand-in whose prediction is a fixed tensor: the loss then depends on the target and weights only."""

    def __init__(self, pred: torch.Tensor) -> None:
        self.pred = pred

    def __call__(self, noisy, t, **cond):
        return SimpleNamespace(sample=self.pred)


def test_the_defaults_change_nothing():
    diff = compose_cfg().diffusion
    assert (diff.noise_offset, diff.min_snr_gamma, diff.timestep_range, diff.rescale_betas_zero_snr) == (
        0.0, None, None, False)
    gen = torch.Generator().manual_seed(7)
    drawn = global_batch_draws(gen, SHAPE, 0, 1, 1000, 0.1)
    by_hand = torch.Generator().manual_seed(7)  # the order a run always drew in: dropout, noise, timesteps
    uniform, noise = torch.rand(SHAPE[0], generator=by_hand), torch.randn(SHAPE, generator=by_hand)
    timesteps = torch.randint(0, 1000, (SHAPE[0],), generator=by_hand)
    assert torch.equal(drawn["uniform"], uniform) and torch.equal(drawn["noise"], noise)
    assert torch.equal(drawn["timesteps"], timesteps)
    assert torch.equal(gen.get_state(), by_hand.get_state())  # and nothing more: the next step draws as before


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_min_snr_weights_a_known_batch_as_the_paper_does(prediction):
    sched = schedule(f"model.prediction_type={prediction}")
    timesteps = torch.tensor([0, 100, 500, 999])
    abar = sched.alphas_cumprod[timesteps].double()
    snr = abar / (1 - abar)
    expected = torch.minimum(snr, torch.tensor(5.0, dtype=torch.float64)) / (
        snr + 1 if prediction == "v_prediction" else snr)
    weights = min_snr_weights(sched, timesteps, 5.0)
    torch.testing.assert_close(weights.double(), expected, rtol=1e-5, atol=0)
    assert weights[0] < weights[-1] if prediction == "epsilon" else weights[-1] < 1  # low-noise steps count less

    gen = torch.Generator().manual_seed(0)
    x0, noise, pred = (torch.randn(4, 4, 8, 8, generator=gen) for _ in range(3))
    unet = FixedPrediction(pred)
    target = noise if prediction == "epsilon" else sched.get_velocity(x0, noise, timesteps)
    per_sample = ((pred - target) ** 2).mean(dim=(1, 2, 3))
    weighted = diffusion_loss(unet, x0, {}, sched, gen, torch.float32, noise=noise, timesteps=timesteps,
                              min_snr_gamma=5.0)
    torch.testing.assert_close(weighted, (per_sample * weights).mean())
    plain = diffusion_loss(unet, x0, {}, sched, gen, torch.float32, noise=noise, timesteps=timesteps)
    assert torch.equal(plain, F.mse_loss(pred, target))  # off: the unweighted mean, as before


def test_the_noise_offset_shifts_each_image_and_channel_by_one_draw():
    plain = global_batch_draws(torch.Generator().manual_seed(3), SHAPE, 0, 1, 1000, 0.1)
    offset = global_batch_draws(torch.Generator().manual_seed(3), SHAPE, 0, 1, 1000, 0.1, noise_offset=0.1)
    shift = offset["noise"] - plain["noise"]
    per_channel = shift.mean(dim=(2, 3), keepdim=True)
    torch.testing.assert_close(shift, per_channel.expand_as(shift))  # one value per image and channel
    assert 0.08 < per_channel.std().item() < 0.12  # offset × N(0, 1): 256 draws of std 0.1
    assert torch.equal(offset["timesteps"], plain["timesteps"])  # drawn after the timesteps: nothing else moves


def test_the_offset_and_the_timesteps_are_the_global_batchs_whatever_the_process_count():
    one = global_batch_draws(torch.Generator().manual_seed(5), SHAPE, 0, 1, 1000, 0.1, noise_offset=0.1,
                             timestep_range=(10, 20))
    half = (SHAPE[0] // 2, *SHAPE[1:])
    ranks = [global_batch_draws(torch.Generator().manual_seed(5), half, r, 2, 1000, 0.1, noise_offset=0.1,
                                timestep_range=(10, 20)) for r in (0, 1)]
    for key in ("noise", "timesteps"):
        assert torch.equal(torch.cat([r[key] for r in ranks]), one[key])


def test_the_timesteps_drawn_stay_in_the_range_and_reach_both_ends():
    drawn = global_batch_draws(torch.Generator().manual_seed(1), (4096, 1, 1, 1), 0, 1, 1000, 0.0,
                               timestep_range=(100, 199))["timesteps"]
    assert drawn.min().item() == 100 and drawn.max().item() == 199
    every = global_batch_draws(torch.Generator().manual_seed(1), (8192, 1, 1, 1), 0, 1, 1000, 0.0)["timesteps"]
    assert every.min().item() == 0 and every.max().item() == 999


def test_zero_terminal_snr_makes_the_last_timestep_pure_noise_and_samples_from_it():
    from diffusers.training_utils import compute_snr

    rescaled = schedule("diffusion.rescale_betas_zero_snr=true")
    last = torch.tensor([999])
    assert rescaled.alphas_cumprod[-1].item() == 0 and compute_snr(rescaled, last).item() == 0
    assert compute_snr(schedule(), last).item() > 0  # the default keeps some signal at the last step
    sampler = make_sampler(dict(rescaled.config), "v_prediction")
    sampler.set_timesteps(20)
    assert sampler.config.timestep_spacing == "trailing" and int(sampler.timesteps[0]) == 999
    default = make_sampler(dict(schedule().config), "v_prediction")
    assert default.config.timestep_spacing == "linspace"


def refused(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        preflight(compose_cfg(*overrides), overrides=list(overrides))
    assert check_fix(err.value, list(overrides), lambda fixed: preflight(compose_cfg(*fixed), overrides=fixed)) >= 1
    return err.value


@pytest.mark.parametrize(("override", "key"), [
    ("diffusion.noise_offset=-0.1", "diffusion.noise_offset"),
    ("diffusion.noise_offset=2", "diffusion.noise_offset"),
    ("diffusion.min_snr_gamma=0", "diffusion.min_snr_gamma"),
    ("diffusion.timestep_range=[500,100]", "diffusion.timestep_range"),
    ("diffusion.timestep_range=[0,1000]", "diffusion.timestep_range"),
    ("diffusion.timestep_range=[5]", "diffusion.timestep_range"),
])
def test_a_bad_setting_is_refused_naming_its_key_with_a_fix_that_works(override, key):
    assert refused("train.max_steps=2", override).key == key


def test_zero_terminal_snr_on_an_epsilon_model_is_refused_with_a_fix_that_works():
    err = refused("model.prediction_type=epsilon", "diffusion.rescale_betas_zero_snr=true")
    assert err.key == "diffusion.rescale_betas_zero_snr" and "v_prediction" in err.fix


def test_a_job_trains_and_samples_with_every_setting_on(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli("train.max_steps=3", "train.batch_size=8", "evaluate.per_class=1", "evaluate.steps=2",
                   "diffusion.noise_offset=0.05", "diffusion.min_snr_gamma=5", "diffusion.timestep_range=[0,499]",
                   "diffusion.rescale_betas_zero_snr=true", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "ok" and summary["steps"] == 3
    resolved = (run_dir / "config.yaml").read_text()
    assert "min_snr_gamma: 5" in resolved and "rescale_betas_zero_snr: true" in resolved
