"""lowprec: train PyTorch models in BF16/FP16 with FP32-quality results."""

from lowprec import numerics, optim
from lowprec.optim import SGD, AdamW, master_state_dict

__version__ = "0.1.0"

__all__ = ["SGD", "AdamW", "__version__", "master_state_dict", "numerics", "optim"]
