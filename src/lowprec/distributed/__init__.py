"""1-bit SGD for data-parallel training: a ``DistributedDataParallel`` communication hook.

Each rank sends about 1 bit per gradient value plus two floats per column instead of 32 bits, and
carries each step's quantization error into the next (error feedback), so the average gradient
stays unbiased over time. Usage:

    from lowprec.distributed import OneBitState, onebit_hook

    ddp_model = DistributedDataParallel(model)
    state = OneBitState(model, warmup_steps=100)
    ddp_model.register_comm_hook(state, onebit_hook)
    ...
    ckpt = {"model": model.state_dict(), "onebit": state.state_dict()}  # on every rank
    ...
    state.load_state_dict(ckpt["onebit"])                                 # on every rank

``lowprec.distributed.quantize`` holds the per-column quantizer and the bit packing;
``kernels`` the hook's per-block work, compiled where a compiler exists (else eager, with the same
results); ``layout`` the columns and stripes of a bucket; ``stages`` a bucket's three stages, each
ending in a collective; ``hook`` the state, the pipeline of stages over DDP's buckets and the hook;
``checkpoint`` the state's checkpoints. See docs/distributed.md and examples/ddp_onebit.py.
"""

from lowprec.distributed.hook import DEFAULT_WARMUP_STEPS, OneBitState, column_runs, onebit_hook
from lowprec.distributed.quantize import (
    BITS,
    DEFAULT_RULE,
    RULES,
    check_quantizer,
    columns_finite,
    dequantize_columns,
    pack_codes,
    packed_size,
    quantize_columns,
    quantize_with_feedback_,
    unpack_codes,
)

__all__ = [
    "BITS",
    "DEFAULT_RULE",
    "DEFAULT_WARMUP_STEPS",
    "RULES",
    "OneBitState",
    "check_quantizer",
    "column_runs",
    "columns_finite",
    "dequantize_columns",
    "onebit_hook",
    "pack_codes",
    "packed_size",
    "quantize_columns",
    "quantize_with_feedback_",
    "unpack_codes",
]
