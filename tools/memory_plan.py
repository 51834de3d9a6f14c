"""What a run needs on each GPU, on paper: public model shapes, a memory estimate per GPU, and where each rank's
sampler engine runs. `python train.py CONFIG dry_run=true world_size=64` prints both (tools/memory_plan.py); SFT's
estimate is `sft_memory_per_gpu` (lines: `sft_memory_lines`; bench/gpu_smoke.py prints it beside the measured peak).

Everything here is arithmetic on numbers (no torch, no model), so a 64-GPU plan can be checked on a laptop and each
term checked by hand. GB = 10^9 bytes. A GPU's memory is what its driver reports, which is what vLLM's share is taken
of: an H200's "141 GB" is 143,771 MiB = 150.7 GB, an H100's "80 GB" 81,559 MiB = 85.5 GB. The estimate follows
what train.py does:
- the trainer keeps fp32 master weights (AdamW steps at lr 1e-6 are far below bf16's resolution, so train.py loads
  the policy in fp32 and `mixed_precision: bf16` computes in bf16): 4 B weights + 4 B gradients + 8 B AdamW moments
  per parameter, divided over the GPUs the policy is sharded over (FSDP). The gradients are sharded because every
  micro-batch's gradient is reduce-scattered into the shards (train.py's update; sft.py likewise, without
  `Accelerator.accumulate`, under which FSDP2 keeps each parameter's whole fp32 gradient between micro-batches);
- under FSDP, the parameters being used are gathered unsharded in bf16: the embedding and output layer (Accelerate's
  FSDP2 keeps the output group gathered from the end of the forward to the backward) and two decoder layers (the one
  computing and the one prefetched). A forward without a backward (handoff.verify_handoff's no-grad check) would leave
  that output group gathered (reshard_after_forward=False; the root's too, which holds no Qwen3 parameter) through
  the whole rollout, 1.6 GB of bf16 lm_head at 14B; train.py calls `accel.reshard` after that check, which frees
  them (tests/test_accel.py shows both on CPU processes), so "while sampling" counts no gathered weights;
- activations with gradient checkpointing: each layer's input (bf16) for the whole micro-batch, plus one layer's
  recomputation and its gradients (an estimate: ~12 hidden-size and 4 MLP-size bf16 vectors per token, doubled);
- logits: what the model's forward returns, (T, V), kept to the end of the backward: under FSDP2 the bf16 logits
  of its bf16 parameters (MixedPrecisionPolicy), 2 B per token and vocabulary entry; without FSDP Accelerate's
  autocast returns them converted to fp32, and the bf16 original and the fp32 copy are both alive while the copy is
  made and again while the gradient is cast back: 6 B. batches.token_logprobs keeps nothing else of that size:
  plumbing/logprobs.py computes the sampled tokens' log-probs a chunk of positions at a time and writes the gradient into the
  logits themselves, plus two fp32 chunk temporaries (`logprob_chunk_bytes`, at most 134 MB whatever T);
  bench/logprob_memory.py measures each case against the direct log-softmax (14 B under FSDP2);
- the attention's mask (`mask_bytes`): under sdpa or eager a packed or padded micro-batch builds a dense
  (rows, 1, width, width) mask, by the layout the config's attention gives (plumbing/attention.py); flash builds none;
- the process itself, outside any of the above: the CUDA context and library workspaces (PROCESS_GB), and with more
  than one rank NCCL's buffers (NCCL_GB);
- the sampler. A colocated vLLM engine, by vLLM 0.33's rules (read from its source; `vllm_engine`): it takes
  `gpu_memory_utilization` x the reported memory (`request_memory`, vllm/v1/worker/utils.py), refuses to start with
  less than that free, and gives its KV cache what is left of that share after its weights, the peak of its
  profile run (a forward of max_num_batched_tokens, the sampler on max_num_seqs rows) and its CUDA graphs
  (`Worker.determine_available_memory`, vllm/v1/worker/gpu_worker.py). During the update it sleeps at level 2
  (vllm/device_allocator/sleep_mode_backend.py, `CuMemBackend.suspend`): weights and KV cache discarded (level 1
  would copy the weights to CPU RAM), its runtime buffers and the pool tagged "cudagraph" copied to CPU RAM, and
  what it allocated outside its pools stays (VLLM_ASLEEP_GB). The CUDA graphs are in that pool only with the engine
  argument `sleep_mode_offload_cudagraph=True` (default False: they are captured into torch's own graph pool and
  stay on the GPU, engine_graphs more while asleep; vllm/compilation/cudagraph_pool.py, `capture_pool`);
  VLLMSampler (samplers/vllm_engine.py) passes it where vLLM has it (0.32 and 0.33 do), unless
  `vllm_sleep_mode_offload_cudagraph: false`. With `vllm_enable_sleep_mode: false` the engine does not sleep and
  its whole share stays on the GPU through the update. The hand-off then wakes
  the weights and loads every one before the KV cache wakes, a lower peak than sampling. Under LoRA too: the
  frozen weights from the trainer's own copy on the GPU, the adapted layers merged (plumbing/handoff.py), where
  level 1 would keep the whole model in host RAM (~16 GB per GPU at 8B in bf16) to restore weights that the
  trainer holds anyway (docs/method.md, section 10). Since every hand-off after a sleep, and the one at the start,
  sends every weight, the engine starts from vLLM's dummy weights and reads no checkpoint (`engine_start_line`).
  `HFSampler` under FSDP holds its own bf16 copy and a KV buffer per slot; without FSDP it decodes with the
  trainer's own model.
SFT (`sft_memory_per_gpu`, FSDP2 launches): the same fp32 state and gathered groups; SFT's loss keeps more of the
logits (SFT_LOGITS_BYTES); and FSDP2's reduce-scatter transient (`reduce_scatter_bytes`: the largest group's bf16
gradient and its fp32 copy, 4.7 GB at 14B), which the RL update's estimate does not count yet.
Not counted: allocator fragmentation (blocks that `torch.cuda.empty_cache()` cannot return because live tensors
share them; vllm_engine.release_cached_memory empties the cache before every wake-up, and bench/gpu_smoke.py measures
what stays), the code tool's processes (CPU only).
"""
import json
from dataclasses import dataclass
from pathlib import Path

