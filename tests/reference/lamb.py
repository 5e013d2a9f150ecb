"""LAMB written straight from You et al. 2019, Algorithm 2, in float64: the tests' reference."""

from __future__ import annotations

import torch


class ReferenceLamb:
    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        self.w = [p.detach().double().clone() for p in params]
        self.m = [torch.zeros_like(w) for w in self.w]
        self.v = [torch.zeros_like(w) for w in self.w]
        self.lr, (self.b1, self.b2), self.eps, self.wd = lr, betas, eps, weight_decay
        self.t = 0

    def step(self, grads):
        self.t += 1
        for i, g in enumerate(grads):
            g = g.double()
            self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
            self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * g * g
            m_hat = self.m[i] / (1 - self.b1**self.t)
            v_hat = self.v[i] / (1 - self.b2**self.t)
            u = m_hat / (v_hat.sqrt() + self.eps) + self.wd * self.w[i]
            w_norm, u_norm = self.w[i].norm(), u.norm()
            ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            self.w[i] = self.w[i] - self.lr * ratio * u
