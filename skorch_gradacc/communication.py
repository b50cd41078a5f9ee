"""The all-reduce of a data-parallel GradAcc net, as a DDP communication hook.

DDP's default hook averages the ranks' gradients. A GradAcc net instead
weights each rank's gradient by its share of the group's items over all
ranks, which makes the update exact when ranks hold different item counts.
"""

import torch.distributed as dist

__all__ = ['ScaledAllReduce', 'scaled_allreduce_hook']


class ScaledAllReduce:
    """State of the communication hook.

    Holds the factor for the next all-reduce, and counts the all-reduces
    (one per bucket and step).
    """

    def __init__(self, module, process_group=None):
        self.module = module  # the DDP module the hook is registered on
        self.process_group = process_group
        self.factor = 1.0
        self.allreduces = 0


def scaled_allreduce_hook(state, bucket):
    """Multiply this rank's bucket by its factor, then sum over ranks.

    A rank holds ``sum_j (c_j / u) * grad_j`` for its micro-batches; with
    ``factor = u / C`` (``C`` the group's item count over all ranks), the sum
    over ranks is the gradient of the mean over the whole distributed group.
    It replaces DDP's default hook, which averages over ranks.
    """
    tensor = bucket.buffer()
    tensor.mul_(state.factor)
    state.allreduces += 1
    future = dist.all_reduce(
        tensor, group=state.process_group, async_op=True).get_future()
    return future.then(lambda fut: fut.value()[0])
