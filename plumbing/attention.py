"""Which attention kernel the policy's forwards run (the config field `attn_implementation` of sft.py, train.py and
eval.py), and what that choice changes.

- The names (`check`): `auto` (the default: `default_attention` picks for this machine), `sdpa` and `eager` (always
  there), every `flash_attention_N` and `flex_attention` that the installed transformers registers, and a hub kernel
  named `org/repo[:function]` (transformers loads it through the `kernels` package, downloading it). `paged|...`
  names are transformers' continuous-batching generate, not a training forward: refused. A flash kernel whose
  package is not importable is refused with one line (transformers would instead fetch a hub build through
  `kernels` where that is installed: name the hub kernel to get that on purpose).
- The default (`default_attention`): flash_attention_2 where torch sees a GPU (CUDA, or ROCm, whose flash_attn
  build transformers drives the same way) and the `flash_attn` package imports; sdpa everywhere else.
- The layout of packed micro-batches (`one_row`): transformers routes every name with "flash" in it through its
  flash path, which reads each sequence's bounds from position_ids in a batch of ONE row (cu_seqlens where the
  positions restart) and builds no mask; with several rows it would let a row's sequences attend to each other. So
  under flash a packed micro-batch is one row (update_plan.layout_for, sft.pack). sdpa, eager and flex get a mask
  built from position_ids instead (rows about as wide as the longest sequence; sdpa's and eager's a dense
  (rows, 1, width, width) tensor, which tools/memory_plan.py counts).
- The transformers floor for packing (`packing_problem`): sdpa and eager keep packed sequences apart from
  position_ids since transformers 4.53.1 (masking_utils.find_packed_sequence_indices, transformers PR 39194,
  shipped in that patch release); 4.53.0 and older give a packed sequence its neighbours' tokens to attend to.
"""
import importlib.util
import re

import torch

PACKING_FLOOR = "4.53.1"  # the first transformers release whose sdpa/eager masks keep packed sequences apart
FLASH_PACKAGES = {"flash_attention_2": ("flash_attn", "flash-attn"),  # name -> (module, pip package)
                  "flash_attention_3": ("flash_attn_interface", "flash-attn-3 (FlashAttention's hopper/ build)"),
                  "flash_attention_4": ("flash_attn.cute", "flash-attn-4")}
HUB_KERNEL = re.compile(r"^[^/:|]+/[^/:|]+(?:@[^/:]+)?(?::[^/:]+)?$")  # transformers' hub_kernels.is_kernel pattern


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a dotted name whose parent is missing
        return False


def default_attention() -> str:
    """`auto` on this machine: flash_attention_2 on a GPU with flash_attn importable, else sdpa."""
    return "flash_attention_2" if torch.cuda.is_available() and importable("flash_attn") else "sdpa"


def resolve(name: str) -> str:
    """The attention a config's `attn_implementation` runs here (`auto` resolved)."""
    return default_attention() if name == "auto" else name


def registered() -> list[str]:
    """The names the installed transformers dispatches to (its AttentionInterface, plus eager)."""
    from transformers import AttentionInterface
    return ["eager"] + [k for k in AttentionInterface().valid_keys() if not k.startswith("paged|")]


def check(name: str, loading: bool = True) -> str | None:
    """Why `attn_implementation=name` cannot run here, in one line, or None. loading=False (a dry run, which loads
    no model) checks the name only, not the packages."""
    if name == "auto":
        return None
    if HUB_KERNEL.match(name):
        if loading and not importable("kernels"):
            return (f"attn_implementation={name}: a hub kernel is loaded through the kernels package "
                    "(pip install kernels), which is not importable here")
        return None
    known = registered()
    if name not in known:
        return (f"attn_implementation must be auto, a hub kernel (org/repo) or one of {known} (transformers "
                f"{transformers_version()}), got {name!r}")
    if loading and name in FLASH_PACKAGES and not importable(FLASH_PACKAGES[name][0]):
        module, package = FLASH_PACKAGES[name]
        return (f"attn_implementation={name} needs the {module} module (pip install {package}), which is not "
                "importable here; use sdpa, or auto")
    return None


def one_row(name: str) -> bool:
    """Whether packed micro-batches go in one row under this attention: transformers' flash path (every name with
    "flash" in it) keeps packed sequences apart only within a batch of one row."""
    return "flash" in resolve(name)


def transformers_version() -> str:
    import transformers
    return transformers.__version__


def packing_problem(version: str, what: str) -> str | None:
    """One line when this transformers release packs wrongly (older than PACKING_FLOOR), else None; `what` names the
    setting that packs (e.g. "max_tokens_per_micro_batch=49152")."""
    from packaging.version import Version
    if Version(version) >= Version(PACKING_FLOOR):
        return None
    return (f"{what} packs sequences into rows, and transformers {version} lets a packed sequence attend to the "
            f"ones before it in its row: packing needs transformers >= {PACKING_FLOOR} (pip install -U transformers)")


def load_kwargs(name: str) -> dict:
    """from_pretrained's keyword for the attention (`auto` resolved), after `check` has passed."""
    return {"attn_implementation": resolve(name)}
