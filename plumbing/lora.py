"""LoRA (Hu et al., 2021, arXiv 2106.09685) for train.py and sft.py, through PEFT: train a low-rank change of the
linear layers and leave the model itself frozen, so that a model too large for full fine-tuning on one GPU still
trains there (the memory plan, tools/memory_plan.py, counts both).

For each adapted linear layer W (out x in, the checkpoint's weights, frozen):

    W' = W + (alpha / r) B A        A: (r x in), B: (out x r), B = 0 at the start (W' = W)

Only A and B train: they are fp32 (PEFT's `autocast_adapter_dtype`), the only parameters with gradients and AdamW
state; W stays in the checkpoint's dtype (bf16 for Qwen3-Base), where full fine-tuning keeps fp32 masters of
everything. The config fields (train.py and sft.py alike): `lora_rank` r (0: no LoRA, every weight trains),
`lora_alpha`, `lora_targets` (module names; by default every linear layer of attention and MLP, not the embedding or
the output layer), `lora_dropout`, and `lora_from`: a saved adapter to continue (the run folder's `adapter/`), with
`model_path` the base it was trained on.

What leaves the trainer:
- the sampler gets W' of the adapted layers only (`merged_weights`): the engine decodes a plain model at full speed
  and keeps the rest, which LoRA never changes; an engine that discarded its weights (vLLM asleep at level 2, or
  started from dummy weights) gets every weight instead, the frozen ones as the trainer holds them
  (`handoff.every_lora_weight`);
- `model/` is the whole model with every W' merged, in the checkpoint's dtype (`merged_state_dict`), so the next
  stage and eval.py read it like any checkpoint; `adapter/` is the adapter in PEFT's own format
  (adapter_config.json, adapter_model.safetensors), for `PeftModel.from_pretrained` or the next stage's `lora_from`;
- checkpoints hold the adapter's weights only, with the optimizer, schedule and RNG states as before
  (`adapter_only`, `load_adapter_only`): the frozen weights are `model_path`'s.

Under a launcher: DDP reduces the adapter's gradients only (the frozen weights have none). FSDP2 shards the frozen
weights with the adapter; Accelerate upcasts only parameters that train to fp32, so the frozen ones keep the
checkpoint's dtype, and under mixed_precision=bf16 every layer is gathered in bf16. An FSDP checkpoint is torch's
sharded checkpoint of every shard, frozen weights included (Accelerate writes it apart from the hooks above).

Not here: adapters on the embedding or the output layer, DoRA and the other PEFT variants, vLLM's own LoRA path
(docs/method.md, §10, says why merged weights).
"""
from pathlib import Path

import torch

ADAPTER = "default"  # PEFT's name of the one adapter
# Every linear layer of a Qwen3 (and Llama-style) decoder layer: attention q, k, v, o and the gated MLP.
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # PEFT's format


def add_adapter(model, rank: int, alpha: float, targets: list[str], dropout: float, seed: int,
                start_from: str | None = None):
    """The model with a LoRA adapter on `targets` (PEFT's PeftModel): the model's own weights frozen, A and B fp32
    and trainable. A is drawn from `seed` alone (not from the rank's RNG: every rank and every world size starts
    from the same adapter); start_from: a saved adapter folder to continue instead, which must have the same
    rank, alpha and targets (one line naming the difference)."""
    import warnings
    from peft import LoraConfig, PeftModel, get_peft_model
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # PEFT 0.21 asks transformers 5 a deprecated question (is_gradient_checkpointing) and is warned each time
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(seed)
        if start_from:
            check_saved_adapter(start_from, rank, alpha, targets)
            return PeftModel.from_pretrained(model, start_from, is_trainable=True)
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=dropout,
                            bias="none", task_type="CAUSAL_LM")
        return get_peft_model(model, config)


def attach(model, cfg):
    """The model as configured: with an adapter when cfg.lora_rank > 0 (cfg's lora_* fields and seed), else as it
    is. Gradient checkpointing, if on, must be enabled first (it makes the frozen embedding's output require
    gradients, so that they reach the adapters through each recomputed layer)."""
    if not cfg.lora_rank:
        return model
    return add_adapter(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.lora_dropout, cfg.seed,
                       cfg.lora_from)


def weights_dtype(cfg, checkpoint_dtype: torch.dtype) -> torch.dtype:
    """The dtype the trainer holds the model's weights in: fp32 masters when every weight trains (AdamW's steps at
    lr 1e-6 are far below bf16's resolution); the checkpoint's own under LoRA, where they are frozen."""
    return checkpoint_dtype if cfg.lora_rank else torch.float32


def check_config(cfg) -> list[str]:
    """The LoRA fields' problems, as config-error lines (none when LoRA is off)."""
    if not cfg.lora_rank:
        return ["lora_from needs lora_rank > 0"] if cfg.lora_from else []
    return [] if cfg.lora_targets else ["lora_targets: name at least one module to adapt"]


def check_saved_adapter(folder: str, rank: int, alpha: float, targets: list[str]) -> None:
    """SystemExit with one line when `folder` holds no PEFT adapter, or one of another shape than the config's."""
    import json
    path = Path(folder)
    missing = [f for f in ADAPTER_FILES if not (path / f).is_file()]
    if missing:
        raise SystemExit(f"input error: lora_from={folder}: no {' or '.join(missing)} there (a run's adapter/)")
    saved = json.loads((path / "adapter_config.json").read_text())
    differ = {k: (saved.get(k), now) for k, now in (("r", rank), ("lora_alpha", alpha))
              if saved.get(k) != now}
    if sorted(saved.get("target_modules") or []) != sorted(targets):
        differ["target_modules"] = (sorted(saved.get("target_modules") or []), sorted(targets))
    if differ:
        raise SystemExit(f"config error: lora_from={folder} holds an adapter of another shape: " + "; ".join(
            f"{k} {was} there, {now} in this config" for k, (was, now) in differ.items()))


