"""lowprec: train PyTorch models in BF16/FP16 with FP32-quality results."""

from lowprec import diagnostics, numerics, optim, recipes
from lowprec.optim import SGD, Adagrad, AdamW, Lamb, master_state_dict
from lowprec.scaling import LossScaler, NonFiniteLossError

__version__ = "0.1.0"

__all__ = [
    "SGD",
    "Adagrad",
    "AdamW",
    "Lamb",
    "LossScaler",
    "NonFiniteLossError",
    "__version__",
    "diagnostics",
    "master_state_dict",
    "numerics",
    "optim",
    "recipes",
]
