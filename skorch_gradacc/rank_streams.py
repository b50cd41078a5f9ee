"""A random stream of its own for each rank's forward passes (dropout).

At the start of each training epoch every rank takes rank 0's torch random
state, so that all ranks draw the same shuffled order
(:func:`~skorch_gradacc.sharding.broadcast_rng_states`). Left at that, the
ranks would also draw the same dropout masks on the CPU, where dropout
draws from that generator, and on GPUs seeded alike: the same mask for
different rows, as if the effective batch had ``1 / world_size`` of its
masks.

:class:`RankRandomStreamMixin` keeps the two apart. The training forward
passes of the module draw from a generator of the rank's own, seeded each
epoch, once the order is drawn, from the ranks' common state and the rank;
the global generator, which samplers and loaders draw from, is swapped
back after each forward pass, so it stays the same on every rank and is
not consumed by the model. On a GPU, the device's generator is seeded the
same way. With one rank nothing changes.
"""

import hashlib

import torch
import torch.distributed as dist

__all__ = ['RankRandomStreamMixin', 'RankStream']


class RankStream:
    """The rank's random stream for a module's training forward passes.

    Registered on a module as a forward pre-hook and an always-called
    forward hook: the pre-hook puts the rank's state into the global CPU
    generator, the hook takes it out again and restores the global one,
    also when the forward pass raises.

    Attributes
    ----------
    state : torch.Tensor or None
      The rank's CPU generator state between forward passes; None until
      :meth:`reseed`, and then the forward passes draw from the global
      generator as usual.

    """

    def __init__(self):
        self.state = None
        self._saved = None
        self._handles = []

    def reseed(self, rank):
        """Seed the rank's stream from the global state and ``rank``.

        The global CPU state, the same on every rank, is hashed, not drawn
        from, so that the samplers' draws are unchanged.
        """
        digest = hashlib.blake2b(torch.get_rng_state().numpy().tobytes(),
                                 digest_size=8).digest()
        seed = (int.from_bytes(digest, 'little') + rank) % 2 ** 63
        self.state = torch.Generator().manual_seed(seed).get_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.manual_seed(seed)  # this rank's device

    def attach(self, module):
        """Register the hooks on ``module``; return ``self``."""
        self._handles = [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._exit, always_call=True)]
        return self

    def detach(self):
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _enter(self, module, args):
        if self.state is not None and module.training and self._saved is None:
            self._saved = torch.get_rng_state()
            torch.set_rng_state(self.state)

    def _exit(self, module, args, output):
        if self._saved is not None:
            self.state = torch.get_rng_state()
            torch.set_rng_state(self._saved)
            self._saved = None


class RankRandomStreamMixin:
    """Give each rank's training forward passes a random stream of its own.

    A base of :class:`~skorch_gradacc.DistributedGradAccMixin` and
    :class:`~skorch_gradacc.FullyShardedGradAccMixin`; see the module
    docstring. The stream is ``rank_stream_`` and is reseeded at the first
    training step of each epoch, after the ranks have drawn their common
    shuffled order.
    """

    def initialize_module(self):
        """Initialize the module and attach the rank's random stream."""
        super().initialize_module()
        if getattr(self, 'rank_stream_', None) is not None:
            self.rank_stream_.detach()  # from a module that may be reused
        module = getattr(self.module_, 'module', self.module_)  # DDP
        self.rank_stream_ = RankStream().attach(module)
        return self

    def run_single_epoch(self, iterator, training, prefix, step_fn,
                         **fit_params):
        """Run the epoch; in training, reseed the stream at its first step."""
        self._reseed_rank_stream_ = training
        return super().run_single_epoch(
            iterator, training, prefix, step_fn, **fit_params)

    def on_batch_begin(self, net, batch=None, training=False, **kwargs):
        """Reseed the rank's stream at the epoch's first training step."""
        super().on_batch_begin(net, batch=batch, training=training, **kwargs)
        if training and getattr(self, '_reseed_rank_stream_', False):
            self._reseed_rank_stream_ = False
            if dist.is_available() and dist.is_initialized() and (
                    dist.get_world_size() > 1):
                self.rank_stream_.reseed(dist.get_rank())
