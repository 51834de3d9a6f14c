"""LoRA (plumbing/lora.py) in train.py and sft.py: the merge against PEFT's own, what trains and what stays frozen, the
hand-off of merged layers, checkpoints of the adapter alone, a second stage that carries the adapter and its AdamW
state, and the memory plan of a one-GPU LoRA config."""
import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from plumbing import lora
import sft
import train
from plumbing import handoff, rl_stage
from plumbing.data import write_jsonl
from protocol import TOOL_NAME
from scripted_policy import ScriptedSampler, say_problems
from test_sampler import fake_vllm  # noqa: F401 (a fixture: a `vllm` package shaped like 0.33's)
from tiny.model import build_tiny
from tools.memory_plan import PUBLIC_CONFIGS, Shape

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    build_tiny(root / "base", hidden=32, layers=2, heads=2)
    model = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.bfloat16)
    model.save_pretrained(root / "base16")
    AutoTokenizer.from_pretrained(root / "base").save_pretrained(root / "base16")
    write_jsonl(root / "say.jsonl", say_problems(8))
    write_jsonl(root / "sft.jsonl", [{"messages": [
        {"role": "user", "content": f"Say {a}."},
        {"role": "assistant", "content": "Use Python.</reason>\n", "tool_calls": [
            {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"code": f"print({a})"}}}]},
        {"role": "tool", "content": str(a)},
        {"role": "assistant", "content": f"</reason>\n<answer>\\boxed{{{a}}}</answer>"}]} for a in range(8)])
    return root


def adapted(path, dtype=torch.float32, seed=0):
    """The model at `path` with a rank-4 adapter whose B is random (a fresh adapter's B is 0: nothing to merge)."""
    model = lora.add_adapter(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), 4, 8.0, lora.DEFAULT_TARGETS,
                             0.0, seed)
    with torch.no_grad():
        for layer in lora.adapted_modules(model).values():
            layer.lora_B[lora.ADAPTER].weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    return model


@pytest.mark.spec
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_weights_are_peft_s_own_merge(tiny, dtype):
    """model/'s weights (merged_state_dict) and the hand-off's layers (merged_weights) equal what PEFT's
    merge_and_unload makes of the same adapter, in the checkpoint's dtype."""
    model = adapted(tiny / ("base" if dtype == torch.float32 else "base16"), dtype)
    scaling = lora.scalings(model)
    assert len(scaling) == 2 * 7 and set(scaling.values()) == {8.0 / 4}
    ours = lora.merged_state_dict(model.state_dict(), scaling, dtype)
    handed = dict(lora.merged_weights(model))
    import copy
    peft_merge = copy.deepcopy(model).merge_and_unload().state_dict()
    assert ours.keys() == peft_merge.keys()
    for name, t in peft_merge.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
    assert sorted(handed) == sorted(f"{n}.weight" for n in scaling)  # the adapted layers, nothing else
    for name, t in handed.items():
        assert torch.equal(t, peft_merge[name]), name
    plain = AutoModelForCausalLM.from_pretrained(tiny / "base", dtype=dtype).state_dict()
    assert sum(not torch.equal(plain[n], t) for n, t in ours.items()) == len(scaling)  # only those changed


@pytest.mark.spec
def test_a_layer_fused_with_an_adapted_one_is_handed_off_with_it(tiny):
    """vLLM loads q, k, v (and gate, up) as one weight, whole: with q, v and up adapted, k and gate go along as they
    are; o and down, neither adapted nor fused with an adapted layer, stay where they are."""
    model = lora.add_adapter(AutoModelForCausalLM.from_pretrained(tiny / "base"), 4, 8.0,
                             ["q_proj", "v_proj", "up_proj"], 0.0, 0)
    handed = dict(lora.merged_weights(model))
    kinds = sorted({name.split(".")[-2] for name in handed})
    assert kinds == ["gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"] and len(handed) == 2 * 5
    plain = AutoModelForCausalLM.from_pretrained(tiny / "base").state_dict()
    assert torch.equal(handed["model.layers.1.self_attn.k_proj.weight"], plain["model.layers.1.self_attn.k_proj.weight"])