GB = 1e9
MASTER_BYTES = 4            # fp32 master weights, gradients and AdamW moments (2 per parameter)
COMPUTE_BYTES = 2           # bf16: gathered weights, activations, the sampler's copy, the KV cache
LOGITS_BYTES = {True: COMPUTE_BYTES, False: COMPUTE_BYTES + 4}  # by fsdp: bf16 logits, or + Accelerate's fp32 copy
LOGPROB_CHUNK_ELEMENTS = 1 << 24  # logprobs.CHUNK_ELEMENTS: elements of one fp32 chunk temporary
# SFT's loss (sft.masked_lm_loss) on FSDP2's bf16 logits, per token and vocabulary entry at its backward's peak: the
# bf16 logits sft.py holds (2), the fp32 log-softmax cross_entropy keeps for the backward (4), its gradient and the
# gradient of the fp32 copy (4 + 4). Measured with torch.profiler's allocation records on the CPU: 13.95 B.
SFT_LOGITS_BYTES = 14
# The process, outside any budget (estimates): the CUDA context, cuBLAS and allocator workspaces of one process
# (bench/gpu_smoke.py prints the measured figure), and NCCL's buffers when there is more than one rank: NCCL_BUFFSIZE
# (4 MiB by NCCL's documentation) per channel and ring peer, up to 32 channels, for each of the trainer's
# communicators (world, shard group, replica group): ~0.25 GB each.
PROCESS_GB = 0.6
NCCL_GB = 1.0
# vLLM 0.33's engine defaults for the LLM class on GPUs of 70 GiB or more (H100, H200; vllm/engine/arg_utils.py,
# EngineArgs._set_default_max_num_seqs_and_batched_tokens_args): its profile run forwards this many tokens and runs
# the sampler on this many rows.
VLLM_MAX_BATCHED_TOKENS = 16384
VLLM_MAX_SEQS = 1024
VLLM_SAMPLER_COPIES = 3     # fp32 (rows, V) logits in the profile's sampler run: logits, scaled, log-probs (estimate)
VLLM_GRAPHS_GB = 1.0        # its CUDA-graph pool (estimate; vLLM measures it at start and logs the figure); 0 eager
VLLM_ASLEEP_GB = 0.5        # kept while asleep: FlashInfer's 394 MiB workspace (VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE,
                            # vllm/envs.py) and the model runner's persistent inputs, allocated outside the pools

