"""plumbing/attention.py: attn_implementation as a setting of sft.py, train.py and eval.py (its values, the default
per device, the one-line refusal of a kernel that is not installed), packing refused on a transformers older than
the bound, and what a CPU can show of the flash path: one-row micro-batches, positions restarting per sequence, what
the model's attention receives, and that those rows give the padded layout's log-probs.

The flash path on a CPU: transformers dispatches attention by name (AttentionInterface), so the tests register, under
the name flash_attention_2, a function that does what flash attention's varlen kernel does with what transformers
hands it (the sequences' bounds read from position_ids where the positions restart, as transformers' own
prepare_fa_kwargs_from_position_ids reads them; each sequence attended causally on its own; a batch of several rows
taken whole, as transformers' flash path takes it) with torch's sdpa, and records its inputs. Everything around it
is transformers' real flash path: its mask function for flash (none for a packed row) and its kwargs."""
import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

import eval as ev
import sft
import train
from one_process import one_process_work
from plumbing import attention, batches, rl_stage
from plumbing.config import parse_cli
from plumbing.train_config import validate
from samplers.hf import HFSampler
from test_train import kept_batch, tiny  # noqa: F401 (tiny: the module's model fixture)
from tiny.model import build_model, build_tokenizer



@pytest.mark.spec
# ============================================================================ the setting
@pytest.mark.parametrize("entry", [train.TrainConfig, sft.SFTConfig, ev.EvalConfig])
def test_attn_implementation_is_listed_by_each_entry_point_s_help(entry, capsys):
    """What `python train.py --help` (sft.py, eval.py) prints: parse_cli's help of the entry point's config."""
    with pytest.raises(SystemExit) as stop:
        parse_cli(entry, ["--help"], usage="")
    assert stop.value.code in (0, None)
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, x in enumerate(lines) if x.strip().startswith("attn_implementation (str, default 'auto')"))
    assert "sdpa | eager | flash_attention_2" in lines[at + 1], lines[at + 1]


def rl_config(**kw):
    return train.TrainConfig(data=["problems.jsonl"], **kw)


@pytest.mark.spec
def test_an_attention_whose_kernel_is_not_installed_is_refused_with_one_line(monkeypatch):
    with pytest.raises(SystemExit) as stop:  # this machine has no flash_attn
        validate(rl_config(attn_implementation="flash_attention_2"), 1)
    said = str(stop.value)
    assert said.startswith("config error: attn_implementation=flash_attention_2 needs the flash_attn module "
                           "(pip install flash-attn)") and "\n" not in said
    validate(rl_config(attn_implementation="flash_attention_2", dry_run=True), 1)  # a dry run loads no model
    for name in ("flash_attn_9", "paged|eager"):
        with pytest.raises(SystemExit, match=f"attn_implementation must be auto, .* got '{name}'"):
            validate(rl_config(attn_implementation=name), 1)
    with pytest.raises(SystemExit, match="needs the flash_attn module"):
        sft.check_inputs(sft.SFTConfig(attn_implementation="flash_attention_2"))
    with pytest.raises(SystemExit, match="needs the flash_attn module"):
        ev.check_config(ev.EvalConfig(model_path="m", attn_implementation="flash_attention_2"))
    ev.check_config(ev.EvalConfig(model_path="m", attn_implementation="flash_attention_2", sampler="vllm"))  # unused
    monkeypatch.setattr(attention, "importable", lambda module: True)  # where the package is installed
    for name in ("sdpa", "eager", "auto", "flash_attention_2", "flex_attention", "kernels-community/flash-attn2"):
        validate(rl_config(attn_implementation=name), 1)


@pytest.mark.spec
def test_auto_is_flash_attention_2_on_a_gpu_with_flash_attn_and_sdpa_elsewhere(monkeypatch):
    for gpu, package, expected in [(True, True, "flash_attention_2"), (True, False, "sdpa"), (False, True, "sdpa")]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
        monkeypatch.setattr(attention, "importable", lambda module: package and module == "flash_attn")
        assert attention.resolve("auto") == expected
        assert attention.load_kwargs("auto") == {"attn_implementation": expected}
        assert attention.one_row("auto") == (expected == "flash_attention_2")
    assert attention.resolve("eager") == "eager" and not attention.one_row("sdpa")


