"""Optimizers that keep FP32-quality updates for BF16/FP16 parameters.

Every optimizer takes ``master=``, how the FP32 master weight is kept:

============== ================================================================ =================
``master``     what is stored beside the parameter                              extra bytes/param
============== ================================================================ =================
``"auto"``     FP32 params: ``"none"``; BF16/FP16 params: ``"kahan"``             -
``"none"``     nothing: round to nearest in the parameter's dtype (baseline)      0
``"fp32"``     an FP32 copy (classic mixed precision)                             4
``"split"``    BF16 params only: the param is the top half, an int16 trail        2
``"kahan"``    a compensation buffer in the parameter's dtype                     2
``"stochastic"`` nothing: stochastic rounding from a counter-based hash           0
============== ================================================================ =================

``fused=True`` compiles each parameter's whole step (load, update, store) into one pass with
``torch.compile``; the default ``fused=None`` does so on CUDA and stays eager elsewhere. Both run the
same function and give bit-identical results.
"""

from lowprec.optim.adagrad import Adagrad, adagrad_update
from lowprec.optim.adamw import AdamW, adamw_update
from lowprec.optim.base import LowPrecisionOptimizer, master_state_dict
from lowprec.optim.lamb import Lamb, lamb_update
from lowprec.optim.sgd import SGD, sgd_update
from lowprec.optim.storage import MASTER_CHOICES, STORAGES, MasterStorage, resolve_master

__all__ = [
    "MASTER_CHOICES",
    "SGD",
    "STORAGES",
    "Adagrad",
    "AdamW",
    "Lamb",
    "LowPrecisionOptimizer",
    "MasterStorage",
    "adagrad_update",
    "adamw_update",
    "lamb_update",
    "master_state_dict",
    "resolve_master",
    "sgd_update",
]