def is_lora(model) -> bool:
    """Does this (unwrapped) model carry a LoRA adapter?"""
    return bool(adapted_modules(model))


def adapted_modules(model) -> dict:
    """{the layer's name in the plain model (as in model/ and the sampler): PEFT's LoRA layer} of every adapted
    linear layer; {} for a model without an adapter."""
    from peft.tuners.lora import LoraLayer
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def merged_weight(layer, dtype: torch.dtype) -> torch.Tensor:
    """W' = W + (alpha / r) B A of one adapted linear layer, computed in fp32, in `dtype`."""
    W = _whole(layer.base_layer.weight).detach()
    A, B = _whole(layer.lora_A[ADAPTER].weight).detach(), _whole(layer.lora_B[ADAPTER].weight).detach()
    return (W.float() + layer.scaling[ADAPTER] * (B.float() @ A.float())).to(dtype)


# Layers an engine may fuse into one weight (vLLM: q, k and v into qkv_proj; gate and up into gate_up_proj). Its
# layer-wise reload (vLLM 0.32, model_loader/reload/layerwise.py) processes a fused weight once all of its parts
# have arrived, so a part LoRA does not adapt is sent with the others, unmerged.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def merged_weights(model, dtype: torch.dtype | None = None):
    """(name, weight) by the plain model's names, in `dtype` (None: the frozen weight's): W' for each adapted
    linear layer, and the plain weight of each layer fused with one (FUSED); nothing else, since nothing else
    changed. What the sampler needs after an update."""
    from peft.tuners.lora import LoraLayer
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    adapted = adapted_modules(model)
    siblings = {f"{name.rsplit('.', 1)[0]}.{part}" for name in adapted for group in FUSED
                if name.rsplit(".", 1)[-1] in group for part in group}
    for name, layer in base.named_modules():
        if isinstance(layer, LoraLayer):
            yield f"{name}.weight", merged_weight(layer, dtype or layer.base_layer.weight.dtype)
        elif name in siblings:
            yield f"{name}.weight", _whole(layer.weight).detach().to(dtype or layer.weight.dtype)


def plain_name(name: str) -> str:
    """A PEFT model's state-dict name -> the plain model's ('base_model.model.' and '.base_layer' dropped)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def scalings(model) -> dict[str, float]:
    """{plain layer name: alpha / r} of every adapted layer."""
    return {name: layer.scaling[ADAPTER] for name, layer in adapted_modules(model).items()}


def merged_state_dict(state: dict, scaling: dict[str, float], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """model/'s weights from a PEFT model's whole state dict (`state`, every tensor whole; FSDP gathers it for the
    main process): plain names, each adapted layer W' = W + scaling B A (computed in fp32), the floating-point
    tensors in `dtype`, the adapter's own tensors gone. The live model is not touched (no PEFT merge in place)."""
    out = {}
    for key, t in state.items():
        if ".lora_" in key:
            continue
        name = plain_name(key)
        layer = name.removesuffix(".weight")
        if layer in scaling:
            A = state[key.replace(".base_layer.weight", f".lora_A.{ADAPTER}.weight")].float()
            B = state[key.replace(".base_layer.weight", f".lora_B.{ADAPTER}.weight")].float()
            t = t.float() + scaling[layer] * (B @ A)
        out[name] = t.to(dtype) if t.is_floating_point() else t
    return out


def save_adapter(model, state: dict, folder) -> None:
    """The adapter in PEFT's format (ADAPTER_FILES) into `folder`, from the model's whole state dict."""
    model.save_pretrained(str(folder), state_dict=state, save_embedding_layers=False)


def trainable_count(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ---------------------------------------------------------------- checkpoints: the adapter's weights only
def checkpoint_adapter_only(accelerator, model) -> None:
    """Have Accelerate's save_state and load_state keep a LoRA model's adapter only (`adapter_only`,
    `load_adapter_only`); nothing for a model without one, or under FSDP, whose sharded checkpoints (torch's
    distributed checkpoint, written by Accelerate apart from these hooks) hold every shard."""
    from accelerate.utils import DistributedType
    if is_lora(accelerator.unwrap_model(model)) and accelerator.distributed_type != DistributedType.FSDP:
        accelerator.register_save_state_pre_hook(adapter_only)
        accelerator.register_load_state_pre_hook(load_adapter_only)


def adapter_only(models: list, weights: list, output_dir: str) -> None:
    """Accelerate's save-state hook: each model's saved state dict keeps its trainable (adapter) tensors only; the
    frozen weights are model_path's, which the resumed run loads again."""
    for i, model in enumerate(models):
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        weights[i] = {k: v for k, v in weights[i].items() if _param_name(k) in trainable}


def load_adapter_only(models: list, input_dir: str) -> None:
    """Accelerate's load-state hook: each model's adapter from the checkpoint's model file (one line if it holds
    anything else, or lacks an adapter tensor); the models are then taken off Accelerate's list, which would load
    the file as a whole state dict."""
    from safetensors.torch import load_file
    for i, model in enumerate(models):
        file = Path(input_dir) / ("model.safetensors" if i == 0 else f"model_{i}.safetensors")
        state = load_file(str(file))
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        if {_param_name(k) for k in state} != trainable:
            raise SystemExit(f"resume error: {file} does not hold this run's adapter ({len(state)} tensors, "
                             f"{len(trainable)} expected): the checkpoint was written with other LoRA settings")
        model.load_state_dict(state, strict=False)
    models.clear()


def _param_name(key: str) -> str:
    return key.removeprefix("module.")  # DDP's wrapper prefix, where the state dict was taken with it
