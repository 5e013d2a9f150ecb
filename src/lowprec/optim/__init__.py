"""Optimizers that keep FP32-quality updates for BF16/FP16 parameters.

Every optimizer takes ``master=``, how the FP32 master weight is kept:

| ``master`` | what is stored beside the parameter | extra bytes/param |
|---|---|---|
| ``"auto"`` | FP32 params: ``"none"``; BF16/FP16 params: ``"kahan"`` | - |
| ``"none"`` | nothing: round to nearest in the parameter's dtype (baseline) | 0 |
| ``"fp32"`` | an FP32 copy (classic mixed precision) | 4 |
| ``"split"`` | BF16 params only: the param is the top half, an int16 trail | 2 |
| ``"kahan"`` | a compensation buffer in the parameter's dtype | 2 |
| ``"stochastic"`` | nothing: stochastic rounding from a counter-based hash | 0 |

``state_dtype=`` keeps the update rule's buffers (moments, momentum, Adagrad's sum) in a dtype of
its choice, or as ``"8bit"`` or ``"4bit"`` codes with an FP32 scale per block of 256 elements.

``fused=True`` compiles each parameter's whole step (load, update, store) into one pass with
``torch.compile``; the default ``fused=None`` does so wherever torch.compile has a compiler (C++
on CPU, Triton on CUDA) and otherwise steps eagerly, with a warning; ``fused=False`` is the eager
step. All give bit-identical results. The first step compiles the kernels (seconds each, kept in
Inductor's on-disk cache); a failed compilation falls back to eager with a warning.
The environment variable ``LOWPREC_FUSED`` sets what ``fused=None`` means: ``auto`` (the
default), ``1`` (always compile) or ``0`` (eager).
"""

from lowprec.optim.adafactor import Adafactor
from lowprec.optim.adagrad import Adagrad
from lowprec.optim.adam import Adam
from lowprec.optim.adamw import AdamW
from lowprec.optim.base import LowPrecisionOptimizer
from lowprec.optim.export import master_state_dict
from lowprec.optim.in_backward import StepInBackward, step_in_backward
from lowprec.optim.kept import keep_fp32_values
from lowprec.optim.lamb import Lamb
from lowprec.optim.lion import Lion
from lowprec.optim.muon import Muon, muon_param_groups
from lowprec.optim.radam import RAdam
from lowprec.optim.sgd import SGD
from lowprec.optim.stable_adamw import StableAdamW
from lowprec.optim.storage import MASTER_CHOICES, STORAGES, MasterStorage, resolve_master

__all__ = [
    "MASTER_CHOICES",
    "SGD",
    "STORAGES",
    "Adafactor",
    "Adagrad",
    "Adam",
    "AdamW",
    "Lamb",
    "Lion",
    "LowPrecisionOptimizer",
    "MasterStorage",
    "Muon",
    "RAdam",
    "StableAdamW",
    "StepInBackward",
    "keep_fp32_values",
    "master_state_dict",
    "muon_param_groups",
    "resolve_master",
    "step_in_backward",
]
