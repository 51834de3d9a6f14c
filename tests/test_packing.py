"""Packed micro-batches (batches.pack_batch: rollouts end to end, positions restarting at each, no attention mask)
give the padded micro-batch's log-probs (batches.pad_batch) within float tolerance, on the tiny model and on a Qwen3 of
the real vocabulary, in fp32 and bf16, under sdpa and eager attention, in rows capped at the longest rollout and
in one row; and an update on packed micro-batches gives the padded one's weights.

Tolerances. fp32: 1e-5, ten times the largest difference between a padded micro-batch and each rollout forwarded
on its own (9.5e-7 here): the rounding fp32 has anyway when a batch's shape changes. bf16: 1e-2, five times that
same difference in bf16 (2.0e-3): bf16 keeps 8 significant bits, so a log-prob near -5 moves by ~2e-3 when its
matmuls see other neighbours. Packed rows capped at the longest rollout reproduce the padded numbers exactly here
(the same row width, the same kernels); one row differs by that rounding."""
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

import train
from plumbing import batches
from one_process import one_process_work
from plumbing.update_plan import FILLER_TOKENS, MicroBatch, TrainRow, fit_rows
from test_train import kept_batch, tiny, updated_weights  # noqa: F401 (tiny: the module's model fixture)
from tiny.model import build_model, build_tokenizer
from tools.qwen_vocab import SHAPES

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
LENGTHS = [37, 120, 9, 64, 80, 5]  # prompt + response tokens of six rollouts


def rows(vocab: int, lengths=LENGTHS) -> list[TrainRow]:
    """Random token ids, a quarter of each sequence prompt, every seventh response token tool text (mask 0)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for n in lengths:
        ids, p = torch.randint(1, vocab, (n,), generator=g).tolist(), max(1, n // 4)
        out.append(TrainRow(ids[:p], ids[p:], [int(j % 7 != 0) for j in range(n - p)], None, 1.0))
    return out


MODELS = {"tiny": lambda: build_model(build_tokenizer()),
          "qwen3-vocab": lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPES["rehearsal"]))}


CASES = [pytest.param(name, attention, dtype, id=f"{name}-{attention}-{str(dtype)[6:]}",
                      marks=[pytest.mark.spec] if (name, dtype) == ("tiny", torch.float32) else [])
         for name in MODELS for attention in ("sdpa", "eager") for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("name, attention, dtype", CASES)  # the spec tier: the tiny model in fp32 (bf16 on CPU is slow)
def test_packed_log_probs_equal_the_padded_ones(name, attention, dtype):
    torch.manual_seed(0)
    model = MODELS[name]().to(dtype).eval()
    model.config._attn_implementation = attention
    batch = rows(model.config.vocab_size)
    tokens = [len(t.prompt_ids) + len(t.response_ids) for t in batch]
    layouts = {"rows": MicroBatch(fit_rows(range(len(batch)), tokens, max(tokens)), max(tokens)),
               "one row": MicroBatch([list(range(len(batch)))], sum(tokens))}
    with torch.no_grad():
        for name, layout in layouts.items():
            micro = MicroBatch([[batch[i] for i in row] for row in layout.rows], layout.width)
            padded_batch = batches.pad_batch(micro.items(), pad_id=0)  # the same rollouts in the packed order
            mask = padded_batch["loss_mask"].bool()
            padded = batches.token_logprobs(model, padded_batch, 1.0)
            packed_batch = batches.pack_batch(micro, 0)
            assert packed_batch["input_ids"].numel() < padded_batch["input_ids"].numel()  # less padding forwarded
            packed = batches.token_logprobs(model, packed_batch, 1.0)
            assert packed.shape == padded.shape
            assert (packed - padded).abs()[mask].max() <= TOL[dtype], name
        # the control: the same rows with positions that run on across sequences attend to their neighbours
        packed_batch["position_ids"] = torch.arange(packed_batch["input_ids"].shape[1]).expand_as(
            packed_batch["position_ids"])
        assert (batches.token_logprobs(model, packed_batch, 1.0) - padded).abs()[mask].max() > 10 * TOL[dtype]


@pytest.mark.spec
def test_rows_are_filled_best_fit_longest_first_and_count_their_padding():
    rows = fit_rows(range(6), LENGTHS, 120)  # [37, 120, 9, 64, 80, 5]
    assert rows == [[1], [4, 0], [3, 2, 5]]
    assert MicroBatch(rows, 120).forwarded() == 360  # 45 of them padding
    assert MicroBatch([[0, 1]], 157).forwarded() == 157 and MicroBatch([], 0).forwarded() == FILLER_TOKENS
    assert fit_rows([0, 1], [50, 200], 100) == [[1], [0]]  # longer than the width: a row of its own


@pytest.mark.spec
def test_an_update_on_packed_micro_batches_gives_the_padded_update(tiny):  # noqa: F811
    _, kept = kept_batch(tiny)
    for budget in (0, 200):
        work, _, _ = one_process_work(kept, train.TrainConfig(micro_batch_size=2, max_tokens_per_micro_batch=budget))
        slots = work.minibatches[0]
        assert len(slots) > 1  # several micro-batches either way: the normaliser spans them
        assert budget == 0 or all(s.forwarded() <= budget for s in slots)
    padded, _ = updated_weights(tiny, kept, 2, max_tokens_per_micro_batch=0)
    packed, _ = updated_weights(tiny, kept, 2, max_tokens_per_micro_batch=200)
    base = torch.cat([p.flatten() for p in AutoModelForCausalLM.from_pretrained(tiny / "base").parameters()])
    assert (padded - base).abs().max() > 1e-4
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-6)
