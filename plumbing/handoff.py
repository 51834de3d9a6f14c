"""The weight hand-off (phase 9 of train.py): the trainer's new weights into the sampler, and the check that they
arrived.

Here the sampler lives in each training process (colocated), so handing off is a copy in memory; a silent failure
would still train on rollouts from stale weights. So after each hand-off both sides score one fixed token sequence
(the first training prompt, cut to HANDOFF_PROBE_TOKENS) and `check_handoff` compares them: the gap must be within
the tolerance of the two sides' dtypes, and if the trainer's log-probs moved since the last check, the sampler's
must have moved too.

- `hand_off`: the module itself when this rank holds all of it (HFSampler may share it: nothing to copy), else
  the FSDP-sharded parameters gathered one at a time and streamed (`gathered_weights`). Under LoRA only the adapted
  layers changed: their merged weights W + (alpha / r) B A (`lora.merged_weights`), and nothing else is sent,
  unless the sampler has discarded its weights (vLLM's level-2 sleep, or an engine started from dummy weights):
  then every weight goes, the frozen ones as the trainer holds them (`every_lora_weight`).
- `sampler_policy`: the model HFSampler decodes with (a full copy of its own under FSDP, and under LoRA: the plain
  model as `model_path` holds it, into which each hand-off merges the adapted layers).
- `sync`: hand off, then verify; what train.py calls.

Not here: sending weights to engines in other processes or on other machines (each rank drives its own engine, in
its own process), and tensor parallelism inside an engine (VLLMSampler.update_weights refuses it).
"""
from pathlib import Path

import torch

from plumbing import accel
from plumbing import lora
from plumbing.checkpoint import input_dtype
from plumbing.data import load_pretrained

# Largest mean |log-prob gap| between a sampler and the trainer that still counts as "the same weights", by the
# dtype a side computes in (`handoff_tolerance` takes the coarser side's). fp32: only the summation order differs.
# 16-bit engines round weights and activations, so they sit further from an fp32 trainer (bf16 keeps 8 mantissa
# bits, fp16 11).
# Measured with vLLM's CPU build on the tiny SFT model, 111-121 tokens, against an fp32 transformers forward pass:
# mean gap fp32 8.5e-7, fp16 1.6e-3, bf16 1.4e-2 (largest single token 5.7e-6, 9.1e-3, 9.4e-2). Deeper models
# accumulate more rounding: the 16-bit values leave 7-19x room.
HANDOFF_TOLERANCE = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 1e-1}

# The second rule's floor, as a fraction of the tolerance: a trainer that moved less than tolerance * MOVE_FLOOR per
# token may leave a 16-bit sampler's numbers bit for bit where they were. Seen on the CPU rehearsal (FSDP2, bf16
# parameters, warm-up lr 1e-7): the masters' step changed the bf16 value of a few small weights only, the trainer's
# log-probs moved by 3e-8 per token and a bf16 vLLM engine holding the same bf16 weights rounded it away. One AdamW
# step at lr 5e-8 on a real gradient moves the same model's log-probs by 1.1e-3 under bf16 autocast (tolerance 0.1:
# floor 1e-4).
MOVE_FLOOR = 1e-3


def handoff_tolerance(sampler_dtype: torch.dtype, trainer_dtype: torch.dtype) -> float:
    """The hand-off check's tolerance: that of the coarser of the two compute dtypes. The sampler's is its weights'
    (a bf16 engine); the trainer's is bf16 under mixed_precision=bf16 (autocast, FSDP2's bf16 parameters), whatever
    its fp32 master weights. A stale sampler is still caught at any tolerance: `check_handoff`'s second rule."""
    return max(HANDOFF_TOLERANCE[sampler_dtype], HANDOFF_TOLERANCE[trainer_dtype])


HANDOFF_PROBE_TOKENS = 256  # the check's fixed sequence: the first training prompt, cut to this many tokens