@pytest.mark.spec
def test_the_adapter_starts_from_the_seed_alone_and_changes_nothing(tiny):
    a, b = (lora.attach(AutoModelForCausalLM.from_pretrained(tiny / "base"),
                        train.TrainConfig(lora_rank=4, seed=3)) for _ in range(2))
    torch.manual_seed(123)  # the global RNG (a rank's) plays no part
    c = lora.attach(AutoModelForCausalLM.from_pretrained(tiny / "base"), train.TrainConfig(lora_rank=4, seed=3))
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q) and torch.equal(p, r), n
    trainable = {n for n, p in a.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(p.dtype == torch.float32 for n, p in a.named_parameters() if n in trainable)
    ids = torch.tensor([[3, 4, 5, 6]])
    plain = AutoModelForCausalLM.from_pretrained(tiny / "base")
    assert torch.equal(a(input_ids=ids).logits, plain(input_ids=ids).logits)  # B = 0: W' = W


@pytest.mark.spec
def test_lora_fields_are_checked():
    with pytest.raises(SystemExit, match="lora_from needs lora_rank > 0"):
        train.validate(train.TrainConfig(data=["x.jsonl"], lora_from="runs/x/adapter"), 1)
    with pytest.raises(SystemExit, match="lora_rank must be an integer >= 0"):
        train.validate(train.TrainConfig(data=["x.jsonl"], lora_rank=-1), 1)
    with pytest.raises(SystemExit, match="lora_targets"):
        train.validate(train.TrainConfig(data=["x.jsonl"], lora_rank=4, lora_targets=[]), 1)


def args(tiny, out, *extra, model="base"):
    return ["configs/tiny/stage1.yaml", f"model_path={tiny / model}", f"data=[{tiny / 'say.jsonl'}]",
            f"out_dir={out}", "prompts_per_step=2", "rollouts_per_prompt=8", "group_size=4", "steps=2",
            "eval_data=null", "save_every=1", "max_response_tokens=96", "lr=1e-2", "warmup_steps=1", "lora_rank=4",
            *extra]


def scripted(monkeypatch, **kw):
    made = []
    monkeypatch.setattr(rl_stage, "make_sampler", lambda cfg, model, tok: made.append(
        ScriptedSampler(model, tok, **kw)) or made[-1])
    return made


def test_a_lora_stage_trains_the_adapter_hands_off_merged_layers_and_saves_both(tiny, tmp_path, monkeypatch):
    made = scripted(monkeypatch, logprob_shift=0.0)
    out = tmp_path / "run"
    train.main(args(tiny, out))
    base = AutoModelForCausalLM.from_pretrained(tiny / "base").state_dict()
    model = AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    # model/ is the base with the saved adapter merged, as PEFT merges it: the base under the adapter never moved
    from peft import PeftModel
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny / "base"),
                                       out / "adapter").merge_and_unload().state_dict()
    assert all(torch.equal(model[k], merged[k]) for k in merged)
    changed = {k for k in base if not torch.equal(base[k], model[k])}
    assert changed and all(k.split(".")[-2] in lora.DEFAULT_TARGETS for k in changed)
    # the sampler (a plain model from model_path) got exactly model/'s weights, one merged layer at a time
    assert all(torch.equal(p, model[n]) for n, p in made[0].model.state_dict().items())
    # checkpoints: the adapter's tensors only; AdamW state for those only
    saved = load_file(out / "checkpoint-2" / "model.safetensors")
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)
    state = torch.load(out / "checkpoint-2" / "optimizer.bin", weights_only=False)["state"]
    assert len(state) == len(saved) and all(s["step"] == 2 for s in state.values())
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == sorted(lora.DEFAULT_TARGETS)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["mismatch/logp_abs_diff_mean"] < 1e-5  # the sampler's numbers are the trainer's


