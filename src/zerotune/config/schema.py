"""The config tree's types, the schema of conf/config.yaml: a wrong type (`train.batch_size=abc`) or an unknown key
(`train.batchsize=4`) fails at composition, naming the key. A group whose options differ in their keys has one
dataclass holding every option's keys. Also the units every part shares: bytes per MiB and per element."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, OmegaConf


@dataclass(frozen=True)
class Checkpoint:
    every_n_steps: int = 0
    final: bool = True                   # a run that completes its steps saves its last one
    keep_last: int = 3
    dir: str | None = None
    on_signal: bool = False              # SIGTERM/SIGINT/SIGHUP/SIGUSR1/SIGUSR2: save before stopping


@dataclass(frozen=True)
class Plan:
    only: bool = False                   # predict the job's memory and time floor, train nothing
    gpu: str | None = None            # the card to plan for (plan/gpus.py); null: the one present, if any
    gpu_mib: int | None = None        # or just its memory
    host_mib: int | None = None       # host memory this node's job may use; null: what the host has available
    # A predicted peak above a GPU's free memory or the host's available memory (on a CPU accelerator the device's
    # memory is host memory): refuse | warn | skip
    guard: str = "refuse"


@dataclass(frozen=True)
class Resume:
    path: str | None = None           # `resume=<path>` on the command line is short for resume.path
    strict: bool = False                 # a damaged newest checkpoint: stop (true) or use the previous one


@dataclass(frozen=True)
class Launch:
    num_processes: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: Any = "auto"            # auto | port
    rdzv_timeout_s: float = 900
    collective_timeout_s: float = 1800   # a collective waiting this long on a lost or hung peer fails the job
    slurm: Any = "auto"                  # auto | true | false
    run_id: str | None = None         # set inside SLURM jobs
    stop_grace_s: int = 120              # after a stop signal, how long workers get to finish their step and save
    threads: Any = "auto"                # auto | N: torch intra-op threads per worker (train/distributed.py)


@dataclass(frozen=True)
class Debug:
    fail_at_step: int | None = None
    fail_rank: int | None = None
    oom_at_step: int | None = None
    hang_at_step: int | None = None
    kill_at_step: int | None = None
    host_alloc_mib: int | None = None
    validation_oom_at_step: int | None = None


@dataclass(frozen=True)
class Trial:
    """What hydra/sweeper=tune sets on each of its jobs (zerotune/tune); null outside a tune sweep. The job
    reports its samples/s at each rung to the study's Optuna journal, which may stop it there (status pruned)."""
    storage: str | None = None        # the study's journal file
    study: str | None = None          # the study's name in it
    number: int | None = None         # this job's Optuna trial number
    warmup_steps: int = 3                # steps left out of samples/s (compilation, allocator growth, caches)
    min_steps: int = 4                   # rung 0: timed steps after the warm-up
    reduction_factor: int = 3            # each rung is this many times longer; 1/this of the trials go on
    pruner: str = "successive_halving"   # successive_halving | hyperband (Optuna's) | none
    max_steps: int = 12                  # timed steps of a trial that is never stopped
    # the least relative spread a rung's figure is given (what moves a whole run, which the steps' own spread
    # cannot show): successive_halving stops a trial only when it is behind by more than the spreads
    min_spread: float = 0.10


@dataclass(frozen=True)
class Report:
    budget_mib: float = 24576
    metric: str = "gpu"
    where: Any = None                    # {key: value}, as repeats


ATTENTION_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")
CLIP_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")  # a CLIP text encoder's, as diffusers' LoRA scripts target


@dataclass(frozen=True)
class ZeroStage:
    stage: int = 2


@dataclass(frozen=True)
class Offload:
    device: str = "none"                 # none | cpu | nvme
    params: Any = False                  # auto | true | false
    path: str | None = None
    pin_memory: bool = True
    buffer_count: int = 5
    buffer_size: Any = "auto"            # auto | elements
    max_in_cpu: int = 1_000_000_000


