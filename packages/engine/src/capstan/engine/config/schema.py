"""The typed training configuration: one frozen, keyword-only dataclass per section.

Each field has a docstring (the string literal under it, which `doc`
turns into docs/config.md) and its constraints in `field(metadata=...)`
(checked by `load`, which is the only way configs are read from files,
dicts or ``--set`` overrides). This module imports nothing heavy (no torch),
so a bad config is rejected within a fraction of a second.

Example::

    from capstan.engine.config import Config, ModelConfig
    cfg = Config(model=ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64))
    cfg.derived(world_size=1)["global_batch"]
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "Config", "ModelConfig", "DataConfig", "TrainConfig", "ParallelConfig", "MemoryConfig",
    "PrecisionConfig", "CheckpointConfig", "LogConfig", "SECTIONS", "MOMENT_BYTES", "constraint",
]


def constraint(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
               lt: float | None = None, choices: tuple[Any, ...] | None = None, nullable: bool = False,
               size: bool = False) -> Any:
    """A dataclass field with its range/choices, checked by the loader (`load.check_value`). `size`: a
    number of bytes, also written with a unit ("512MiB", "4GiB", "1.5GB")."""
    meta = {"ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "nullable": nullable, "size": size}
    return field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The reference GPT (capstan.tensorpar.build_gpt); ignored when a user model is passed."""

    n_layers: int = constraint(2, ge=1)
    """Transformer blocks."""
    n_heads: int = constraint(4, ge=1)
    """Attention heads; must divide by parallel.tp."""
    d_model: int = constraint(64, ge=1)
    """Hidden size; must divide by n_heads."""
    seq_len: int = constraint(64, ge=2)
    """Tokens per training sequence (and rows of the position embedding)."""
    vocab_size: int = constraint(256, ge=2)
    """Token ids; at least the tokenizer's vocabulary (256 for "byte"; for "bpe", the vocabulary it trains), need not divide by tp."""
    dropout: float = constraint(0.0, ge=0.0, lt=1.0)
    """Dropout on embeddings, attention probabilities and residual branches."""
    hf: str | None = constraint(None, nullable=True)
    """Train a Hugging Face transformers causal LM instead of the reference GPT: a directory holding its config.json (and, to fine-tune, its weights, loaded with from_pretrained; without weights it starts from the model's own random initialization) or a config.json file. The layer/size keys above are then the model's; seq_len still sets the training sequences. Needs the transformers package (capstan-engine[hf]); tp, pp, offload and export --format hf work as for a model passed to initialize (docs/engine.md)."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where training text comes from and how it becomes token ids."""

    source: str = "stdlib"
    """"stdlib" (the running Python's standard library source, on every machine), a text file, a folder of text files, a JSON Lines file (`.jsonl`: the text_field of each record, documents packed into one stream), Parquet (a `.parquet` file or a folder of them) or a folder written by the datasets library's save_to_disk (both: the text_field column; need capstan-engine[hf]), or a pre-tokenized `.bin` file. Your own torch Dataset or iterable goes through `capstan.engine.dataset_batches` (docs/engine.md)."""
    text_field: str = "text"
    """The field of each `.jsonl` record (the column of a Parquet or datasets source) that holds its text."""
    tokenizer: str = constraint("byte", choices=("byte", "bpe"))
    """Text to ids: "byte" maps each UTF-8 byte to its value (vocabulary 256); "bpe" is a byte-level BPE with model.vocab_size ids (more than 256), trained deterministically on the training split and saved as log.run_dir/tokenizer.json (needs the tokenizers package: capstan-engine[bpe]). Not used for `.bin`."""
    tokenizer_file: str | None = constraint(None, nullable=True)
    """With tokenizer = "bpe": load this tokenizer.json (a previous run's, or a pretrained tokenizer's), or the tokenizer.json in this folder (a transformers model or tokenizer saved with save_pretrained), instead of training one; it is copied to log.run_dir. Unset: on checkpoint.resume, reuse log.run_dir/tokenizer.json if present, else train."""
    bin_dtype: str = constraint("uint16", choices=("uint16", "uint32"))
    """Element type of a pre-tokenized `.bin` file (a flat array of token ids)."""
    max_bytes: int = constraint(4_000_000, ge=1024)
    """Read at most this many bytes of text (keeps the default corpus quick to load)."""
    val_fraction: float = constraint(0.05, gt=0.0, lt=0.5)
    """Fraction of the tokens, at the end of the stream, held out for validation."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimization: AdamW with warmup and a decay schedule."""

    steps: int = constraint(50, ge=1)
    """Optimizer steps to run."""
    micro_batch_size: int = constraint(8, ge=1)
    """Sequences per forward/backward on each data-parallel rank."""
    grad_accum_steps: int = constraint(1, ge=1)
    """Micro-batches accumulated per optimizer step."""
    lr: float = constraint(1e-3, gt=0.0)
    """Peak learning rate (reached at the end of warmup)."""
    min_lr: float = constraint(1e-4, ge=0.0)
    """Learning rate at the end of the decay; at most lr."""
    warmup_steps: int = constraint(5, ge=0)
    """Steps of linear warmup from lr / warmup_steps to lr; less than steps."""
    lr_schedule: str = constraint("cosine", choices=("cosine", "linear", "constant"))
    """Decay from lr to min_lr after warmup ("constant" stays at lr)."""
    weight_decay: float = constraint(0.1, ge=0.0)
    """AdamW decoupled weight decay, applied to matrices (parameters with 2 or more dimensions) only, not to biases and norms."""
    beta1: float = constraint(0.9, ge=0.0, lt=1.0)
    """AdamW first-moment decay."""
    beta2: float = constraint(0.95, ge=0.0, lt=1.0)
    """AdamW second-moment decay."""
    eps: float = constraint(1e-8, gt=0.0)
    """AdamW denominator epsilon."""
    grad_clip: float = constraint(1.0, ge=0.0)
    """Clip the global gradient norm to this value (0 disables clipping; the norm is still reported)."""
    seed: int = constraint(1234, ge=0)
    """Seeds the model's initialization, dropout and the order of training sequences."""
    eval_every: int = constraint(0, ge=0)
    """Compute the validation loss every this many steps and at the end (0: never)."""
    eval_batches: int = constraint(4, ge=1)
    """Micro-batches per data-parallel rank in one validation pass."""
    device: str = constraint("auto", choices=("auto", "cpu", "cuda", "standin"))
    """Where forward and backward run: "cuda" puts each rank on GPU cuda:<local rank> (ranks share GPUs round-robin when there are more ranks than GPUs; their CUDA tensors then communicate through host memory instead of NCCL); "cpu" keeps everything on the CPU; "auto" is "cuda" where torch sees a GPU, else "cpu"; "standin" is the CPU test suite's stand-in accelerator (capstan.native.standin, loaded by the tests that use it), which runs the GPU path on host memory. Without chunked memory the optimizer runs on the same device; with it (memory.offload or ZeRO-3) parameter chunks compute on the GPU within memory.gpu_budget while masters and Adam moments stay in RAM or on disk and the CPU steps them (docs/gpu.md)."""


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The dp x pp x cp x tp layout; dp * pp * cp * tp must equal the number of processes."""

    dp: int = constraint(0, ge=0)
    """Data-parallel replicas; 0 means world size / (tp * pp * cp)."""
    tp: int = constraint(1, ge=1)
    """Tensor-parallel ranks per replica (Megatron-style slicing of every layer)."""
    pp: int = constraint(1, ge=1)
    """Pipeline stages: the reference GPT's layers are partitioned by parameter count and each rank builds only its stage; the grad_accum_steps micro-batches are the pipeline's microbatches. Works with every zero_stage and offload: each stage's chunks have their own chunk manager (docs/parallelism.md)."""
    cp: int = constraint(1, ge=1)
    """Context-parallel ranks per replica: every sequence is split over them, each computing its tokens, with attention across the split (cp_mode; capstan.tensorpar.context). Gradients are reduced, and ZeRO states sharded, over dp x cp. The reference GPT only; model.dropout must be 0 (docs/parallelism.md, "Long sequences")."""
    cp_mode: str = constraint("ulysses", choices=("ulysses", "ring"))
    """How attention crosses the cp ranks: "ulysses" (all-to-all from sequence-split to head-split and back: attention heads per tp rank must divide by cp, seq_len by cp) or "ring" (key/value blocks passed around the ring, online softmax, each rank holding two mirrored chunks so causal work is even: seq_len must divide by 2 x cp). docs/benchmarks.md compares the two."""
    zero_stage: int = constraint(0, ge=0, le=3)
    """0: all-reduce gradients; 1: shard optimizer state over dp; 2: also reduce-scatter gradients; 3: parameters, gradients and Adam moments in chunks sharded over dp (capstan.chunkmem; with any tp and pp)."""
    bucket_mb: float = constraint(25.0, ge=0)
    """Gradient bucket size in MiB for ZeRO 0-2 at dp > 1: each bucket's all-reduce (ZeRO 0/1, and ZeRO 2 by default) or reduce-scatter starts during backward as soon as its gradients are complete (like DDP's bucket_cap_mb). 0 turns the overlap off: one pass of collectives after backward. Under pipeline parallelism a bucket starts once its parameters have every micro-batch's gradient, during the schedule's last backwards."""
    zero2_collective: str = constraint("all_reduce", choices=("all_reduce", "reduce_scatter"))
    """How ZeRO 2's overlapped buckets are reduced over dp (this rank keeps only its shard either way): "all_reduce" (buckets filled in backward's order, ready as early as DDP's, and packed as gradients complete, so no rank ever holds the whole gradient: its 1/dp shard and at most four buckets, each capped at 1/16 of the gradient (but at least one whole parameter); twice the gradient traffic) or "reduce_scatter" (the whole flat gradient exists during backward; half the gradient traffic, for bandwidth-bound networks: at 100 Mbit/s, dp 4, 1.90 s per step against 2.79, as fast as ZeRO 0; a bucket spans the same range of every rank's shard, so it is complete later in backward, which costs overlap on a fast link; docs/benchmarks.md)."""
    overlap_param_gather: bool | None = constraint(None, nullable=True)
    """ZeRO 1/2 at dp > 1: all-gather the updated parameters in buckets of bucket_mb that the next forward waits for, module by module, instead of in one blocking all-gather after the step. Unset: on for the reference GPT, off for a user module (whose forward might read another module's parameter before that module's own hook ran; turn it on when every parameter is used only inside its own module's forward). Needs bucket_mb > 0."""
    compression: str = constraint("none", choices=("none", "onebit", "int8"))
    """Compressed data-parallel communication for slow networks (capstan.comm.ops.compress; docs/parallelism.md, "Slow networks"): "onebit" is 1-bit Adam (exact AdamW for compression_freeze_steps steps, then the variance frozen and the momentum all-reduced as signs and a scale with error feedback, ~1/32 of fp32's bytes; zero_stage 0, and with memory.offload every dp rank keeps all the chunks, the residuals among them), "int8" quantizes ZeRO's gradient reduce-scatter and parameter all-gather to int8 blocks with a scale each (ZeRO++-style, stages 1-3 and offload; the fp32 master shard stays exact). Both act on dp x cp only (nothing happens with one replica). The compressed bytes each rank sends are reported per step as comm.wire_bytes."""
    compression_freeze_steps: int = constraint(100, ge=1)
    """compression = "onebit": optimizer steps of exact AdamW before the momentum is compressed (the variance is frozen at that step: 1-bit Adam's warm-up)."""
    schedule: str = constraint("1f1b", choices=("gpipe", "1f1b", "interleaved"))
    """Pipeline schedule when pp > 1: "gpipe" (all forwards, then all backwards), "1f1b" (at most pp - stage micro-batches in flight) or "interleaved" (virtual_stages chunks per rank; grad_accum_steps must be a multiple of pp)."""
    virtual_stages: int = constraint(1, ge=1)
    """Model chunks per pipeline rank for the interleaved schedule (at least 2 there); more than 1 needs schedule = "interleaved"."""
    sequence_parallel: bool = False
    """Megatron-style sequence parallelism for the reference GPT at tp > 1: the norms, dropouts and residual stream between the tensor-parallel regions hold seq_len / tp tokens per rank instead of all of them (all-gather before, reduce-scatter after each region, the same bytes as the all-reduce it replaces), cutting that part of the activation memory by tp (0.92x of a tp = 2 rank's saved activations on a d_model 512 GPT, docs/benchmarks.md: the larger tensors inside the regions are split by tp already). Needs tp > 1 and model.seq_len divisible by tp; same training as without it (dropout masks aside)."""
    partition: str = constraint("parameters", choices=("parameters", "flops", "time", "uniform"))
    """How pp > 1 splits the layers into pp x virtual_stages contiguous parts: "parameters" (smallest largest parameter count, as DeepSpeed's default), "flops" (smallest largest forward FLOP count: the reference GPT's in closed form, 24 d^2 + 4 seq d per token per block and 2 d vocab for the head; a user pipeline's counted by torch's flop counter on a micro-batch of token ids), or "uniform" (the same number of layers each). The embedding holds parameters but computes nothing and the head both, so "flops" moves work off the last stage where the layer count lets it. "time" (smallest largest measured forward + backward time on a micro-batch, taken by the first rank and shared with all; the reference GPT's layers timed at tp = 1, one block standing for all) needs no rule about which layers cost what and picks the better of the two where they disagree."""


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """Where model states live (capstan.chunkmem when offloading)."""

    offload: str = constraint("none", choices=("none", "cpu", "disk"))
    """"none": plain tensors; "cpu": chunked, all in RAM within cpu_budget; "disk": chunked, RAM within cpu_budget and the rest on disk_dir."""
    chunk_size: int | None = constraint(None, ge=1024, nullable=True)
    """Elements per chunk; at least the largest parameter tensor. Unset: chosen per model, the size with the least padding over its chunk lists (ZeRO-3 pads each to a multiple of dp) between the largest tensor and 2^20 elements (chunkmem.auto_chunk_size); the run log names it."""
    cpu_budget: int | None = constraint(None, gt=0, nullable=True, size=True)
    """Bytes of chunks allowed in RAM per rank. Unset: unlimited, but with offload = "disk" chosen at start from the machine (logged on rank 0): 0.9 x (MemAvailable, or a memory cgroup's room where less, / the ranks on this node - the activations: the planner's estimate for the reference GPT on the CPU, none on a GPU, a quarter of the share for other models), at least the chunks' minimum (an error naming the numbers where RAM cannot hold it); see docs/engine.md, "From DeepSpeed"."""
    ram_limit: int | None = constraint(None, gt=0, nullable=True, size=True)
    """Bytes of RAM for chunks plus everything else the step allocates (activations), if set: the warm-up step runs within cpu_budget and measures that non-model memory per chunk access; later steps give chunks ram_limit minus it at each moment (docs/chunkmem.md). Needs cpu_budget <= ram_limit."""
    gpu_budget: int | None = constraint(None, gt=0, nullable=True, size=True)
    """Bytes of parameter and gradient chunks allowed on the GPU with chunked memory on a CUDA device (train.device); the rest wait in RAM (or on disk) and are copied in ahead of use. Unset: derived from the GPU: the warm-up step keeps chunks within a fifth of 90% of the free GPU memory (shared by the ranks on one GPU) while it measures the activations at every chunk access; later steps give chunks that 90% minus the activations of the moment (a warm-up that needed more is one error naming the minimum). Needs chunked memory (offload or ZeRO-3) and a CUDA device."""
    disk_dir: str = "capstan-chunks"
    """Directory for the disk tier's chunk files (one file per rank)."""
    chunk_order: str = constraint("modules", choices=("modules", "trace"))
    """How parameters are packed into chunks: "modules" in module creation order (the reference GPT's, which is its execution order), "trace" in the order one forward on a dummy batch (micro_batch_size x seq_len tokens, no gradients) first calls the modules, for a user module built in another order than it runs (fewer chunk moves under a budget). Needs parallel.pp = 1 (stages are registered in layer order)."""
    eviction: str = constraint("belady", choices=("belady", "lru"))
    """Which chunk leaves RAM first: furthest next use in the warm-up trace (belady) or least recently used."""
    overlap_optimizer: bool | None = constraint(None, nullable=True)
    """Step each chunk group on the CPU as soon as backward has produced its gradients, while backward goes on, instead of after it (ZeRO-Offload's CPU Adam made concurrent). Exact: the step is validated at its end and redone where clipping or an fp16 overflow changes it, so training is bit for bit the same (a step after one that clipped or overflowed steps after backward instead, as a guess would likely be wrong again); it holds 12-14 more bytes of RAM per parameter during a step when grad_clip > 0 or fp16 (the copies a redo restores), so a step guesses only where they take at most half of the RAM still free (else it updates after backward, the same step; docs/chunkmem.md). Past RAM (memory.cpu_budget or offload = "disk") each chunk group is updated during backward too, with no copies in RAM: with grad_clip = 0 and no fp16 its gradient never reaches the disk (fewer bytes per step); else, with a disk tier, the step guesses, its gradients are kept to its end and what it rolls back to stays in the chunks' disk slots while the updates are written to second ones (up to once more the states' bytes of disk: mem.disk.file_bytes), and a step after a wrong guess (or any step under a cpu budget without a disk tier) takes only the gradient norm during backward; on disk it then leaves each chunk group's update to the next forward, run before the group's first use there (its parameters read once for both, the update under forward's compute; where the budget holds two chunk groups), and evaluation, checkpoints and parameters_snapshot run what is left first (docs/chunkmem.md, "Past RAM"). Needs chunked memory and dp = 1. Unset: on where chunks compute on a GPU (train.device) or live past RAM (memory.cpu_budget or offload = "disk"), else off."""
    tiled_loss: bool = True
    """The reference GPT's head and cross-entropy run a tile of tokens at a time (about 4M logits each on the CPU, 64M on a GPU, where each tile costs kernel launches and a pass over the head's gradient), each tile's gradient formed at once, so the [tokens x vocabulary] logits never exist whole (capstan.tensorpar.modules.tiled_loss): the same loss and gradients, no extra compute (the gradients of a mean loss need nothing from later tiles). false returns to whole logits."""
    mlp_tile: int = constraint(0, ge=0)
    """Tokens per tile of each block's MLP for long sequences: the MLP runs a tile at a time and recomputes it in backward, so its 4 x d_model hidden activations exist for one tile only (ALST's tiled MLP; the same results, for the MLP's forward once more). 0: whole sequences."""
    activation_offload: bool = False
    """With activation_checkpointing, each recomputed block's input leaves memory between its forward and its recompute and is read back ahead of it: to pinned RAM from a GPU, to disk (memory.disk_dir/activations, through the disk tier's async I/O) on the CPU (capstan.chunkmem.ActivationOffload; ALST's activation offload). The same results; for long sequences, whose block inputs (layers x tokens x d_model) outgrow everything else."""
    activation_checkpointing: bool = False
    """Recompute activations in backward instead of keeping them (about one extra forward per step): each transformer block of the reference GPT keeps only its input (dropout masks replayed, so training is unchanged); a pipeline of your own layers keeps only each stage chunk's input. Not for a user module at pp = 1: wrap its blocks with capstan.tensorpar.recompute."""


