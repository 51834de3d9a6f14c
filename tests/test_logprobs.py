"""plumbing/logprobs.py: the chunked log-probs of the sampled tokens equal the direct log-softmax (values and gradients), the
logits are the only (tokens x vocabulary) tensor they keep, and batches.token_logprobs uses them."""
import pytest
import torch

from plumbing import logprobs
from plumbing.logprobs import chunk_positions, sampled_logprobs

pytestmark = pytest.mark.spec  # the one-minute tier: make test-fast


def direct(logits, targets, temperature):
    """The way batches.token_logprobs computed it before: the full fp32 log-softmax, gathered."""
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("n, vocab, chunk", [(37, 1000, 1 << 12), (5, 151_936, 1 << 18), (64, 50, 1 << 24)])
def test_values_and_gradients_equal_the_direct_log_softmax(monkeypatch, n, vocab, chunk, temperature):
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", chunk)  # several chunks, a last one cut short, or one chunk
    g = torch.Generator().manual_seed(n)
    base = torch.randn(n, vocab, generator=g) * 3
    targets = torch.randint(vocab, (n,), generator=g)
    weights = torch.randn(n, generator=g)  # a loss that weighs each position differently (as advantages do)
    ref_logits, new_logits = base.clone().requires_grad_(), base.clone().requires_grad_()
    ref = direct(ref_logits, targets, temperature)
    new = sampled_logprobs(new_logits * 1, targets, temperature)  # `* 1`: a fresh tensor the backward may overwrite
    torch.testing.assert_close(new, ref, rtol=0, atol=1e-5)
    (ref * weights).sum().backward()
    (new * weights).sum().backward()
    torch.testing.assert_close(new_logits.grad, ref_logits.grad, rtol=0, atol=1e-5)


def test_bf16_logits_give_the_log_softmax_of_their_fp32_values():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(9, 3000, generator=g) * 4).bfloat16()
    targets = torch.randint(3000, (9,), generator=g)
    torch.testing.assert_close(sampled_logprobs(logits, targets, 0.7), direct(logits.float(), targets, 0.7),
                               rtol=0, atol=1e-5)


def test_no_grad_keeps_nothing_and_leaves_the_logits_alone():
    logits = torch.randn(4, 100)
    before = logits.clone()
    with torch.no_grad():
        out = sampled_logprobs(logits, torch.tensor([1, 2, 3, 4]), 0.5)
    assert out.grad_fn is None and torch.equal(logits, before)


def test_chunks_hold_at_most_chunk_elements_and_at_least_one_position():
    assert chunk_positions(151_936) == (1 << 24) // 151_936 == 110
    assert chunk_positions(1 << 30) == 1


def test_token_logprobs_of_a_model_match_the_direct_way():
    """batches.token_logprobs on a real causal LM: the shift (position t scores token t+1) and the temperature."""
    from tiny.model import build_model, build_tokenizer
    from plumbing import batches
    tok = build_tokenizer()
    model = build_model(tok, hidden=32, layers=1, heads=2)
    ids = torch.randint(len(tok), (2, 11), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    got = batches.token_logprobs(model, batch, 0.8)
    logits = model(input_ids=ids).logits[:, :-1]
    want = direct(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), 0.8).view(2, 10)
    assert got.shape == (2, 10)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