@dataclass(frozen=True)
class Optimizer:
    name: str = "adamw"
    lr: float = 1e-4
    betas: list[float] | None = None
    eps: float | None = None
    weight_decay: float | None = None
    momentum: float | None = None     # musgd, sgd
    nesterov: bool | None = None      # sgd
    beta1: float | None = None        # adafactor: null keeps no first moment
    clip_threshold: float | None = None  # adafactor
    decay_rate: float | None = None   # adafactor
    scale_parameter: bool | None = None  # adafactor


@dataclass(frozen=True)
class Scheduler:
    name: str = "warmup"
    warmup_steps: int = 0
    min_lr: float = 0.0
    warmup_type: str = "linear"          # linear | log
    warmup_min_ratio: float = 0.0
    cos_min_ratio: float = 0.01
    div_factor: float = 25.0             # onecycle


@dataclass(frozen=True)
class Resolution:
    size: int = 128


@dataclass(frozen=True)
class Model:
    name: str = MISSING
    backbone: str = "unet"               # unet | flux | sd3: the network family (models/backbones.py)
    unet: dict[str, Any] = field(default_factory=dict)   # diffusers UNet2DConditionModel's arguments
    # flux | sd3: diffusers FluxTransformer2DModel's or SD3Transformer2DModel's arguments
    transformer: dict[str, Any] = field(default_factory=dict)
    # flow_matching: FlowMatchEulerDiscreteScheduler's arguments, as the pipeline's scheduler/ folder holds them
    scheduler: dict[str, Any] = field(default_factory=dict)
    vae_scale_factor: int = 1
    # class | text (SD 1.x/2.x) | text_time (SDXL) | text_pooled (FLUX.1, SD3: token states + a pooled embedding)
    conditioning: str = "class"
    prediction_type: str = "epsilon"     # epsilon | v_prediction | flow_matching (FLUX.1, SD3)
    attention: str = "default"           # default | sdpa
    num_classes: int = 10
    text_seq_len: int = 77               # tokens of the text condition (FLUX.1, SD3: data.max_sequence_length sets T5's)
    clip_tokens: int = 0                 # SD3: CLIP's tokens ahead of T5's in the condition (its tokenizers' 77)
    pretrained: str | None = None
    # the modules adapter=lora targets unless adapter.target_modules says otherwise: the attention projections
    lora_targets: list[str] = field(default_factory=lambda: list(ATTENTION_PROJECTIONS))
    components: str | None = None
    vae: str | None = None
    text_encoder: str | None = None
    text_encoder_2: str | None = None
    tokenizer: str | None = None
    tokenizer_2: str | None = None
    text_encoder_3: str | None = None    # SD3's T5-XXL (FLUX.1's T5 is text_encoder_2)
    tokenizer_3: str | None = None
    train_text_encoder: str = "none"     # none | te1 | te2 | both (te2 and both: SDXL); full, or LoRA with adapter=lora
    text_encoder_lr: float | None = None    # text_encoder's parameter group; null: optimizer.lr
    text_encoder_2_lr: float | None = None  # text_encoder_2's


@dataclass(frozen=True)
class Data:
    name: str = MISSING                  # digits | synthetic | folder
    invert: bool = False                 # digits: ink and paper swapped (x -> 16 - x); others refuse it
    num_workers: int = 0
    num_samples: int = 4096              # synthetic
    path: str | None = None           # folder
    repeats: Any = None                  # {subfolder: n}; Any: a free-form map Hydra can assign whole
    cache_dir: str | None = None
    random_flip: bool = False
    upscale_small: bool = False
    bucket_step: int = 64
    bucket_max_ratio: float = 4.0
    cache_batch_size: int = 8
    cache_device: str = "auto"
    # folder: the loss weighted by each image's mask (<stem>.mask.png, else its alpha channel), as kohya's
    masked_loss: bool = False
    # folder: caption rules (data/captions.py)
    caption_dropout: float = 0.0         # chance a sample trains on the empty caption (cached once)
    shuffle_tags: bool = False           # shuffle each caption's tags (split at tag_separator)
    keep_tags: int = 0                   # the first N tags stay first, in order
    tag_separator: str = ","
    caption_variants: int | None = None  # shuffles cached per caption; null: 4 with shuffle_tags
    # FLUX.1, SD3: T5's tokens per caption and prompt (null: the model's, FLUX.1-dev 512, SD3 256); the text
    # condition is model.clip_tokens + these (config/compose/settle.py)
    max_sequence_length: int | None = None


