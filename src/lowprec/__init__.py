"""lowprec: train PyTorch models in BF16/FP16 with FP32-quality results."""

from lowprec import numerics, optim
from lowprec.optim import SGD, Adagrad, AdamW, Lamb, master_state_dict

__version__ = "0.1.0"

__all__ = ["SGD", "Adagrad", "AdamW", "Lamb", "__version__", "master_state_dict", "numerics", "optim"]
