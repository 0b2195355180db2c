"""PowerSGD written out in plain numpy for every rank at once, to check hvps's against
(Vogels et al. 2019, Algorithm 1 with error feedback and warm start; orthogonalisation by
numpy's QR with the signs that Gram-Schmidt gives, not by hvps's Gram-Schmidt)."""

import zlib

import numpy as np


def first_q(seed, name, draw, m, rank, dtype):
    """The documented shared start: standard normal from ``default_rng([seed, crc32(name), draw])``."""
    return np.random.default_rng([seed, zlib.crc32(name.encode()), draw]).standard_normal((m, rank)).astype(dtype)


def orthonormal(p):
    q, r = np.linalg.qr(p)
    return q * np.sign(np.diag(r))


class Reference:
    """One tensor's PowerSGD on ``size`` ranks: ``step(grads)`` takes every rank's gradient and
    returns the average (or sum) every rank should get."""

    def __init__(self, name, size, rank, start_iter=0, warm_start=True, error_feedback=True, average=True,
                 seed=0, dense=False):
        self.name, self.size, self.rank, self.start_iter = name, size, rank, start_iter
        self.warm_start, self.error_feedback, self.average, self.seed, self.dense = (
            warm_start, error_feedback, average, seed, dense)
        self.errors = [None] * size
        self.q = None
        self.steps = self.draws = 0

    def step(self, grads):
        step, self.steps = self.steps, self.steps + 1
        if self.dense or step < self.start_iter:
            total = np.sum([g.astype(np.float64) for g in grads], axis=0)
            return total / self.size if self.average else total
        shape, dtype = grads[0].shape, grads[0].dtype
        work = np.float64 if dtype == np.float64 else np.float32
        ms = [g.reshape(shape[0], -1).astype(np.float64) for g in grads]
        if self.error_feedback:
            ms = [m if e is None else m + e for m, e in zip(ms, self.errors)]
        q = self.q
        if q is None or not self.warm_start:
            q = first_q(self.seed, self.name, self.draws, ms[0].shape[1], self.rank, work).astype(np.float64)
            self.draws += 1
        p = orthonormal(np.sum([m @ q for m in ms], axis=0))
        q = np.sum([m.T @ p for m in ms], axis=0)
        if self.average:
            q = q / self.size
        approximation = p @ q.T
        if self.error_feedback:
            self.errors = [m - approximation for m in ms]
        self.q = q
        return approximation.reshape(shape)