@dataclass(frozen=True)
class Precision:
    name: str = "fp32"                   # fp32 | bf16 | fp16
    initial_scale_power: int = 16        # fp16's loss scaling (DeepSpeed's defaults)
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass(frozen=True)
class Logger:
    name: str = "none"                   # none | wandb | tensorboard | all (W&B and TensorBoard)
    project: str = "zerotune"
    entity: str | None = None
    mode: str = "offline"
    tags: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Train:
    batch_size: int = 64
    grad_accum: int = 1
    max_steps: int = 1500
    seed: int = 0
    grad_clip: float = 1.0
    gradient_checkpointing: bool = False
    log_every: int = 25
    deterministic: bool = True
    timeout_s: float | None = None


@dataclass(frozen=True)
class Diffusion:
    num_train_timesteps: int = 1000
    beta_schedule: str = "scaled_linear"
    beta_start: float = 0.00085
    beta_end: float = 0.012
    prediction_type: str = "epsilon"
    cond_dropout: float = 0.1
    noise_offset: float = 0.0                    # 0: off
    min_snr_gamma: float | None = None        # None: off
    timestep_range: list[int] | None = None   # [first, last] inclusive; None: every timestep
    rescale_betas_zero_snr: bool = False
    # flow matching (models/flow_matching.py): how timesteps are drawn and the loss weighted
    weighting_scheme: str = "none"       # none | logit_normal | mode | cosmap | sigma_sqrt
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    precondition_outputs: bool = False   # SD3's script's EDM preconditioning: the loss on the predicted clean latents
    guidance_scale: float = 3.5          # FLUX.1-dev: the distilled guidance its embedding is given while training


@dataclass(frozen=True)
class Evaluate:
    enabled: bool = True
    per_class: int = 50
    steps: int = 20
    guidance_scale: float = 3.0


@dataclass(frozen=True)
class Validation:
    """Prompts sampled with the weights being trained (text models; src/zerotune/validation/)."""
    prompts: list[str] = field(default_factory=list)
    prompt_file: str | None = None    # .txt (one per line, kohya's --n/--d), .jsonl, or .json
    negative_prompt: str = ""            # for prompts that name none; "" samples against the null condition
    every_n_steps: int = 0               # 0: at the start and the end only
    at_start: bool = True                # step 0: the untrained baseline
    at_end: bool = True
    seed: int = 0                        # prompt i draws its noise from seed + i (unless its line names one)
    resolution: Any = None               # null: resolution.size; a side, or [width, height]
    steps: int = 20
    guidance_scale: float = 5.0
    guidance_rescale: float = 0.0        # 0.7 with zero terminal SNR (Lin et al. 2023)
    weights: str = "auto"                # auto | model | ema | comparison
    strict: bool = False                 # a failing pass stops the run instead of being recorded


@dataclass(frozen=True)
class Adapter:
    name: str = "none"                   # none | lora | loha | lokr
    rank: int = 16
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(ATTENTION_PROJECTIONS))
    init: str = "gaussian"               # gaussian | default (LoHa, LoKr: default only)
    dora: bool = False                   # lora: DoRA (a learned magnitude per output, Liu et al. 2024)
    # with model.train_text_encoder: the modules of each trained text encoder that get adapters
    text_encoder_target_modules: list[str] = field(default_factory=lambda: list(CLIP_ATTENTION_PROJECTIONS))


@dataclass(frozen=True)
class Ema:
    enabled: bool = False
    decay: float = 0.999
    warmup: bool = True
    use_for_samples: bool = True


