"""FSDP on CPU processes, for tests. Accelerate runs FSDP only on accelerators: with `cpu=True` (what train.py passes
without a GPU) Accelerate 1.15 sets up gloo and then picks DDP (MULTI_CPU), whatever the FSDP config says, while
torch's FSDP2 itself shards and gathers over gloo.

`enable()` replaces `accelerate.Accelerator` with a subclass that, once gloo is up, switches Accelerate's state to
FSDP with the plugin the caller passed (accel.fsdp_plugin), or else the one `accelerate launch` builds from the config
file (its FSDP_* variables), and sets its mixed precision as AcceleratorState does on GPUs (bf16 parameters in the forward and backward). Accelerate's own FSDP2
code then runs on CPU processes: `fully_shard` of each decoder layer at `prepare`, rank 0's weights broadcast to the
others (low-memory loading), sharded checkpoints, the full state dict for saving. It writes Accelerate's shared
state: a newer Accelerate may need a change here, which the tests using it would show by failing.

    accelerate launch --config_file configs/accelerate/fsdp_1node_8gpu.yaml --num_processes 2 \
        tests/cpu_fsdp.py sft.py configs/tiny/sft.yaml ...        # any entry point, FSDP on CPU processes
"""
import runpy
import sys
from pathlib import Path

import accelerate
from accelerate.state import AcceleratorState, PartialState
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin


def enable() -> None:
    class CPUFSDPAccelerator(accelerate.Accelerator):
        def __init__(self, *args, **kwargs):
            # A launch with a parallelism config (HSDP's 2-D mesh) is validated inside Accelerator.__init__, which
            # refuses it for MULTI_CPU: the check waits until the state says FSDP.
            validate, ParallelismConfig._validate_accelerator = ParallelismConfig._validate_accelerator, \
                lambda self, accelerator: None
            try:
                super().__init__(*args, **kwargs)
            finally:
                ParallelismConfig._validate_accelerator = validate
            if self.distributed_type == DistributedType.MULTI_CPU:
                # the caller's plugin, else one from the FSDP_* variables of `accelerate launch`
                plugin = kwargs.get("fsdp_plugin") or FullyShardedDataParallelPlugin()
                if self.state.mixed_precision != "no":  # AcceleratorState's step on GPUs (it keeps a set policy)
                    plugin.set_mixed_precision(self.state.mixed_precision)
                for shared in (PartialState._shared_state, AcceleratorState._shared_state):
                    shared["distributed_type"] = DistributedType.FSDP
                AcceleratorState._shared_state["fsdp_plugin"] = plugin
            if self.parallelism_config:
                self.parallelism_config._validate_accelerator(self)

    accelerate.Accelerator = CPUFSDPAccelerator


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from plumbing import accel
    enable()
    sys.argv = sys.argv[1:]
    # whatever the script does on its way out, the group ends and the process ends as the entry points' do
    accel.run_and_exit(lambda: runpy.run_path(sys.argv[0], run_name="__main__"))
