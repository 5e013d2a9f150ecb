"""Lion written straight from Chen et al. 2023, Algorithm 2, in float64: the tests' reference.

Decoupled weight decay ``w *= 1 - lr * wd`` as the paper's algorithm (``lion-pytorch``, optimi);
``max_lr`` given: optimi's fully decoupled ``w *= 1 - (lr / max_lr) * wd``. The state (``w``,
``m``) is public so that a test can start a step from another run's state.
"""

from __future__ import annotations

import torch


class ReferenceLion:
    def __init__(self, params, lr, betas=(0.9, 0.99), weight_decay=0.0, max_lr=None,
                 maximize=False):
        self.w = [p.detach().double().clone() for p in params]
        self.m = [torch.zeros_like(w) for w in self.w]
        self.lr, (self.b1, self.b2), self.wd = lr, betas, weight_decay
        self.max_lr, self.maximize = max_lr, maximize

    def direction(self, i, g):
        """The interpolation whose sign is the update: ``beta1 * m + (1 - beta1) * g``."""
        g = -g.double() if self.maximize else g.double()
        return self.b1 * self.m[i] + (1 - self.b1) * g

    def step(self, grads):
        for i, g in enumerate(grads):
            c = self.direction(i, g)
            g = -g.double() if self.maximize else g.double()
            scale = self.lr if self.max_lr is None else self.lr / self.max_lr
            self.w[i] = self.w[i] * (1 - scale * self.wd) - self.lr * torch.sign(c)
            self.m[i] = self.b2 * self.m[i] + (1 - self.b2) * g
