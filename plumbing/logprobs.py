"""Log-probabilities of the sampled tokens, computed in chunks: no (tokens x vocabulary) tensor but the logits.

The policy update (train.py, phases 7-8) needs, at every position t with logits z_t (V,) and sampled token x_t,

    log pi(x_t | x_<t) = z_t[x_t] / T - logsumexp(z_t / T)          (T: the sampling temperature)

The direct way, `log_softmax(z.float() / T).gather(-1, x)`, allocates three fp32 (N, V) tensors (the fp32 copy, the
scaled copy, the log-softmax), keeps the log-softmax for the backward and allocates as much again there. At Qwen3's
vocabulary (V = 151,936) these are the largest tensors of the update (bench/logprob_memory.py measures both ways).

`sampled_logprobs` walks over chunks of positions instead. Forward, per chunk: the scaled fp32 logits, their
log-softmax and its value at the sampled token; nothing of it is kept (a row's log-softmax does not depend on the
other rows, so the values are the direct way's). Backward, per chunk: the softmax is recomputed, and the gradient

    d log pi(x_t) / d z_t = (onehot(x_t) - softmax(z_t / T)) / T

is written into the logits tensor itself: a chunk's logits are not needed once its gradient is known (flash-attn's
cross-entropy offers the same in-place backward). So the logits are the only (N, V) tensor from the forward to the
end of the backward, plus one chunk's fp32 temporaries. tests/test_logprobs.py checks values and gradients against
the direct way (within 1e-5 in fp32).

The one condition: the logits passed in must serve nothing else (their storage holds the gradient after the
backward). A model's output logits, handed straight over, qualify; an autograd node that had saved them would raise
("modified by an inplace operation"), never compute silently with the overwritten values.
"""
import torch

CHUNK_ELEMENTS = 1 << 24  # fp32 elements per chunk temporary (64 MB): 110 positions at V = 151,936


def chunk_positions(vocab: int) -> int:
    """Positions per chunk for a vocabulary of `vocab` entries (at least one)."""
    return max(1, CHUNK_ELEMENTS // vocab)


class _SampledLogprobs(torch.autograd.Function):
    """The chunked forward and in-place backward of `sampled_logprobs` (see the module docstring)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float):
        n, rows = logits.shape[0], chunk_positions(logits.shape[1])
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        for s in range(0, n, rows):
            # each row's log-softmax is computed exactly as over the whole tensor: the same numbers, a chunk at a time
            logp = torch.log_softmax(logits[s:s + rows].float() / temperature, dim=-1)  # (C, V) fp32
            out[s:s + rows] = logp.gather(-1, targets[s:s + rows, None]).squeeze(-1)
            del logp  # freed before the next chunk's two are made
        ctx.save_for_backward(logits, targets)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, targets = ctx.saved_tensors
        T, rows = ctx.temperature, chunk_positions(logits.shape[1])
        for s in range(0, logits.shape[0], rows):
            g = grad[s:s + rows, None].float()  # (C, 1)
            # (onehot - softmax(z / T)) * grad / T, computed in place in the recomputed softmax
            p = torch.log_softmax(logits[s:s + rows].float() / T, dim=-1).exp_()
            p.mul_(-g).scatter_add_(-1, targets[s:s + rows, None], g).div_(T)
            logits[s:s + rows] = p  # the gradient replaces this chunk's logits (cast to their dtype)
            del p
        return logits, None, None


def sampled_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[target] per position, in fp32: logits (N, V) of any float dtype, targets
    (N,) token ids -> (N,). Differentiable; the backward overwrites `logits` with its gradient (module docstring)."""
    return _SampledLogprobs.apply(logits, targets, float(temperature))