def sequence_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log softmax(logits_t)[token_t+1] for t = 0..T-2 from one forward pass of `model` at temperature 1: (T-1,),
    float32 on the CPU. The model runs in eval mode and gets its training flag back."""
    ids = torch.tensor([token_ids], device=next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()  # (T-1, V)
    finally:
        model.train(was_training)
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1).cpu()


def check_handoff(engine, trainer, tolerance: float, previous=None) -> str | None:
    """Does a sampler hold the trainer's weights? Judged from the log-probs of one fixed token sequence.

    engine, trainer: (T-1,) log-probs of tokens 1..T-1, from `sampler.score` and from the trainer's own forward pass
    (`sequence_logprobs`). previous: the (engine, trainer) pair of the last check, or None.
    1. gap = mean_t |engine_t - trainer_t| <= tolerance (`handoff_tolerance` of the two sides' dtypes);
    2. if the trainer's log-probs moved since the last check by more than tolerance * MOVE_FLOOR per token, the
       sampler's moved too. A sampler that skipped the update returns the same numbers, bit for bit, even where one
       step moves them by less than the tolerance (lr 1e-6 seen through a bf16 engine). Below the floor a 16-bit
       sampler may round a real update away, so the rule says nothing there; a sampler that stays stale is caught
       at the first step that moves the trainer more, or by rule 1 once the gap grows.
    Returns None when both hold, else one line saying which failed."""
    engine = torch.as_tensor(engine, dtype=torch.float64)
    trainer = torch.as_tensor(trainer, dtype=torch.float64)
    if engine.shape != trainer.shape:
        return f"the sampler scored {engine.numel()} tokens, the trainer {trainer.numel()}"
    gap = (engine - trainer).abs().mean().item()
    if not gap <= tolerance:  # a NaN fails too
        return f"the sampler's log-probs differ from the trainer's by {gap:.3g} per token (tolerance {tolerance:g})"
    if previous is not None:
        moved = (trainer - torch.as_tensor(previous[1], dtype=torch.float64)).abs().mean().item()
        if moved > tolerance * MOVE_FLOOR and torch.equal(engine, torch.as_tensor(previous[0], dtype=torch.float64)):
            return (f"the trainer's log-probs moved by {moved:.3g} per token since the last hand-off and the "
                    "sampler's did not change at all: it is still generating from the old weights")
    return None


def gathered_weights(model, device, dtype=None):
    """(name, full tensor) for each parameter and persistent buffer, floats cast to `dtype` (the sampler's; None: as
    stored). Under FSDP each parameter is all-gathered when it is reached (a collective: every rank iterates, in the
    same order), its shard cast first, so a bf16 sampler halves the all-gather and what it holds. The consumer keeps
    what it needs: vLLM's layer-wise reload holds the parts of a fused weight (q, k and v; gate and up) until their
    layer is complete, so at most about one decoder layer exists unsharded at once, whatever the model's size (TRL
    and verl stream FSDP weights into vLLM the same way). A tied weight is gathered once and sent under each of its
    names: vLLM's reload loads its output layer only from `lm_head.weight` and logs a failed load without it."""
    from torch.distributed.tensor import DTensor
    persistent = model.state_dict().keys()  # communication-free under FSDP2: local shards
    tied: dict[int, tuple[torch.Tensor, list[str]]] = {}  # id(tensor) -> (tensor, its names)
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if name in persistent:
            tied.setdefault(id(t), (t, []))[1].append(name.replace("_checkpoint_wrapped_module.", ""))
    for t, names in tied.values():
        cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if isinstance(t, DTensor):
            with torch.no_grad():  # a copy for the sampler: no autograd graph over the cast and the all-gather
                t = t.to(device=device, dtype=cast).full_tensor()  # .to: parameters offloaded to CPU gather there
        for name in names:
            yield name, t.detach().to(cast)


