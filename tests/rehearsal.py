"""The real recipe's inputs for the CPU rehearsal (tests/test_rehearsal.py, tests/test_convert_data.py): rows in the
public sets' exact layouts, and the base model.

- `dapo_rows`: DAPO-Math-17k's parquet layout (data_source, prompt as a list of one {content, role} message wrapping
  the problem in the set's fixed instruction, ability, reward_model {ground_truth, style}, extra_info {index}).
- `tir_rows`: NuminaMath-TIR's layout (problem, solution with ```python / ```output blocks, messages: the problem and
  the solution as a two-message chat).
- `write_parquet`: the rows as a parquet file, as the hub serves them (pyarrow).
- `base_model`: a random Qwen3 of Qwen3-Base's vocabulary (qwen_vocab.random_qwen3: bf16, tied embeddings, eos
  <|endoftext|>), then taught, here, what a base model brings to RL and a random one cannot: on the rehearsal's two
  problems it calls the code tool and then answers, right about half the time. Without that every RL group would be
  all wrong, no gradient would flow and nothing of the update (the masters, the hand-off's "moved" rule, the
  memory of a real backward) could be checked. Saved back in bf16, as a hub checkpoint is.
"""
import json
from pathlib import Path

import torch

from tools.convert_data import DAPO_PREFIX, DAPO_SUFFIX
from protocol import TOOL_NAME, chat_format

# (problem, answer, code that computes it): integer answers, as DAPO-Math-17k's are
PROBLEMS = [("Compute $17 \\times 23$.", 391, "print(17 * 23)"),
            ("What is $2^{10} - 1$?", 1023, "print(2 ** 10 - 1)")]


def dapo_rows() -> list[dict]:
    """The problems as DAPO-Math-17k rows (its released file repeats its block; here twice)."""
    rows = [{"data_source": "math_dapo",
             "prompt": [{"content": DAPO_PREFIX + problem + DAPO_SUFFIX, "role": "user"}],
             "ability": "MATH", "reward_model": {"ground_truth": str(answer), "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": f"rehearsal-{i}"}} for i, (problem, answer, _) in enumerate(PROBLEMS)]
    return rows * 2


def tir_rows() -> list[dict]:
    """NuminaMath-TIR rows: two usable solutions (one with two calls, one with sympy), one whose recorded output is
    not what the code prints, one without a boxed answer."""
    solutions = [
        ("What is the sum of the first ten positive integers?",
         "We add them with Python.\n\n```python\nprint(sum(range(1, 11)))\n```\n```output\n55\n```\n"
         "Check with the formula $n(n+1)/2$:\n```python\nn = 10\nprint(n * (n + 1) // 2)\n```\n```output\n55\n```\n"
         "Both give $\\boxed{55}$."),
        ("Solve $x^2 = 4$ for $x > 0$.",
         "Let sympy solve it.\n```python\nimport sympy as sp\nx = sp.symbols('x')\nprint(sp.solve(x**2 - 4, x))\n"
         "```\n```output\n[-2, 2]\n```\nThe positive root is $\\boxed{2}$."),
        ("What is $3 \\cdot 5$?", "```python\nprint(3 * 5)\n```\n```output\n16\n```\nSo $\\boxed{16}$."),
        ("Name a prime.", "```python\nprint(7)\n```\n```output\n7\n```\nSeven is prime."),
    ]
    return [{"problem": p, "solution": s, "messages": [{"content": p, "role": "user"},
                                                        {"content": s, "role": "assistant"}]} for p, s in solutions]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def taught_conversations() -> list[list[dict]]:
    """For each problem: a call to the tool, its reply, then the right answer, and the same with a wrong one."""
    out = []
    for problem, answer, code in PROBLEMS:
        call = [{"function": {"name": TOOL_NAME, "arguments": {"code": code}}}]
        for given in (answer, answer + 1):
            out.append([{"role": "user", "content": problem},
                        {"role": "assistant", "content": "Compute it with Python.</reason>\n", "tool_calls": call},
                        {"role": "tool", "content": f"ok\n{answer}\n"},
                        {"role": "assistant", "content": f"</reason>\n<answer>\\boxed{{{given}}}</answer>"}])
    return out


def base_model(folder: Path, steps: int = 60, lr: float = 1e-2, system_prompt: str = "default") -> Path:
    """The rehearsal's base model (module docstring), saved in bf16 with Qwen3-Base's tokenizer in `folder`."""
    from tools import qwen_vocab
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from sft import build_labels, IGNORE
    qwen_vocab.random_qwen3(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    chat = chat_format(system_prompt)
    examples = [build_labels(tok, chat.render_messages(m)) for m in taught_conversations()]
    width = max(len(ids) for ids, _ in examples)  # one right-padded batch: one embedding backward per step
    ids = torch.full((len(examples), width), tok.pad_token_id)
    labels = torch.full((len(examples), width), IGNORE)
    for row, (i, lab) in enumerate(examples):
        ids[row, :len(i)], labels[row, :len(lab)] = torch.tensor(i), torch.tensor(lab)
    mask = (torch.arange(width) < torch.tensor([len(i) for i, _ in examples])[:, None]).long()
    targets = labels[:, 1:]
    keep = (targets != IGNORE).any(0).nonzero().squeeze(-1)  # logits only where a trained token is predicted
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for _ in range(steps):
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits  # (n, kept, V)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets[:, keep].flatten(),
                                                     ignore_index=IGNORE)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.to(torch.bfloat16).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] and config["eos_token_id"] == 151_643
    return folder