@pytest.mark.spec
@pytest.mark.parametrize("version, refused", [("4.53.0", True), ("4.45.2", True), ("4.53.1", False), ("5.25.0", False)])
def test_packing_is_refused_on_a_transformers_older_than_the_bound(monkeypatch, version, refused):
    """4.53.0's masks ignore position_ids: a packed sequence attends to the ones before it in its row."""
    monkeypatch.setattr(attention, "transformers_version", lambda: version)
    validate(rl_config(max_tokens_per_micro_batch=0), 1)  # padded micro-batches pack nothing
    if not refused:
        validate(rl_config(max_tokens_per_micro_batch=4096), 1)
        return
    with pytest.raises(SystemExit) as stop:
        validate(rl_config(max_tokens_per_micro_batch=4096), 1)
    assert str(stop.value) == (
        f"config error: max_tokens_per_micro_batch=4096 packs sequences into rows, and transformers {version} lets a "
        "packed sequence attend to the ones before it in its row: packing needs transformers >= 4.53.1 "
        "(pip install -U transformers)")
    with pytest.raises(SystemExit, match=f"packing=true packs .* transformers {version} .* >= 4.53.1"):
        sft.check_inputs(sft.SFTConfig(packing=True))


# ============================================================================ the flash path on a CPU
def emulated_flash(calls):
    """An attention function doing on a CPU what flash_attention_2's kernels do with transformers' inputs, recording
    them: (B, H, T, D) query, key, value -> (B, T, H, D)."""
    def attend(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        position_ids = kwargs.get("position_ids")
        calls.append({"mask": attention_mask, "positions": position_ids, "rows": query.shape[0]})
        out = torch.zeros_like(query)
        if attention_mask is None and position_ids is not None and query.shape[0] == 1:
            (cu, _), _ = prepare_fa_kwargs_from_position_ids(position_ids)  # where each packed sequence starts
            calls[-1]["cu_seqlens"] = cu.tolist()
            spans = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
        else:  # several rows (or a 2-D padding mask, unused here): flash attends causally along each row
            spans = [(0, query.shape[2])]
        for a, b in spans:
            out[:, :, a:b] = F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                            is_causal=True, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return attend


@pytest.fixture
def flash_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setitem(AttentionInterface._global_mapping, "flash_attention_2", emulated_flash(calls))
    return calls


def test_flash_packs_one_row_with_positions_restarting_and_gives_the_padded_log_probs(tiny, flash_on_cpu):  # noqa: F811
    calls = flash_on_cpu
    _, kept = kept_batch(tiny)
    model = build_model(build_tokenizer(), hidden=32, layers=2, heads=2).eval()
    model.config._attn_implementation = "flash_attention_2"
    assert rl_stage.one_row_attention(model)  # what setup gives train_step's layout_for
    cfg = train.TrainConfig(max_tokens_per_micro_batch=400)
    work, _, _ = one_process_work(kept, cfg, one_row=rl_stage.one_row_attention(model))
    micro = [m for slots in work.minibatches for m in slots]
    assert len(micro) > 1 and all(len(m.rows) == 1 for m in micro)  # every micro-batch one row
    for m in micro:
        batch, _, n = batches.make_batch(m, 0, False, cfg.max_tokens_per_micro_batch)
        lengths = [len(t.prompt_ids) + len(t.response_ids) for t in m.items()]
        assert batch["input_ids"].shape == (1, sum(lengths)) and "attention_mask" not in batch
        assert batch["position_ids"][0].tolist() == [p for n_ in lengths for p in range(n_)]  # restarting per rollout
        calls.clear()
        with torch.no_grad():
            flash = batches.token_logprobs(model, batch, 1.0)
        assert len(calls) == 2  # one call a layer, each given no mask and the row's positions
        starts = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
        assert all(c["mask"] is None and c["rows"] == 1 and c["cu_seqlens"] == starts for c in calls)
        assert torch.equal(calls[0]["positions"], batch["position_ids"])
        model.config._attn_implementation = "sdpa"  # the same weights, padded, under sdpa
        padded_batch = batches.pad_batch(m.items(), 0)
        with torch.no_grad():
            padded = batches.token_logprobs(model, padded_batch, 1.0)
        model.config._attn_implementation = "flash_attention_2"
        mask = padded_batch["loss_mask"].bool()
        assert (flash - padded).abs()[mask].max() <= 1e-5  # fp32 (tests/test_packing.py's tolerance)
    # the control: the same rollouts in two rows under flash attend across sequences within each row
    two = type(m)([m.rows[0][:2], m.rows[0][2:]], sum(lengths))
    with torch.no_grad():
        wrong = batches.token_logprobs(model, batches.pack_batch(two, 0), 1.0)
    assert (wrong - padded).abs()[mask].max() > 1e-3


@pytest.mark.spec
def test_sft_packs_one_row_under_flash_attention():
    batch = [([5, 6, 7], [-100, 6, 7]), ([8, 9], [-100, 9]), ([4, 4, 4, 4], [-100, 4, 4, 4])]
    rows = sft.pack(batch, pad_id=0)
    assert rows["input_ids"].shape == (3, 4)  # rows as wide as the longest (sdpa's layout): here one each
    one = sft.pack(batch, pad_id=0, one_row=True)
    assert one["input_ids"].tolist() == [[4, 4, 4, 4, 5, 6, 7, 8, 9]]
    assert one["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1]]
    assert one["labels"].tolist() == [[-100, 4, 4, 4, -100, 6, 7, -100, 9]] and one["num_tokens"].item() == 9


@pytest.mark.spec
def test_hf_sampler_decodes_a_flash_model_with_sdpa_and_leaves_it_flash(flash_on_cpu):
    """HFSampler gives each slot its own columns through a 4-D mask, which no flash kernel takes."""
    tok = build_tokenizer()
    model = build_model(tok, hidden=32, layers=2, heads=2).eval()
    prompts = [tok.encode("3+4="), tok.encode("12*2=")]
    expected = HFSampler(model, tok).generate(prompts, [8, 8], temperature=0.0)
    model.config._attn_implementation = "flash_attention_2"
    got = HFSampler(model, tok).generate(prompts, [8, 8], temperature=0.0)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert flash_on_cpu == [] and model.config._attn_implementation == "flash_attention_2"


def test_an_update_on_flash_s_one_row_micro_batches_gives_the_padded_update(tiny, flash_on_cpu):  # noqa: F811
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM
    _, kept = kept_batch(tiny)

    def updated(attn: str, budget: int):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny / "base")
        model.config._attn_implementation = attn
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0)
        acc = Accelerator(cpu=True)
        model, opt, sched = acc.prepare(model, opt, sched)
        cfg = train.TrainConfig(micro_batch_size=2, grad_clip=1e9, max_tokens_per_micro_batch=budget)
        work, _, normalisers = one_process_work(kept, cfg, one_row=rl_stage.one_row_attention(acc.unwrap_model(model)))
        train.update_policy(acc, model, opt, sched, work, normalisers, cfg, pad_id=0)
        return torch.cat([p.detach().flatten() for p in model.parameters()]), work
    padded, _ = updated("sdpa", 0)
    flash, work = updated("flash_attention_2", 200)
    assert all(len(m.rows) == 1 for slots in work.minibatches for m in slots) and flash_on_cpu
    base = torch.cat([p.flatten() for p in AutoModelForCausalLM.from_pretrained(tiny / "base").parameters()])
    assert (padded - base).abs().max() > 1e-4
    torch.testing.assert_close(flash, padded, rtol=0, atol=1e-6)