def sampler_policy(cfg, accelerator, model):
    """The model HFSampler decodes with: the trainer's own object when this rank holds all of it; under FSDP a full
    copy of its own (decoding on the sharded model would need every rank in every forward), in the checkpoint's
    dtype, which `hand_off` fills with the trainer's weights. vLLM loads its own copy."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    policy = accelerator.unwrap_model(model)
    if cfg.sampler == "hf" and lora.is_lora(policy):  # a plain model decodes faster than adapter layers
        plain = load_pretrained(AutoModelForCausalLM, cfg.model_path, torch_dtype=input_dtype(cfg.model_path))
        return plain.to(accelerator.device)
    if cfg.sampler != "hf" or not accel.is_sharded(policy):
        return policy
    # Built from the config, not loaded: under FSDP's low-memory loading only rank 0 reads the checkpoint.
    config = AutoConfig.from_pretrained(cfg.model_path)
    with torch.device(accelerator.device):
        copy = AutoModelForCausalLM.from_config(config, torch_dtype=input_dtype(cfg.model_path))
    copy.generation_config = GenerationConfig.from_model_config(config)
    if (Path(cfg.model_path) / "generation_config.json").is_file():
        copy.generation_config = GenerationConfig.from_pretrained(cfg.model_path)
    return copy


def every_lora_weight(policy, device, dtype=None):
    """(name, tensor) of every weight a LoRA model's plain form has, by the plain model's names: W' for each adapted
    layer (`lora.merged_weight`), the frozen weights as the trainer holds them (gathered under FSDP; an adapted
    layer's W is gathered twice there, once here and once for its merge). What a sampler that discarded its
    weights needs: on one GPU a copy from the trainer's memory into the engine's, no host RAM."""
    adapted = lora.adapted_modules(policy)
    for name, t in gathered_weights(policy.get_base_model(), device, dtype):
        if ".lora_" in name:
            continue
        name = lora.plain_name(name)
        layer = name.removesuffix(".weight")
        yield name, (lora.merged_weight(adapted[layer], dtype or t.dtype) if layer in adapted else t)


def hand_off(accelerator, model, sampler) -> None:
    """Phase 9: the trainer's weights into the sampler: the module itself where this rank holds all of it, else
    the gathered parameters, streamed. Under LoRA the merged layers only, or every weight where the sampler has
    discarded its own (`missing_weights`: vLLM after a level-2 sleep, or started from dummy weights)."""
    policy = accelerator.unwrap_model(model)
    if lora.is_lora(policy) and getattr(sampler, "missing_weights", False):
        sampler.update_weights(every_lora_weight(policy, accelerator.device, sampler.dtype))
    elif lora.is_lora(policy):
        sampler.update_weights(lora.merged_weights(policy, sampler.dtype), partial=True)
    else:
        sampler.update_weights(gathered_weights(policy, accelerator.device, sampler.dtype)
                               if accel.is_sharded(policy) else policy)


def trainer_compute_dtype(accelerator, model) -> torch.dtype:
    """What the trainer's forward computes in: bf16 under mixed_precision=bf16 (fp16 alike), else its weights' dtype."""
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}
    return amp.get(accelerator.mixed_precision, next(model.parameters()).dtype)


def verify_handoff(accelerator, model, sampler, probe: list[int], when: str, previous=None) -> tuple:
    """The sampler's log-probs of the probe sequence against the trainer's own forward pass (`check_handoff`); a
    sampler left with other weights stops the run with one line. Returns this check's (sampler, trainer) log-probs,
    the `previous` of the next check."""
    # the trainer's side through Accelerate's forward (autocast under mixed precision): as the update computes
    pair = (torch.tensor(sampler.score(probe)), sequence_logprobs(accelerator.unwrap_model(model), probe))
    accel.reshard(model)  # free the groups the no-grad forward left gathered (norm, lm_head) before the rollout
    tolerance = handoff_tolerance(sampler.dtype, trainer_compute_dtype(accelerator, model))
    problem = check_handoff(*pair, tolerance, previous)
    if problem:
        raise SystemExit(f"hand-off error {when}: {problem}")
    return pair


def sync(accelerator, model, sampler, probe: list[int], when: str, previous=None) -> tuple:
    """Phase 9: `hand_off`, then `verify_handoff` (its result is the next call's `previous`)."""
    hand_off(accelerator, model, sampler)
    return verify_handoff(accelerator, model, sampler, probe, when, previous)