# The architecture fields of public checkpoints, as their config.json on the Hugging Face hub gives them
# (Qwen/Qwen3-0.6B, Qwen/Qwen3-1.7B, Qwen/Qwen3-8B, Qwen/Qwen3-14B; the -Base checkpoints share the architecture;
# Qwen3 technical report, Table 1). bench/gpu_smoke.py builds a random model from the first one, so nothing is downloaded.
PUBLIC_CONFIGS = {
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                   "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                   "max_position_embeddings": 40960},
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                   "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                   "max_position_embeddings": 40960},
    "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                 "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                 "max_position_embeddings": 40960},
    "qwen3-14b": {"hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
                  "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                  "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                  "max_position_embeddings": 40960},
}


@dataclass(frozen=True)
class Shape:
    """The sizes of a Qwen3/Llama-style decoder (no attention biases; Qwen3's per-head q/k norms included)."""
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool  # the output layer shares the embedding matrix

    @classmethod
    def from_config(cls, c: dict) -> "Shape":
        """From a Hugging Face config.json dict."""
        heads = c["num_attention_heads"]
        return cls(layers=c["num_hidden_layers"], hidden=c["hidden_size"], intermediate=c["intermediate_size"],
                   heads=heads, kv_heads=c.get("num_key_value_heads", heads),
                   head_dim=c.get("head_dim") or c["hidden_size"] // heads, vocab=c["vocab_size"],
                   tied=bool(c.get("tie_word_embeddings", False)))

    @property
    def layer_params(self) -> int:
        """One decoder layer: q, k, v, o projections, the gated MLP, two RMSNorms, the q and k norms."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return (self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate
                + 2 * self.hidden + 2 * self.head_dim)

    @property
    def embedding_params(self) -> int:
        """The embedding and the output layer (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.hidden  # + the final norm

    def lora_params(self, rank: int, targets) -> int:
        """A LoRA adapter's parameters (plumbing/lora.py): r x (in + out) for each adapted linear layer of every decoder
        layer; `targets` names them as the model does (q_proj, ..., down_proj)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        sizes = {"q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
                 "o_proj": (q, self.hidden), "gate_proj": (self.hidden, self.intermediate),
                 "up_proj": (self.hidden, self.intermediate), "down_proj": (self.intermediate, self.hidden)}
        return self.layers * sum(rank * sum(sizes[t]) for t in targets if t in sizes)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache per token: every layer's keys and values in bf16."""
        return self.layers * 2 * self.kv_heads * self.head_dim * COMPUTE_BYTES


def vllm_engine(shape: Shape, *, fraction: float, gpu_gb: float, tp: int = 1, eager: bool = False,
                max_batched_tokens: int = VLLM_MAX_BATCHED_TOKENS, max_seqs: int = VLLM_MAX_SEQS) -> dict[str, float]:
    """A colocated vLLM 0.33 engine's memory in GB, by its rules (the module docstring names their sources).
    fraction: gpu_memory_utilization; gpu_gb: the GPU's memory as its driver reports it."""
    budget = fraction * gpu_gb  # ceil(total x gpu_memory_utilization), checked against the free memory at start
    weights = COMPUTE_BYTES * shape.params / tp / GB
    # its profile run's transient peak: the MLP's fused gate/up output and their product for max_batched_tokens
    # tokens (bf16), and the sampler's fp32 logits on max_seqs rows
    profile = (max_batched_tokens * 3 * shape.intermediate * COMPUTE_BYTES
               + VLLM_SAMPLER_COPIES * max_seqs * shape.vocab * MASTER_BYTES) / GB
    graphs = 0.0 if eager else VLLM_GRAPHS_GB
    kv = max(budget - weights - profile - graphs, 0.0)  # the KV cache: what the share leaves
    return {"engine_budget": budget, "sampler_weights": weights, "engine_profile": profile, "engine_graphs": graphs,
            "kv_cache": kv, "kv_cache_tokens": kv * GB / shape.kv_bytes_per_token, "engine_asleep": VLLM_ASLEEP_GB}


def memory_per_gpu(shape: Shape, *, shard: int, fsdp: bool, micro_batch: int, seq_tokens: int,
                   gradient_checkpointing: bool, sampler: str, gpu_gb: float, world: int = 1,
                   engine_fraction: float = 0.5, engine_tp: int = 1, engine_eager: bool = False,
                   engine_sleeps: bool = True, engine_graphs_offloaded: bool = True,
                   hf_slots: int = 0, micro_tokens: int = 0, lora: int = 0,
                   mask: float = 0.0) -> dict[str, float]:
    """Estimated GB per GPU, by term, for one rank of a run (the module docstring says what each term counts).

    shard: GPUs the policy's weights, gradients and AdamW state are divided over (1: not sharded); world: ranks in
    all (more than one: NCCL's buffers). micro_batch x seq_tokens: the sequences and their length (prompt +
    response) in one forward/backward, or micro_tokens in all when micro-batches are cut by tokens. sampler: "vllm" (a colocated engine taking engine_fraction of gpu_gb, weights
    over engine_tp GPUs, `vllm_engine`), "hf" (HFSampler; under FSDP its own bf16 copy, and hf_slots KV rows of
    seq_tokens) or "none" (SFT). Returns the terms, `rollout_peak` (trainer state + sampler while sampling),
    `update_peak` (the policy update, the engine asleep) and `kv_cache_tokens` (tokens the KV cache holds).
    lora: the parameters of a LoRA adapter (`Shape.lora_params`; 0: full fine-tuning). Then the model's own weights
    are frozen in bf16 (sharded under FSDP) and only the adapter has fp32 weights, gradients and AdamW moments.
    mask: bytes of the attention's dense mask during the update (`mask_bytes`; 0 under flash attention).
    engine_sleeps: the engine sleeps through the update (vllm_enable_sleep_mode; False: its whole share stays
    resident); engine_graphs_offloaded: its CUDA graphs go to CPU RAM while asleep (else they stay on the GPU)."""
    p, tokens = shape.params, micro_tokens or micro_batch * seq_tokens
    trained = lora or p  # parameters with fp32 masters, gradients and AdamW state
    m = {
        "weights": (MASTER_BYTES * trained + (COMPUTE_BYTES * p if lora else 0)) / shard / GB,
        "grads": MASTER_BYTES * trained / shard / GB,
        "adamw": 2 * MASTER_BYTES * trained / shard / GB,
        # FSDP: the gathered bf16 groups in use; without FSDP, autocast's bf16 copy of every fp32 weight (under
        # LoRA the frozen weights are bf16 already: only the adapter's are copied)
        "gathered": COMPUTE_BYTES * ((shape.embedding_params + 2 * shape.layer_params) if fsdp else trained) / GB,
        "activations": activation_bytes(shape, tokens, gradient_checkpointing) / GB,
        "logits": (LOGITS_BYTES[fsdp] * tokens * shape.vocab + logprob_chunk_bytes(tokens, shape.vocab)) / GB,
        "process": PROCESS_GB + (NCCL_GB if world > 1 else 0.0),
        "mask": mask / GB,
    }
    if sampler == "vllm":
        m.update(vllm_engine(shape, fraction=engine_fraction, gpu_gb=gpu_gb, tp=engine_tp, eager=engine_eager))
        m["sampler_other"] = m["engine_profile"] + m["engine_graphs"]
        if not engine_sleeps:  # awake through the update: everything it took stays
            m["engine_asleep"] = m["engine_budget"]
        elif not engine_graphs_offloaded:
            m["engine_asleep"] += m["engine_graphs"]
        sampling, asleep = m["engine_budget"], m["engine_asleep"]  # the engine fills its share (the KV cache)
    else:
        # HFSampler: unsharded, it shares the trainer's model; "none": no sampler (SFT)
        m["sampler_weights"] = COMPUTE_BYTES * p / GB if (fsdp or lora) and sampler == "hf" else 0.0
        m["kv_cache"] = hf_slots * seq_tokens * shape.kv_bytes_per_token / GB if sampler == "hf" else 0.0
        m["sampler_other"] = 0.0
        m["kv_cache_tokens"] = hf_slots * seq_tokens if sampler == "hf" else 0
        sampling = m["sampler_weights"] + m["kv_cache"]
        asleep = m["sampler_weights"]  # HFSampler frees its KV buffers for the update; its copy stays
    m["rollout_peak"] = m["weights"] + m["adamw"] + sampling + m["process"]  # gradients are freed after each step
    m["update_peak"] = (m["weights"] + m["grads"] + m["adamw"] + m["gathered"] + m["activations"] + m["logits"]
                        + m["mask"] + asleep + m["process"])
    return m


def mask_bytes(shape: Shape, attention: str, layout: str, rows: int, width: int, gradient_checkpointing: bool,
               fsdp: bool) -> float:
    """The dense attention mask of one micro-batch of `rows` rows of `width` tokens during its forward and backward
    (update_plan.layout_for's layouts; plumbing/attention.py). Flash attention takes the sequences' bounds from
    position_ids and flex a block mask of (width / 128)^2 entries: nothing counted. sdpa: transformers' bool mask
    (rows, 1, width, width), 1 B an entry, kept to the end of the backward; torch's sdpa converts it to an additive
    mask in the compute dtype at every layer's call (2 B), which its memory-efficient kernel keeps for the backward:
    one layer's with gradient checkpointing (the one recomputed), every layer's without. eager: transformers'
    additive mask in the embeddings' dtype (bf16 under FSDP2, fp32 under autocast) and every kept layer's scores
    (heads x width^2: bf16 probabilities and their fp32 softmax). An estimate; a padded micro-batch without padding
    builds none, counted all the same."""
    if layout == "one_row" or attention not in ("sdpa", "eager"):
        return 0.0
    layers = 1 if gradient_checkpointing else shape.layers
    if attention == "sdpa":
        per_entry = 1 + COMPUTE_BYTES * layers
    else:
        per_entry = (COMPUTE_BYTES if fsdp else MASTER_BYTES) + shape.heads * (COMPUTE_BYTES + 4) * layers
    return rows * width * width * per_entry


def micro_batch_rows(layout: str, tokens: int, budget: int, micro_batch_size: int) -> tuple[int, int]:
    """(rows, width) of the widest micro-batch a layout forms for sequences of at most `tokens` tokens: padded,
    micro_batch_size rows of `tokens`; rows (update_plan.row_widths), rows up to twice the longest and the budget
    wide, budget // width of them (rows x width^2 grows with the width); one_row, one row of the budget."""
    if layout == "padded":
        return micro_batch_size, tokens
    if layout == "rows":
        width = max(tokens, min(budget, 2 * tokens))
        return max(1, budget // width), width
    return 1, max(budget, tokens)


def logprob_chunk_bytes(tokens: int, vocab: int) -> int:
    """plumbing/logprobs.py's two fp32 temporaries (the scaled logits and their log-softmax) of one chunk of positions."""
    rows = max(1, LOGPROB_CHUNK_ELEMENTS // vocab)
    return 2 * 4 * min(tokens, rows) * vocab


def activation_bytes(shape: Shape, tokens: int, gradient_checkpointing: bool) -> float:
    """Activation bytes of a forward/backward over `tokens` tokens, in bf16. A layer keeps about 12 hidden-size and
    4 MLP-size vectors per token for its backward (an estimate); its backward needs as much again for gradients.
    With checkpointing only each layer's input is kept, and one layer at a time is recomputed."""
    layer = tokens * (12 * shape.hidden + 4 * shape.intermediate) * COMPUTE_BYTES
    if gradient_checkpointing:
        return shape.layers * tokens * shape.hidden * COMPUTE_BYTES + 2 * layer
    return shape.layers * layer + layer


def reduce_scatter_bytes(shape: Shape) -> int:
    """FSDP2's largest gradient transient: after a group's backward, its unsharded bf16 gradients and the fp32
    reduce-scatter input they are copied into (`foreach_reduce`, torch/distributed/fsdp/_fully_shard/
    _fsdp_collectives.py) are both alive, for the largest group: the output layer and final norm (the embedding
    too when tied: the same matrix), or one decoder layer."""
    output_group = shape.vocab * shape.hidden + shape.hidden
    return (COMPUTE_BYTES + MASTER_BYTES) * max(output_group, shape.layer_params)


def sft_memory_per_gpu(shape: Shape, *, shard: int, micro_batch: int, seq_tokens: int, gradient_checkpointing: bool,
                       world: int = 1) -> dict[str, float]:
    """Estimated GB per GPU, by term, of sft.py under an FSDP2 launch, where every micro-batch's gradient is
    reduce-scattered into the shards: fp32 weights, gradients and AdamW moments over `shard` GPUs, no full
    gradient. (Under `Accelerator.accumulate` FSDP2 would instead keep each parameter's whole fp32 gradient until
    the accumulation window ends, `to_accumulated_grad_if_needed` in torch/distributed/fsdp/_fully_shard/
    _fsdp_param.py: 4 B per parameter, 59 GB at 14B, counted nowhere here.) The gathered bf16 groups and the
    activations are the RL update's (`memory_per_gpu`); the logits are SFT's loss (SFT_LOGITS_BYTES); the largest
    group's gradient on its way into the reduce-scatter (`reduce_scatter_bytes`). Returns the terms and `peak`."""
    p, tokens = shape.params, micro_batch * seq_tokens
    m = {
        "weights": MASTER_BYTES * p / shard / GB,
        "grads": MASTER_BYTES * p / shard / GB,
        "adamw": 2 * MASTER_BYTES * p / shard / GB,
        "gathered": COMPUTE_BYTES * (shape.embedding_params + 2 * shape.layer_params) / GB,
        "activations": activation_bytes(shape, tokens, gradient_checkpointing) / GB,
        "logits": SFT_LOGITS_BYTES * tokens * shape.vocab / GB,
        "reduce_scatter": reduce_scatter_bytes(shape) / GB,
        "process": PROCESS_GB + (NCCL_GB if world > 1 else 0.0),
    }
    m["peak"] = sum(m.values())
    return m


def engine_layout(world: int, gpus_per_node: int, seed: int, tensor_parallel: int = 1) -> list[dict]:
    """Where each rank's sampler engine runs: one engine per rank on the rank's own GPU (node rank // gpus_per_node,
    device cuda:(rank % gpus_per_node)), seeded seed + rank so ranks draw different rollouts."""
    return [{"rank": r, "node": r // gpus_per_node, "device": f"cuda:{r % gpus_per_node}", "seed": seed + r,
             "tp": tensor_parallel} for r in range(world)]


# ============================================================================ the dry-run plan's lines
def engine_lines(cfg, world: int) -> list[str]:
    """The dry-run plan's lines for the per-rank engines (`engine_layout`: first ranks, last rank), from a
    train.TrainConfig."""
    if cfg.sampler != "vllm":
        return [f"engines                none: HFSampler decodes on each rank's own device, seed {cfg.seed} + rank"]
    layout = engine_layout(world, cfg.gpus_per_node, cfg.seed, cfg.vllm_tensor_parallel_size)
    shown = layout[:3] + ([{"rank": "..."}] if world > 4 else []) + layout[3:][-1:]
    per_node = cfg.gpus_per_node
    return [f"engines                one vLLM engine per rank, TP {cfg.vllm_tensor_parallel_size}, on the rank's own "
            f"GPU: node = rank // {per_node}, device cuda:(rank % {per_node}), seed {cfg.seed} + rank",
            "                       " + "; ".join("..." if e["rank"] == "..." else
                                                  f"rank {e['rank']}: node {e['node']} {e['device']} seed {e['seed']}"
                                                  for e in shown), engine_start_line(cfg)]


def engine_start_line(cfg) -> str:
    """The dry-run plan's line on what the engine starts from and what each hand-off sends (every train.py config
    with sampler=vllm: dummy weights, every weight at the start and after each level-2 sleep)."""
    sent = ("the frozen weights as the trainer holds them and the adapted layers merged" if cfg.lora_rank
            else "every weight")
    if not cfg.vllm_enable_sleep_mode:
        return (f"engine weights         vLLM's dummy weights at start (no checkpoint read); the hand-off at the "
                f"start sends {sent}; no sleep (vllm_enable_sleep_mode=false): the engine keeps its weights")
    return (f"engine weights         vLLM's dummy weights at start (no checkpoint read); the hand-off at the start "
            f"and after each sleep (level 2: weights discarded) sends {sent}; no host RAM")


def shape_of(model_path: str, model_shape: str = "") -> tuple[Shape, str] | str:
    """(shape, where it came from) from model_path's config.json or the named public shape; else the plan's line
    saying why there is no estimate."""
    config = Path(model_path) / "config.json"
    if config.is_file():
        return Shape.from_config(json.loads(config.read_text())), str(config)
    if model_shape in PUBLIC_CONFIGS:
        return Shape.from_config(PUBLIC_CONFIGS[model_shape]), f"{model_shape} (public config)"
    known = ", ".join(PUBLIC_CONFIGS)
    return f"memory per GPU         no estimate: {config} does not exist yet; give model_shape= ({known})"


def memory_lines(cfg, world: int, attention: str = "sdpa", layout: str = "") -> list[str]:
    """The dry-run plan's lines for the memory estimate per GPU (`memory_per_gpu`), from a train.TrainConfig, for
    the model_path's config.json or the named public shape (model_shape); attention and layout: what the update
    runs (plumbing/attention.py, update_plan.layout_for), for the mask it builds (`mask_bytes`)."""
    found = shape_of(cfg.model_path, cfg.model_shape)
    if isinstance(found, str):
        return [found]
    shape, name = found
    shard = min(world, cfg.gpus_per_node) if cfg.fsdp else 1
    tokens = cfg.max_prompt_tokens + cfg.max_response_tokens
    adapter = shape.lora_params(cfg.lora_rank, cfg.lora_targets) if cfg.lora_rank else 0
    # by tokens: a micro-batch holds at most the budget, or one rollout longer than it
    budget = cfg.max_tokens_per_micro_batch
    micro = max(budget, tokens) if budget else cfg.micro_batch_size * tokens
    layout = layout or ("rows" if budget else "padded")
    rows, width = micro_batch_rows(layout, tokens, budget, cfg.micro_batch_size)
    m = memory_per_gpu(shape, shard=shard, fsdp=cfg.fsdp, micro_batch=cfg.micro_batch_size, seq_tokens=tokens,
                       gradient_checkpointing=cfg.gradient_checkpointing, sampler=cfg.sampler,
                       gpu_gb=cfg.gpu_memory_gb, world=world, engine_fraction=cfg.vllm_gpu_memory_utilization,
                       engine_tp=cfg.vllm_tensor_parallel_size, engine_eager=cfg.vllm_enforce_eager,
                       engine_sleeps=cfg.vllm_enable_sleep_mode,
                       engine_graphs_offloaded=cfg.vllm_sleep_mode_offload_cudagraph, hf_slots=cfg.rollout_batch_size, micro_tokens=micro, lora=adapter,
                       mask=mask_bytes(shape, attention, layout, rows, width, cfg.gradient_checkpointing, cfg.fsdp))
    gpu = cfg.gpu_memory_gb

    def fits(total: float) -> str:
        return f"{total:.1f} of {gpu:g} GB" + ("" if total <= gpu else "  OVER: does not fit")
    if cfg.sampler == "vllm":
        sampler = (f"engine {m['engine_budget']:.1f} ({cfg.vllm_gpu_memory_utilization:g} x {gpu:g}: weights "
                   f"{m['sampler_weights']:.1f} + profile peak {m['engine_profile']:.1f} + CUDA graphs "
                   f"{m['engine_graphs']:.1f} + KV cache {m['kv_cache']:.1f} = {m['kv_cache_tokens']:,.0f} tokens)")
        asleep = (f"engine asleep {m['engine_asleep']:.1f}" if cfg.vllm_enable_sleep_mode else
                  f"engine awake {m['engine_asleep']:.1f} (vllm_enable_sleep_mode=false)")
    else:
        sampler = (f"sampler {m['sampler_weights']:.1f} weights + {m['kv_cache']:.1f} KV cache "
                   f"({m['kv_cache_tokens']:,.0f} tokens)")
        asleep = f"sampler copy {m['sampler_weights']:.1f}"
    return [
        f"model                  {name}: {shape.params / 1e9:.2f}B parameters, {shape.layers} layers, hidden "
        f"{shape.hidden}, vocab {shape.vocab:,}",
        "memory per GPU (GB)    an estimate (tools/memory_plan.py): "
        + (f"FSDP over {shard} GPUs, " if cfg.fsdp else "no FSDP (one process or DDP), ")
        + (f"LoRA rank {cfg.lora_rank}: {adapter / 1e6:,.1f}M trained parameters with fp32 masters "
           f"({adapter / shape.params:.2%}), the rest frozen in bf16, " if adapter else "fp32 master weights, ")
        + (f"micro-batch at most {micro:,} tokens" if budget else
         f"micro-batch {cfg.micro_batch_size} x {tokens:,} tokens") + f", checkpointing {cfg.gradient_checkpointing}",
        f"  while sampling       weights {m['weights']:.1f} + AdamW {m['adamw']:.1f} + {sampler} + process "
        f"{m['process']:.1f} = {fits(m['rollout_peak'])}",
        f"  while updating       weights {m['weights']:.1f} + gradients {m['grads']:.1f} + AdamW {m['adamw']:.1f} + "
        f"gathered bf16 {m['gathered']:.1f} + activations {m['activations']:.1f} + logits {m['logits']:.1f} + "
        + (f"{attention} mask{' and scores' if attention == 'eager' else ''} {m['mask']:.1f} "
           f"({rows} x {width:,}^2) + " if m["mask"] else "")
        + f"{asleep} + process {m['process']:.1f} = {fits(m['update_peak'])}",
    ] + ([f"  KV CACHE TOO SMALL    {m['kv_cache_tokens']:,.0f} tokens hold less than one rollout of {tokens:,}: "
          "raise vllm_gpu_memory_utilization (the engine's share of the GPU)"]
         if m["kv_cache_tokens"] < tokens else [])


def sft_memory_lines(cfg, world: int, gpus_per_node: int = 8, gpu_gb: float = 150.7,
                     model_shape: str = "") -> list[str]:
    """The SFT plan's lines (`sft_memory_per_gpu`) from an sft.SFTConfig, for `world` ranks sharding within nodes of
    `gpus_per_node`, each micro-batch at its longest (micro_batch_size x max_seq_len tokens)."""
    found = shape_of(cfg.model_path, model_shape)
    if isinstance(found, str):
        return [found]
    shape, name = found
    shard, tokens = min(world, gpus_per_node), cfg.micro_batch_size * cfg.max_seq_len
    m = sft_memory_per_gpu(shape, shard=shard, micro_batch=cfg.micro_batch_size, seq_tokens=cfg.max_seq_len,
                           gradient_checkpointing=cfg.gradient_checkpointing, world=world)
    over = "" if m["peak"] <= gpu_gb else "  OVER: does not fit"
    return [
        f"model                  {name}: {shape.params / 1e9:.2f}B parameters",
        f"sft memory per GPU     an estimate (tools/memory_plan.py): FSDP2 over {shard} GPUs, fp32 master weights, each "
        f"micro-batch reduce-scattered, micro-batch {cfg.micro_batch_size} x {cfg.max_seq_len:,} = {tokens:,} "
        f"tokens, checkpointing {cfg.gradient_checkpointing}",
        f"  sft step             weights {m['weights']:.1f} + gradients {m['grads']:.1f} + AdamW {m['adamw']:.1f} + "
        f"gathered bf16 {m['gathered']:.1f} + activations {m['activations']:.1f} + logits {m['logits']:.1f} + "
        f"reduce-scatter {m['reduce_scatter']:.1f} + process {m['process']:.1f} = {m['peak']:.1f} of {gpu_gb:g} GB"
        f"{over}",
    ]
