"""`python tests/run_scripted_train.py [train.py args]`: train.py's real entry point with the scripted policy
(tests/scripted_policy.py), for tests that need a separate process (SIGKILL, torchrun). SCRIPTED_RNG=1 makes the
policy's answers depend on the global torch RNG. Each rank writes rank{R}.json (world size, weight checksum)."""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import train  # noqa: E402
from scripted_policy import ScriptedSampler, weights_sum  # noqa: E402

if __name__ == "__main__":
    made = []

    def make(cfg, model, tokenizer):
        made.append(ScriptedSampler(model, tokenizer, use_rng=os.environ.get("SCRIPTED_RNG") == "1"))
        return made[-1]

    train.make_sampler = make
    train.main(sys.argv[1:])
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    out = Path(next(a for a in sys.argv[1:] if a.startswith("out_dir=")).split("=", 1)[1])
    weights = {k: v.detach().flatten()[:4].tolist() for k, v in made[0].model.state_dict().items()}
    (out / f"rank{rank}.json").write_text(json.dumps({"world_size": world, "checksum": weights_sum(made[0].model),
                                                      "weights": weights}))