# Bytes one of Adam's moments (exp_avg or exp_avg_sq) takes per parameter under each precision.optimizer_states:
# "int8" a code and an fp32 scale per block of 256. What the planner and the budget checks count with.
MOMENT_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1 + 4 / 256}


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """Compute precision, the width of Adam's moments, and the master weights' (fp32 unless master_weights)."""

    dtype: str = constraint("fp32", choices=("fp32", "bf16", "fp16"))
    """Autocast dtype of forward/backward ("fp32": no autocast)."""
    optimizer_states: str = constraint("fp32", choices=("fp32", "bf16", "int8"))
    """Adam's exp_avg and exp_avg_sq: "fp32", "bf16" (half their bytes in every tier: 12 instead of 16 bytes per parameter with fp32 master and gradient), or "int8" (a quarter: 10 bytes per parameter, plus 8 bytes of scales per 256). Both are updated in fp32 by the fused native kernel and stored with stochastic rounding, so that v * beta2 still decays (nearest rounding would round it back to v). "int8" quantizes block-wise (8-bit Adam, Dettmers et al. 2022): blocks of 256 values of one parameter share an fp32 scale, the first moment is a signed 8-bit float of its block's absmax and the second the square root of its value as an unsigned 8-bit float, so small moments do not flush to zero. The random bits follow the step and the element's place in the flat buffer's order, and int8's blocks start at each parameter, so one process trains the same trajectory flat or chunked, in RAM or on disk, and dp and cp layouts stay within the parity bound (tp and pp ranks number their own parameters and draw other bits; with int8 a ZeRO-1/2 shard boundary inside a parameter starts a new block). Checkpoints hold bf16 moments as bf16 and int8 ones as their exact fp32 values, which a run with int8 states turns back into the same codes; every setting loads every other. Not with parallel.compression = "onebit" (1-bit Adam keeps its own fp32 momentum)."""
    master_weights: str = constraint("fp32", choices=("fp32", "bf16"))
    """The optimizer's copy of the parameters with dtype = "bf16": "fp32" keeps an fp32 master beside the bf16 parameters (as torch.amp and DeepSpeed do); "bf16" makes the bf16 parameters the master, with no fp32 copy: each step updates them in fp32 and stores them with stochastic rounding (updates below half a bf16 ulp still move them in expectation; Zamirai et al. 2020, torchao's bf16_stochastic_round), from random bits that follow the step and the element's canonical place as the moments' do, and gradients stay bf16 (a micro-batch's adds up in bf16 under grad_accum_steps, as a bf16 .grad does in PyTorch). Chunks then hold 2 bytes less a parameter on one rank (param 2 + grad 2 where the fp32 master takes param 2 + master 4, its gradient in the param's slot), 6 less with gradient accumulation, 4 less per owned parameter under ZeRO-3 (whose reduced gradients stay fp32): with int8 moments 6 bytes a parameter instead of 8. Without chunks (ZeRO 0-2, offload "none") the flat buffers hold bf16 parameters and gradients: 4 + moments bytes a parameter instead of 8 + moments, the gradients reduced in fp32 by ZeRO-2's buckets and in bf16 by stage 0-1's all-reduces. Needs dtype = "bf16"; not with 1-bit compression, nor int8 compression on the flat buffer (both keep an fp32 master). Checkpoints hold the master as bf16; every setting loads every other (a bf16 master takes fp32 values rounded to nearest)."""
    initial_scale: float = constraint(65536.0, gt=0.0)
    """fp16: initial dynamic loss scale."""
    window: int = constraint(1000, ge=1)
    """fp16: consecutive overflow-free steps before the scale doubles."""
    hysteresis: int = constraint(2, ge=1)
    """fp16: overflowing steps tolerated before the scale halves (each overflowing step is skipped)."""
    min_scale: float = constraint(1.0, gt=0.0)
    """fp16: the scale never drops below this."""
    raise_at_min_scale: bool = True
    """fp16: stop with one clear error (exit 1) at the overflow that would halve the scale below min_scale (the run would otherwise skip every remaining step: it has diverged or overflows fp16); false keeps skipping, as DeepSpeed's raise_error_at_min_scale = false."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Periodic checkpoints (model, optimizer, loss scale and step)."""

    dir: str = "checkpoints"
    """Directory of checkpoints; relative paths are under log.run_dir."""
    every: int = constraint(0, ge=0)
    """Save every this many steps and at the end (0: never)."""
    keep: int = constraint(2, ge=1)
    """Most recent checkpoints kept; older ones are deleted after a newer one is complete."""
    resume: bool = False
    """Continue from the newest complete checkpoint in dir, if there is one (metrics.jsonl is appended to). Directories there without a manifest (an interrupted save) are named in one warning line and skipped. When none is complete but log.run_dir already holds an earlier run's metrics.jsonl, the run stops (exit 2) unless allow_fresh_start."""
    allow_fresh_start: bool = False
    """With resume: where no complete checkpoint is left but log.run_dir holds an earlier run's metrics, start over from step 0, keeping the old metrics.jsonl as metrics.jsonl.1 (.2, ...). `capstan launch --max-restarts` sets it when it relaunches a job that crashed before its first checkpoint."""
    load: str | None = constraint(None, nullable=True)
    """Start from this checkpoint (a step_* directory, or a directory of them: the newest), saved under any layout; resume from dir takes precedence when dir has one."""


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """Progress output and metrics files."""

    run_dir: str = "runs/capstan"
    """Directory for metrics.jsonl, config.resolved.toml, loss.svg (and checkpoints)."""
    every: int = constraint(10, ge=1)
    """Print the progress line every this many steps (and at the first and last step)."""
    tensorboard: bool = False
    """Also write TensorBoard scalars into run_dir (needs the tensorboard package)."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """A whole training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def dp_for(self, world_size: int) -> int:
        """The data-parallel degree on `world_size` processes (resolving dp = 0)."""
        p = self.parallel
        return p.dp if p.dp else max(1, world_size // (p.tp * p.pp * p.cp))

    def derived(self, world_size: int) -> dict[str, int]:
        """Values that follow from the config: global batch = micro x accum x dp, tokens per step."""
        dp = self.dp_for(world_size)
        t = self.train
        global_batch = t.micro_batch_size * t.grad_accum_steps * dp
        return {"dp": dp, "world_size": world_size, "global_batch": global_batch,
                "tokens_per_step": global_batch * self.model.seq_len,
                "total_tokens": global_batch * self.model.seq_len * t.steps}

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: {g.name: getattr(getattr(self, f.name), g.name) for g in fields(getattr(self, f.name))}
                for f in fields(self)}


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Config)}  # type: ignore[misc]
