"""StableAdamW in float64, from Wortsman et al. 2023 (Algorithm 2) as optimi's ``StableAdamW``
implements it: the tests' reference.

Debiased betas instead of bias corrections; the RMS of ``g / sqrt(max(v, eps**2))`` over the
tensor with the new second moment; the learning rate divided by ``max(1, rms)``, in the update
and in the decoupled decay (``max_lr`` given: optimi's fully decoupled decay).
"""

from __future__ import annotations

import torch


def debiased(beta, t):
    return beta * (1 - beta ** (t - 1)) / (1 - beta**t)


class ReferenceStableAdamW:
    def __init__(self, params, lr, betas=(0.9, 0.99), weight_decay=1e-2, eps=1e-6, max_lr=None,
                 maximize=False):
        self.w = [p.detach().double().clone() for p in params]
        self.m = [torch.zeros_like(w) for w in self.w]
        self.v = [torch.zeros_like(w) for w in self.w]
        self.lr, (self.b1, self.b2), self.wd, self.eps = lr, betas, weight_decay, eps
        self.max_lr, self.maximize = max_lr, maximize
        self.t = 0
        self.rms = []  # each tensor's RMS at the last step

    def step(self, grads):
        self.t += 1
        b1, b2 = debiased(self.b1, self.t), debiased(self.b2, self.t)
        self.rms = []
        for i, g in enumerate(grads):
            g = -g.double() if self.maximize else g.double()
            self.m[i] = b1 * self.m[i] + (1 - b1) * g
            self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
            rms = (g * g / self.v[i].clamp_min(self.eps**2)).mean().sqrt().item()
            self.rms.append(rms)
            lr = self.lr / max(1.0, rms)
            decay = lr * self.wd if self.max_lr is None else lr / self.max_lr * self.wd
            self.w[i] = self.w[i] * (1 - decay) - lr * self.m[i] / (self.v[i].sqrt() + self.eps)