@dataclass(frozen=True)
class DeepSpeed:
    enabled: Any = "auto"                # auto | true | false
    config_file: str | None = None
    reduce_bucket_size: Any = "auto"     # auto | elements
    allgather_bucket_size: Any = "auto"
    stage3_prefetch_bucket_size: Any = "auto"
    stage3_param_persistence_threshold: int = 100_000
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    torch_adam: Any = "auto"             # auto | true | false
    param_groups: Any = "auto"           # auto | K: the trained parameters in K contiguous optimizer groups
    stage3_gather_16bit_weights_on_model_save: bool = True


@dataclass(frozen=True)
class Accelerate:
    config_file: str | None = "auto"


@dataclass(frozen=True)
class Config:
    zero_stage: ZeroStage = field(default_factory=ZeroStage)
    offload: Offload = field(default_factory=Offload)
    optimizer: Optimizer = field(default_factory=Optimizer)
    scheduler: Scheduler = field(default_factory=Scheduler)
    resolution: Resolution = field(default_factory=Resolution)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    precision: Precision = field(default_factory=Precision)
    logger: Logger = field(default_factory=Logger)
    train: Train = field(default_factory=Train)
    diffusion: Diffusion = field(default_factory=Diffusion)
    evaluate: Evaluate = field(default_factory=Evaluate)
    validation: Validation = field(default_factory=Validation)
    adapter: Adapter = field(default_factory=Adapter)
    ema: Ema = field(default_factory=Ema)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    resume: Resume = field(default_factory=Resume)
    plan: Plan = field(default_factory=Plan)
    deepspeed: DeepSpeed = field(default_factory=DeepSpeed)
    accelerate: Accelerate = field(default_factory=Accelerate)
    launch: Launch = field(default_factory=Launch)
    debug: Debug = field(default_factory=Debug)
    report: Report = field(default_factory=Report)
    trial: Trial = field(default_factory=Trial)
    # An experiment's reference figures. {} rather than None: Hydra cannot apply an override (reference.name=x,
    # a builder form's reference={...}) onto a None node; null stays accepted (older run folders).
    reference: dict[str, Any] | None = field(default_factory=dict)


def launch_world_size(launch: Launch) -> int:
    """The processes a job will start: per node x nodes. (A running rank reads its launcher's WORLD_SIZE
    instead: training.distributed.world_size.)"""
    return launch.num_processes * launch.nnodes


def as_dict(block: Any) -> dict[str, Any]:
    """A config block (a frozen dataclass, or the whole Config) as a plain dict; one still in OmegaConf's form
    is converted the same way (values resolved)."""
    if dataclasses.is_dataclass(block) and not isinstance(block, type):
        return dataclasses.asdict(block)
    return OmegaConf.to_container(block, resolve=True)  # type: ignore[return-value]


def describe(key: str) -> tuple[bool, str | None, Any]:
    """(key exists, its type as written here, its default). Keys inside a dict-typed field (model.unet.*,
    reference.*) exist whatever their name."""
    node: Any = Config
    annotation, default = "Config", None
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            return annotation.startswith(("dict", "Optional[dict", "Any")), None, None
        found = {f.name: f for f in dataclasses.fields(node)}.get(part)
        if found is None:
            return False, None, None
        annotation = str(found.type)
        default = found.default if found.default is not dataclasses.MISSING else None
        node = found.default_factory() if found.default_factory is not dataclasses.MISSING else found.default
        node = type(node) if dataclasses.is_dataclass(node) else node
    return True, annotation, default


def keys_under(key: str) -> list[str]:
    """The names a dataclass node accepts ('' for the root)."""
    node: Any = Config
    for part in [p for p in key.split(".") if p]:
        found = {f.name: f for f in dataclasses.fields(node)}.get(part)
        if found is None or found.default_factory is dataclasses.MISSING:
            return []
        node = type(found.default_factory())
        if not dataclasses.is_dataclass(node):
            return []
    return [f.name for f in dataclasses.fields(node)]


MIB = 2**20
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