def test_a_sampler_that_misses_the_merged_layers_stops_the_run(tiny, tmp_path, monkeypatch):
    scripted(monkeypatch, skip_updates=True)
    with pytest.raises(SystemExit, match="hand-off error after step 1"):
        train.main(args(tiny, tmp_path / "run"))


def test_a_bf16_stage_keeps_its_weights_in_bf16_and_writes_a_bf16_model(tiny, tmp_path, monkeypatch):
    made = scripted(monkeypatch)
    out = tmp_path / "run"
    train.main(args(tiny, out, model="base16"))
    model = load_file(out / "model" / "model.safetensors")
    assert {t.dtype for t in model.values()} == {torch.bfloat16}
    assert next(made[0].model.parameters()).dtype == torch.bfloat16
    base = load_file(tiny / "base16" / "model.safetensors")
    assert any(not torch.equal(base[k], model[k]) for k in base)


def test_a_second_stage_carries_the_adapter_and_its_adamw_state(tiny, tmp_path, monkeypatch):
    scripted(monkeypatch)
    one, two = tmp_path / "stage1", tmp_path / "stage2"
    train.main(args(tiny, one))
    train.main(args(tiny, two, "steps=1", "stage=2", f"lora_from={one / 'adapter'}", f"optimizer_from={one}"))
    state = torch.load(two / "checkpoint-1" / "optimizer.bin", weights_only=False)["state"]
    assert all(s["step"] == 3 for s in state.values())  # stage 1's two AdamW steps, then one more
    first = AutoModelForCausalLM.from_pretrained(one / "model").state_dict()
    second = AutoModelForCausalLM.from_pretrained(two / "model").state_dict()
    # one more step moved the same layers on from where stage 1 left them (not from the base)
    base = AutoModelForCausalLM.from_pretrained(tiny / "base").state_dict()
    moved = [k for k in base if not torch.equal(base[k], second[k])]
    assert moved and all(0 < (second[k] - first[k]).abs().max() < (second[k] - base[k]).abs().max() for k in moved)
    with pytest.raises(SystemExit, match="another shape: r 4 there, 8 in this config"):
        train.main(args(tiny, tmp_path / "bad", "lora_rank=8", f"lora_from={one / 'adapter'}"))


