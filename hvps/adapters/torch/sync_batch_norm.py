"""``SyncBatchNorm``: batch normalisation with statistics over the whole (global) batch.

In training, each rank sums its inputs and their squares per channel; one allreduce over the
process set gives the global mean and (biased) variance, which normalise every rank's slice
and update the running statistics (with the unbiased variance, as ``BatchNorm``). Backward
sums the two per-channel reductions the input gradient needs (``Σ dy`` and ``Σ dy·(x - μ)``)
the same way; the weight and bias gradients stay local (the optimizer averages them). Ranks
may hold different batch sizes. In evaluation mode it is plain ``BatchNorm``.

On CUDA it uses torch's fused kernels as PyTorch's and Horovod's SyncBatchNorm do
(``batch_norm_stats``, ``batch_norm_gather_stats_with_counts``, ``batch_norm_elemt``,
``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``): per-channel statistics in the
input's accumulate type, one allgather of ``[mean, invstd, count]`` per layer, no float64 copy of
the activation and no ``.item()`` (no host sync) — issue 43, finding 7. Those kernels exist only
for CUDA, so CPU tensors keep the float64 reductions below.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from hvps import ProcessSet, global_process_set

from .mpi_ops import Sum, allgather_async, allreduce_async


def _channel_dims(x: torch.Tensor) -> list:
    return [d for d in range(x.dim()) if d != 1]


def _sum_over_set(values: torch.Tensor, process_set: ProcessSet) -> torch.Tensor:
    return allreduce_async(values.contiguous(), op=Sum, process_set=process_set).wait()


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        dims = _channel_dims(x)
        wide = x.detach().to(torch.float64)
        count = x.numel() // x.shape[1] if x.shape[1] else 0
        local = torch.cat([wide.sum(dims), (wide * wide).sum(dims), wide.new_tensor([float(count)])])
        totals = _sum_over_set(local, process_set)
        channels = x.shape[1]
        total = totals[-1].item()
        mean = totals[:channels] / total
        var = (totals[channels:2 * channels] / total - mean * mean).clamp_min(0.0)
        if running_mean is not None:
            with torch.no_grad():
                unbiased = var * (total / (total - 1)) if total > 1 else var
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        invstd = torch.rsqrt(var + eps)
        shape = [1, channels] + [1] * (x.dim() - 2)
        normalized = (wide - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total, ctx.process_set = total, process_set
        out = normalized
        if weight is not None:
            out = out * weight.detach().to(torch.float64).view(shape) + bias.detach().to(torch.float64).view(shape)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, mean, invstd = ctx.saved_tensors
        dims = _channel_dims(x)
        channels = x.shape[1]
        shape = [1, channels] + [1] * (x.dim() - 2)
        dy = grad_output.to(torch.float64)
        xmu = x.detach().to(torch.float64) - mean.view(shape)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_weight = grad_bias = None
        if weight is not None:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
            grad_bias = sum_dy.to(weight.dtype)
        totals = _sum_over_set(torch.cat([sum_dy, sum_dy_xmu]), ctx.process_set)
        mean_dy = (totals[:channels] / ctx.total).view(shape)
        mean_dy_xmu = (totals[channels:] / ctx.total).view(shape)
        scale = invstd.view(shape) * (weight.detach().to(torch.float64).view(shape) if weight is not None else 1.0)
        grad_input = scale * (dy - mean_dy - xmu * invstd.view(shape) ** 2 * mean_dy_xmu)
        return grad_input.to(x.dtype), grad_weight, grad_bias, None, None, None, None, None


class _FusedSyncBatchNormFunction(torch.autograd.Function):
    """The CUDA path, after ``torch/nn/modules/_functions.py``'s ``SyncBatchNorm`` (without its boolean-mask
    filtering of empty ranks, which syncs: an empty rank sends ``invstd = 1`` with count 0, weighted out)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        x = x.contiguous()
        channels = x.shape[1]
        count = x.numel() // channels if channels else 0
        if count > 0:
            mean, invstd = torch.batch_norm_stats(x, eps)
        else:  # the dtype batch_norm_stats gives (its accumulate type): every rank gathers the same
            accumulate = torch.float64 if x.dtype == torch.float64 else torch.float32
            mean = torch.zeros(channels, dtype=accumulate, device=x.device)
            invstd = torch.ones(channels, dtype=accumulate, device=x.device)
        counted = torch.full((1,), float(count), dtype=mean.dtype, device=mean.device)
        combined = torch.cat([mean, invstd, counted]).view(1, -1)
        gathered = allgather_async(combined, process_set=process_set).wait()  # (ranks, 2C + 1)
        mean_all, invstd_all, count_all = torch.split(gathered, channels, dim=1)
        mean, invstd = torch.batch_norm_gather_stats_with_counts(
            x, mean_all, invstd_all, running_mean, running_var, momentum, eps, count_all.reshape(-1))
        ctx.save_for_backward(x, weight, mean, invstd, count_all.reshape(-1).to(torch.int32))
        ctx.process_set = process_set
        return torch.batch_norm_elemt(x, weight, bias, mean, invstd, eps)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, mean, invstd, count_all = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        sum_dy, sum_dy_xmu, grad_weight, grad_bias = torch.batch_norm_backward_reduce(
            grad_output, x, mean, invstd, weight, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
            ctx.needs_input_grad[2])
        grad_input = None
        if ctx.needs_input_grad[0]:
            channels = x.shape[1]
            totals = _sum_over_set(torch.cat([sum_dy, sum_dy_xmu]), ctx.process_set)
            sum_dy, sum_dy_xmu = torch.split(totals, channels)
            grad_input = torch.batch_norm_backward_elemt(grad_output, x, mean, invstd, weight, sum_dy, sum_dy_xmu,
                                                         count_all)
        if weight is None or not ctx.needs_input_grad[1]:
            grad_weight = None
        if weight is None or not ctx.needs_input_grad[2]:
            grad_bias = None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation whose statistics span every rank of ``process_set`` (Horovod's ``SyncBatchNorm``).

    Takes ``BatchNorm``'s arguments; inputs are ``(N, C, ...)``.

    Args:
        num_features: C, the channels.
        eps: added to the variance.
        momentum: of the running statistics (None: a cumulative average).
        affine: learn a weight and a bias per channel.
        track_running_stats: keep running statistics for evaluation.
        process_set: the ranks whose batches the statistics span (default: all).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_set: ProcessSet = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` with the statistics of every member's batch (training) or the running ones.

        Args:
            input: ``(N, C, ...)``; N may differ across ranks.

        Returns:
            The normalised tensor, of ``input``'s shape.

        Raises:
            ValueError: ``input`` has fewer than 2 dimensions.
        """
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps)
        running = (self.running_mean, self.running_var) if self.track_running_stats else (None, None)
        function = _FusedSyncBatchNormFunction if input.is_cuda else _SyncBatchNormFunction
        return function.apply(input, self.weight, self.bias, *running, self.eps, factor, self.process_set)
