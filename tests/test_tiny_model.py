"""tiny/model.py: the character tokenizer round-trips the protocol exactly; the model loads like a real checkpoint."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from protocol import IM_END, SPECIAL_TOKENS, TOOL_NAME, chat_format, tool_response_turn
from tiny.model import PHRASES, build_tiny, main

pytestmark = pytest.mark.spec  # the one-minute tier: make test-fast


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = build_tiny(tmp_path_factory.mktemp("tiny"))
    return path, AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)


def test_markers_and_characters_are_single_tokens(saved):
    _, tok, model = saved
    for marker in SPECIAL_TOKENS:
        assert len(tok.encode(marker, add_special_tokens=False)) == 1, marker
    chars = "".join(chr(c) for c in range(32, 127)) + "\n\t"
    ids = tok.encode(chars, add_special_tokens=False)
    assert len(ids) == len(chars) and tok.unk_token_id not in ids
    assert tok.eos_token == IM_END and tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    assert len(tok) == model.config.vocab_size == 2 + len(SPECIAL_TOKENS) + len(PHRASES) + len(chars)
    assert tok.encode("é", add_special_tokens=False) == [tok.unk_token_id]
    assert tok.encode("ab", add_special_tokens=True) == tok.encode("ab", add_special_tokens=False)  # no BOS added


def test_full_conversation_round_trips_exactly(saved):
    _, tok, _ = saved
    convo = [{"role": "user", "content": "What is  12 *\t34?\n\nTwo  spaces, tab, blank line. "},
             {"role": "assistant", "content": "I will use Python.</reason>\n",
              "tool_calls": [{"function": {"name": TOOL_NAME,
                                           "arguments": {"code": "a = 12\nprint(a * 34)", "input": " 1 2\n"}}}]},
             {"role": "tool", "content": "ok\n408\n"},
             {"role": "assistant", "content": "</reason>\n<answer>\\boxed{408}</answer>"}]
    for fmt in (chat_format("compact"), chat_format("default")):
        text = "".join(segment for segment, _ in fmt.render_messages(convo))
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        # Encoding pieces separately gives the same ids as encoding the whole (the rollout appends pieces).
        pieces = sum((tok.encode(s, add_special_tokens=False) for s, _ in fmt.render_messages(convo)), [])
        assert pieces == ids
    env = tool_response_turn("error\nTraceback ...\n  x\n")
    assert tok.decode(tok.encode(env, add_special_tokens=False)) == env
    # skip_special_tokens drops only the ChatML markers and padding, never the protocol tags
    assert tok.decode(tok.encode("<answer>\\boxed{1}</answer><|im_end|>"), skip_special_tokens=True) == \
        "<answer>\\boxed{1}</answer>"


def test_model_is_about_1m_parameters_tied_and_generates(saved):
    _, tok, model = saved
    n = sum(p.numel() for p in model.parameters())
    assert 0.9e6 < n < 1.2e6
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.max_position_embeddings >= 2048 and model.generation_config.eos_token_id == tok.eos_token_id
    ids = torch.tensor([tok.encode("hi", add_special_tokens=False)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 7)


def test_size_and_seed_are_configurable(tmp_path):
    a = AutoModelForCausalLM.from_pretrained(build_tiny(tmp_path / "a", hidden=32, layers=2, heads=2, seed=1))
    b = AutoModelForCausalLM.from_pretrained(build_tiny(tmp_path / "b", hidden=32, layers=2, heads=2, seed=1))
    main([str(tmp_path / "c"), "--hidden", "32", "--layers", "2", "--heads", "2", "--seed", "2"])
    c = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    assert a.config.hidden_size == 32 and a.config.num_hidden_layers == 2 and a.config.intermediate_size == 128
    assert sum(p.numel() for p in a.parameters()) < 100_000
    assert model_equal(a, b) and not model_equal(a, c)
    cli_tok = AutoTokenizer.from_pretrained(tmp_path / "c")  # the CLI wrote a loadable tokenizer too
    assert cli_tok.decode(cli_tok.encode("x = 1\n", add_special_tokens=False)) == "x = 1\n"


def model_equal(m1, m2) -> bool:
    return all(torch.equal(p, q) for p, q in zip(m1.state_dict().values(), m2.state_dict().values()))