def test_a_lora_run_resumes_from_its_adapter_checkpoint(tiny, tmp_path, monkeypatch):
    scripted(monkeypatch)
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train.main(args(tiny, straight, "steps=3"))
    train.main(args(tiny, stopped, "steps=3", "save_every=1"))
    import shutil
    shutil.rmtree(stopped / "model")
    shutil.rmtree(stopped / "checkpoint-3")
    (stopped / "latest").write_text("checkpoint-2\n")
    train.main(args(tiny, stopped, "steps=3"))  # resumes at step 2 from the adapter alone
    a, b = (load_file(p / "model" / "model.safetensors") for p in (straight, stopped))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sft_with_lora_trains_the_adapter_and_writes_the_merged_model(tiny, tmp_path):
    out = tmp_path / "sft"
    sft.train(sft.parse_cli(sft.SFTConfig, [f"model_path={tiny / 'base16'}", f"data={tiny / 'sft.jsonl'}",
                                            f"out_dir={out}", "epochs=2", "batch_size=4", "micro_batch_size=2",
                                            "lr=1e-2", "log_every=1", "save_every=2", "system_prompt=compact",
                                            "user_instruction=", "lora_rank=4"]))
    from peft import PeftModel
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny / "base16", dtype=torch.bfloat16),
                                       out / "adapter").merge_and_unload().state_dict()
    model = load_file(out / "model" / "model.safetensors")
    assert all(torch.equal(model[k], merged[k]) for k in model)
    base = load_file(tiny / "base16" / "model.safetensors")
    assert 0 < sum(not torch.equal(base[k], model[k]) for k in base) <= 2 * 7
    saved = load_file(out / "checkpoint-2" / "model.safetensors")
    assert all(".lora_" in k for k in saved)
    losses = [json.loads(line)["sft/loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0]


# ------------------------------------------------------------------------------------------ the memory plan
@pytest.mark.spec
def test_lora_parameters_by_hand():
    shape = Shape.from_config(PUBLIC_CONFIGS["qwen3-8b"])
    # q: 4096 -> 4096, k and v: 4096 -> 1024, o: 4096 -> 4096, gate and up: 4096 -> 12288, down: 12288 -> 4096
    per_layer = 32 * ((4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 3 * (4096 + 12288))
    assert shape.lora_params(32, lora.DEFAULT_TARGETS) == 36 * per_layer
    assert shape.lora_params(32, ["q_proj", "v_proj"]) == 36 * 32 * (8192 + 5120)


@pytest.mark.spec
def test_the_one_gpu_lora_config_fits_its_card_and_full_fine_tuning_does_not(capsys):
    train.main(["configs/qwen3-8b-lora/stage1.yaml", "dry_run=true"])
    plan = capsys.readouterr().out
    assert "LoRA rank 32: 87.3M trained parameters" in plan and "OVER" not in plan and "of 85.5 GB" in plan
    peaks = [float(line.split("=")[-1].split(" of ")[0]) for line in plan.splitlines() if " of 85.5 GB" in line]
    assert len(peaks) == 2 and max(peaks) < 85.5
    train.main(["configs/qwen3-8b-lora/stage1.yaml", "dry_run=true", "lora_rank=0"])
    assert capsys.readouterr().out.count("OVER: does not fit") == 2
    assert math.isclose(Shape.from_config(PUBLIC_CONFIGS["qwen3-8b"]).params / 1e9, 8.19, abs_tol=0.01)


# ---------------------------------------------------------------- LoRA over an engine whose sleep discards its weights
class DiscardingLLM:
    """Shaped like `vllm.LLM` on a GPU with sleep mode, its worker model an fp32 HF model. `sleep(level=2)` really
    discards: every parameter is overwritten (the memory vLLM maps back on waking holds anything); the reload
    copies what it is given and, as vLLM's layer-wise reload does, warns for each layer that got nothing and leaves
    it as it is. Requests are sampled token by token with a generator seeded per request, and each one is sampled
    again, with the same seed, from PEFT's own merge of the trainer's live model (`policy`): `samples` holds both."""

    def __init__(self, path, policy, dummy: bool):
        self.model, self.policy, self.samples, self.pending = AutoModelForCausalLM.from_pretrained(path), policy, [], {}
        if dummy:  # vLLM's dummy weights: small random values, nothing read from the checkpoint
            self._overwrite(0.001)
        import types
        self.llm_engine = types.SimpleNamespace(
            model_config=types.SimpleNamespace(dtype=torch.float32, enable_sleep_mode=True),
            add_request=lambda rid, prompt, sp: self.pending.setdefault(rid, (prompt["prompt_token_ids"], sp)),
            step=self._step, engine_core=types.SimpleNamespace(shutdown=lambda: None))

    def _overwrite(self, scale: float):
        g = torch.Generator().manual_seed(len(self.samples) + 17)
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * scale)

    def sleep(self, level=1):
        assert level == 2 and not self.pending
        self._overwrite(1.0)

    def wake_up(self, tags=None):
        pass

    def reset_prefix_cache(self):
        pass

    def collective_rpc(self, method, kwargs=None):
        import logging
        from samplers.vllm_engine import RELOAD_LOGGER
        assert method == "reload_weights"
        given = dict(kwargs["weights_iterator"])
        params = dict(self.model.named_parameters(remove_duplicate=False))
        assert set(given) <= set(params), set(given) - set(params)
        with torch.no_grad():
            for name, t in given.items():
                params[name].copy_(t)
        for name, module in self.model.named_modules():
            own = [f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)]
            if own and not any(n in given for n in own):
                logging.getLogger(RELOAD_LOGGER).warning("%s: Failed to load weights", type(module).__name__)

    @staticmethod
    def sample(model, prompt, sp, seed):
        from test_sampler import Logprob
        g, ids, lps = torch.Generator().manual_seed(seed), list(prompt), []
        for _ in range(sp.max_tokens):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            logp = torch.log_softmax(logits / sp.temperature, -1)
            token = int(torch.multinomial(logp.exp(), 1, generator=g))
            ids.append(token)
            lps.append({token: Logprob(logp[token].item())})
            if token in sp.stop_token_ids:
                break
        return ids[len(prompt):], lps

    def _step(self):
        import copy
        import types
        from test_sampler import FakeCompletionOutput
        merged = copy.deepcopy(self.policy).merge_and_unload()
        outs = []
        for rid, (prompt, sp) in self.pending.items():
            seed = len(self.samples) if sp.seed is None else sp.seed
            ids, lps = self.sample(self.model, prompt, sp, seed)
            self.samples.append((ids, self.sample(merged, prompt, sp, seed)[0]))
            reason = "stop" if ids[-1] in sp.stop_token_ids else "length"
            outs.append(types.SimpleNamespace(request_id=rid, finished=True, outputs=[
                FakeCompletionOutput(0, "", ids, None, lps, reason)]))
        self.pending.clear()
        return outs

    def generate(self, prompts, params, use_tqdm=True):
        """Scoring only (`VLLMSampler.score`: prompt_logprobs at temperature 1)."""
        from test_sampler import FakeRequestOutput, Logprob
        (prompt,), ids = prompts, prompts[0]["prompt_token_ids"]
        assert params.prompt_logprobs == 0
        with torch.no_grad():
            logp = torch.log_softmax(self.model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
        out = FakeRequestOutput("0", ids, [])
        out.prompt_logprobs = [None] + [{t: Logprob(logp[k, t].item())} for k, t in enumerate(ids[1:])]
        return [out]


@pytest.mark.parametrize("start", ["checkpoint", "dummy"])
def test_lora_over_an_engine_whose_sleep_discards_its_weights(tiny, tmp_path, monkeypatch, fake_vllm, start):
    """Three LoRA steps over an engine that sleeps at level 2 and really loses its weights there (and, with
    `start=dummy`, starts from random ones): each hand-off after a discard sends every weight, the hand-off check
    stays green, and every rollout is token for token what PEFT's merge of the trainer's model samples."""
    from samplers.vllm_engine import VLLMSampler
    made = []

    def make(cfg, model, tok):
        made.append(VLLMSampler(None, tok, llm=DiscardingLLM(cfg.model_path, model, start == "dummy"),
                                **({"load_format": "dummy"} if start == "dummy" else {})))
        return made[-1]

    monkeypatch.setattr(rl_stage, "make_sampler", make)
    out = tmp_path / "run"
    train.main(args(tiny, out, "sampler=vllm", "steps=3", "save_every=3", "max_response_tokens=24",
                    "rollouts_per_prompt=4"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r][-1] == 3
    samples = made[0].llm.samples
    assert len(samples) >= 3 * 2 * 4 and all(engine == merged for engine, merged in samples)


def test_an_update_after_a_discard_that_leaves_a_layer_out_is_one_error(tiny, fake_vllm):
    """After a level-2 sleep a partial update is refused, and so is a full one that misses a layer: one line each,
    where vLLM would only warn and keep the discarded layer's contents."""
    from samplers.vllm_engine import VLLMSampler
    model = adapted(tiny / "base")
    sampler = VLLMSampler(None, im_end_id=3, llm=DiscardingLLM(tiny / "base", model, dummy=False))
    sampler.sleep()
    with pytest.raises(RuntimeError, match=r"partial=True\) while the engine's weights are discarded"):
        sampler.update_weights(lora.merged_weights(model), partial=True)
    without_norms = [(n, t) for n, t in handoff.every_lora_weight(model, "cpu") if "norm" not in n]
    with pytest.raises(RuntimeError, match=r"discarded and these got none: Qwen3RMSNorm; send every weight"):
        sampler.update_weights(without_norms)
    sampler.update_weights(handoff.every_lora_weight(model, "cpu"))
    assert not sampler.missing_weights
