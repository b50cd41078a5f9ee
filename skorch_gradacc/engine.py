"""Engines: what differs between one process, DDP and FSDP2 in a step.

:class:`~skorch_gradacc.GradAccMixin` runs one loop for every step
(:meth:`~skorch_gradacc.GradAccMixin.accumulate_gradients`): the pieces, the
item counts, the history merge, ``y_pred``, the out-of-memory back-off and
the skip decision. An engine supplies only what differs:

* :meth:`Engine.groups`: which micro-batches this rank takes in each step;
* :meth:`Engine.passes`: the forward and backward passes of a step, which
  an engine may pad or agree on with the other ranks;
* :meth:`Engine.context`: the context of each backward, which reduces the
  gradient over ranks or not;
* ``Engine.count_unit`` and :meth:`Engine.set_count_unit`: how the count-weighted
  gradients are summed over ranks;
* :meth:`Engine.end_step` and :meth:`Engine.all_ranks`: the end of the
  step, and the decisions that every rank must take alike;
* :meth:`Engine.share_step`: the step's batch and outputs, as the
  callbacks see them.

A rank's padding passes run the module on stand-in rows (``PaddingMixin``,
a base of :class:`~skorch_gradacc.GradAccMixin`).

:class:`Engine` is the single process's, the trivial one.
``DataParallelEngine`` adds what every data-parallel engine shares,
``DDPEngine`` is that of a module wrapped in
:class:`~torch.nn.parallel.DistributedDataParallel` (by
:class:`~skorch_gradacc.DistributedGradAccMixin` or by skorch's
``AccelerateMixin``), and FSDP2's is
``skorch_gradacc.fully_sharded.FullyShardedEngine``; these three are
internal.
"""

import contextlib
import functools
import itertools

import torch
import torch.distributed as dist
from skorch.utils import to_device
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from skorch_gradacc.batching import (
    batch_len,
    concat_outputs,
    output_rows,
    outputs_of_no_rows,
    padding_batch,
    uncompiled,
)
from skorch_gradacc.counting import net_modules, net_optimizers, scale_gradients
from skorch_gradacc.grouping import MicroBatchGroups, length_or_none, step_count
from skorch_gradacc.sharding import ShardedMicroBatchGroups

__all__ = ['Engine']


class PaddingMixin:
    """Run the module of a padding pass on its stand-in rows.

    A rank without a piece of its own runs its engine's passes, and its
    share of an evaluation round, on a
    :func:`~skorch_gradacc.batching.padding_batch` of zero rows, for the
    collectives. Many modules refuse zero rows (a Hugging Face model
    reshapes its attention mask by the rows): :meth:`infer` of a padding
    batch's ``X`` runs the module on its stand-in rows, with the buffers it
    changes (a BatchNorm's statistics) as before, and cuts the outputs to
    zero rows, so the loss and the counts see no row and the gradient is
    zero.
    """

    def infer(self, x, **fit_params):
        """Run the module on ``x``; on a padding batch's, on its stand-in rows."""
        stand_in = getattr(x, 'stand_in_', None)
        if stand_in is None:
            return super().infer(x, **fit_params)
        # on copies of the buffers, which the pass may change (its graph may
        # hold them: a BatchNorm's backward checks that they stay as they were)
        buffers = [(module, name, buffer) for net_module in net_modules(self)
                   for module in net_module.modules()
                   for name, buffer in module.named_buffers(recurse=False)]
        for module, name, buffer in buffers:
            setattr(module, name, buffer.clone())
        try:
            out = super().infer(stand_in, **fit_params)
        finally:
            for module, name, buffer in buffers:
                setattr(module, name, buffer)
        return outputs_of_no_rows(out)


class Engine:
    """The engine of a single process.

    For each step, :class:`~skorch_gradacc.GradAccMixin` calls
    :meth:`groups` (once per epoch), then for every pass of :meth:`passes`:
    :meth:`set_count_unit` before the rank's last backward, and the backward under
    :meth:`context`; then :meth:`end_step`. Each backward computes the
    gradient of its loss times ``c / u`` (``c`` its item count, ``u`` the
    unit: ``count_unit``, or the first positive count), so that after the last
    one ``.grad`` is ``1 / u`` times the gradient of the summed loss.

    Parameters
    ----------
    module : torch.nn.Module or None (default=None)
      The module the engine serves; a new module gets a new engine.

    Attributes
    ----------
    count_unit : float or None
      The unit of every rank's counts (class attribute): None for the first
      positive count of the rank's step.

    """

    count_unit = None

    #: the ranks that take part in a step
    world_size = 1

    #: None, or what gives every rank the same unit: a callable that returns
    #: the largest of a count over ranks (FSDP2 under fp16)
    share_count_unit = None

    def __init__(self, module=None):
        self.module = module

    def groups(self, micro_batches, acc_steps, keep=False, keep_targets=False,
               share_inputs=False):
        """Return this rank's groups of micro-batches, one per step.

        ``share_inputs``: each group gives all ranks' micro-batches from its
        ``on_batch_begin`` on (here, one rank's are all).
        """
        return MicroBatchGroups(micro_batches, acc_steps, keep=keep,
                                keep_targets=keep_targets)

    def passes(self, pieces):
        """Yield the step's ``(piece, is_last)``: here, the pieces as they are."""
        return pieces

    def may_skip(self, is_last):
        """Whether the backward of a piece without items may be left out."""
        return True

    def context(self, syncs, net=None):
        """Return the context of a backward; ``syncs``: the rank's last.

        ``net``: the net whose piece it is.
        """
        return contextlib.nullcontext()

    def plan_context(self, net=None):
        """Return the context of a memory plan's pass: a later piece's."""
        return self.context(False, net)

    def plan_gradient_bytes(self, params):
        """Return the gradient bytes a step holds while a later piece runs.

        Here ``.grad``'s, which the plan's passes hold (zeros).
        """
        return sum(param.grad.nelement() * param.grad.element_size()
                   for param in params if param.grad is not None)

    def join_plan_pass(self, run_empty_pass, piece):
        """Run the collectives of a plan's pass that failed on this rank.

        ``run_empty_pass(piece)`` runs a zero-row pass of ``piece``'s
        structure. Here, and in DDP's passes (``no_sync()``), there are none.
        """

    def set_count_unit(self, count_unit):
        """Say, before the last backward, what ``.grad`` is in units of.

        ``count_unit`` is None for a summed loss, else the count ``u`` (0 when
        the rank's pieces have no item).
        """

    def after_error(self, run_empty_pass, size):
        """Let the other ranks know of an out-of-memory error in a pass.

        Called on the rank whose pass failed, with ``micro_batch_size='auto'``,
        before it backs off: ``run_empty_pass(piece)`` runs a zero-row pass
        in its place, and ``size`` is the piece size it backs off to. One
        process has nothing to do.
        """

    def discard_gradient(self, run_empty_pass):
        """Give up the gradient of a failed attempt at the step.

        Called on every rank before the net zeroes ``.grad`` and backs off;
        ``run_empty_pass(piece)`` runs a zero-row pass that reduces the
        gradient. Here, ``.grad`` holds all of it: nothing to do.
        """

    def end_step(self, net, group, counts):
        """Finish the step after its last backward; return its loss.

        Divides ``.grad`` by the group's count, in units of ``u``
        (``counts.mean_scale()``).
        """
        scale_gradients(learnable_gradients(net), counts.mean_scale())
        return counts.loss()

    def share_step(self, group, step):
        """Return the step the callbacks see; ``group`` gives its batch.

        Here the step as it is: the group's micro-batches are the batch.
        """
        return step

    def all_ranks(self, ok):
        """Return whether ``ok`` holds on every rank (here: ``ok``)."""
        return ok

    def min_over_ranks(self, value):
        """Return the smallest of the int ``value`` over ranks (here: it)."""
        return value


class DataParallelEngine(Engine):
    """What every data-parallel engine shares.

    * :meth:`groups`: the user's iterator sharded by micro-batch
      (:class:`~skorch_gradacc.sharding.ShardedMicroBatchGroups`), or, if it
      is sharded already (a :class:`~torch.utils.data.DistributedSampler`,
      or ``shard=False``), grouped as it is;
    * :meth:`end_step`: one all-reduce of the step's item count, loss sum
      and rows; the summed gradient (of this rank, or its shard) is divided
      by the count over all ranks, and the step's mean loss goes to the
      history; rank 0's buffers go to every rank;
    * :meth:`all_ranks`: one all-reduce of a flag.

    Parameters
    ----------
    module : torch.nn.Module
      The wrapped module.

    process_group : ProcessGroup or None
      The process group; None for the default one.

    shard : bool (default=False)
      Whether :meth:`groups` shards the training iterator by micro-batch;
      if False, the iterator is taken to be sharded already (e.g. prepared
      by Accelerate).

    Attributes
    ----------
    device : torch.device
      Where the collectives run: the device of the module's parameters,
      which NCCL requires to be a GPU.

    """

    def __init__(self, module, process_group=None, shard=False):
        super().__init__(module)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.shard = shard
        param = next(module.parameters(), None)
        self.device = param.device if param is not None else torch.device(
            'cpu')

    def groups(self, micro_batches, acc_steps, keep=False, keep_targets=False,
               share_inputs=False):
        """Return this rank's groups, the same number on every rank."""
        sampler = getattr(micro_batches, 'sampler', None)
        if self.shard and not isinstance(sampler, DistributedSampler):
            groups = ShardedMicroBatchGroups(
                micro_batches, acc_steps,
                rank=dist.get_rank(self.process_group),
                world_size=self.world_size,
                keep=keep, keep_targets=keep_targets, device=self.device,
                process_group=self.process_group)
        elif length_or_none(micro_batches) is None:
            raise ValueError(
                "Data-parallel training needs a training iterator with a "
                "length when it is sharded by its own sampler, so that every "
                "rank takes the same number of steps; got {!r}.".format(
                    micro_batches))
        elif len(steps := {self.min_over_ranks(sign * step_count(
                micro_batches, acc_steps)) * sign for sign in (1, -1)}) > 1:
            # on every rank: one with fewer would leave the others waiting
            raise ValueError(
                "The ranks' training iterators, sharded by their own sampler, "
                "make {} to {} steps; give each the same number of batches "
                "(Accelerate's even_batches=True).".format(*sorted(steps)))
        else:
            groups = super().groups(micro_batches, acc_steps, keep=keep,
                                    keep_targets=keep_targets)
        return _InputsShared(groups, self) if share_inputs and keep else groups

    def end_step(self, net, group, counts):
        """All-reduce the count, loss sum and rows; divide the gradient.

        Returns the step's loss over all ranks, in float64 (a rank without
        items has no loss of its own to take the dtype from): the mean over
        its items, or the sum of summed losses.
        """
        values = torch.stack([
            _on_device(value, self.device)
            for value in (counts.total, counts.loss_sum().detach(),
                          group.n_rows)])
        dist.all_reduce(values, group=self.process_group)
        total, loss, rows = values
        self._sum_other_gradients(net)
        self._broadcast_buffers(net)
        group.global_rows = rows  # train_batch_size: the large batch's
        # the summed gradient over all ranks is in units of 1, or of the
        # unit the ranks share; no host sync; with no item on any rank, the
        # gradient is left as it is (zero)
        unit = 1.0
        if self.share_count_unit is not None and counts.count_unit is not None:
            unit = _on_device(counts.count_unit, self.device)
        scale_gradients(learnable_gradients(net),
                        counts.mean_scale(total=total, count_unit=unit))
        return counts.loss(loss_sum=loss, total=total)

    def _sum_other_gradients(self, net):
        """Sum over ranks the gradients of learnable parameters outside the module.

        DDP and FSDP2 reduce the module's; skorch also trains a criterion's
        own, which would otherwise stay each rank's (a criterion wrapped in
        DDP, as Accelerate's, does not reduce: :meth:`others_unsynced`). In
        units of 1, as the module's (DDP's hook scales by ``bucket_scale``
        so); a rank without a gradient adds zeros. A frozen one gets none,
        as in skorch.
        """
        own = {id(param) for param in self.module.parameters()}
        params = [param for param in trained_params(net)
                  if param.requires_grad and id(param) not in own]
        if not params:
            return
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        flat = torch.cat([param.grad.reshape(-1) for param in params])
        flat *= getattr(self, 'bucket_scale', 1.0)
        dist.all_reduce(flat, group=self.process_group)
        for param, summed in zip(params, flat.split([p.numel() for p in params])):
            param.grad.copy_(summed.view_as(param.grad))

    def _broadcast_buffers(self, net):
        """Give every rank rank 0's buffers, those of every module of the net.

        A buffer that the forward pass updates (BatchNorm's running
        statistics) learns from each rank's own rows: unshared, the ranks'
        would drift apart, shared evaluation would mix them, and a
        checkpoint (rank 0's) would not be what the other ranks hold. DDP
        broadcasts rank 0's at some forward passes, FSDP2 never; once a
        step, here, they are alike wherever a step ends. One broadcast per
        device and dtype.
        """
        buffers = {id(buffer): buffer for module in net_modules(net)
                   for buffer in module.buffers()}
        by_kind = {}
        for buffer in buffers.values():
            by_kind.setdefault((buffer.device, buffer.dtype), []).append(buffer)
        src = 0 if self.process_group is None else dist.get_global_rank(
            self.process_group, 0)
        for same in by_kind.values():
            flat = torch.cat([buffer.detach().reshape(-1) for buffer in same])
            dist.broadcast(flat, src=src, group=self.process_group)
            for buffer, value in zip(same, flat.split([b.numel() for b in same])):
                buffer.detach().copy_(value.view_as(buffer))

    def others_unsynced(self, net):
        """Return a context in which the net's other DDP modules don't reduce.

        Accelerate wraps a criterion with parameters in DDP, whose own hook
        would all-reduce its gradient in every backward, averaged;
        :meth:`_sum_other_gradients` sums it once a step instead, as any
        criterion's.
        """
        stack = contextlib.ExitStack()
        for module in net_modules(net) if net is not None else ():
            module = uncompiled(module)
            if (isinstance(module, DistributedDataParallel)
                    and module is not self.module):
                stack.enter_context(module.no_sync())
        return stack

    def share_step(self, group, step):
        """Return the step's outputs over all ranks; ``group`` gives their inputs.

        What the group keeps of its micro-batches (themselves, or their
        targets) and the outputs, gathered on every rank in the large
        batch's order (rank ``r``'s micro-batch ``j`` is the step's ``j * W
        + r``; a rank's zero-row placeholder is left out), so that the
        callbacks score what the large batch would, as in validation. On the
        CPU. A group gathered before its step gathers only the outputs.
        """
        y_pred, rows, kept = step.get('y_pred'), group.micro_rows, group.kept()
        if group.shared is not None:  # gathered before the step (_InputsShared)
            kept = None
            if y_pred is None:
                return step
        starts = [0, *itertools.accumulate(rows)]
        mine = [(
            None if kept is None else to_device(kept[index], 'cpu'),
            None if y_pred is None else output_rows(
                y_pred, slice(starts[index], starts[index + 1]), starts[-1]), n)
            for index, n in enumerate(rows) if n]
        shares = [None] * self.world_size
        dist.all_gather_object(shares, mine, group=self.process_group)
        order = [(rank, index) for index in range(max(map(len, shares)))
                 for rank, share in enumerate(shares) if index < len(share)]
        ordered = [shares[rank][index] for rank, index in order]
        batches, outs, sizes = map(list, zip(*ordered))  # sizes: their rows
        if kept is not None:
            group.share(concat_outputs(batches, sizes),
                        self._own_rows(order, ordered, rows) if group.keep else ())
        if y_pred is not None:
            step = dict(step, y_pred=concat_outputs(outs, sizes))
        return step

    def _own_rows(self, order, ordered, rows):
        """Return where this rank's micro-batches are in the step's batch.

        ``(index, rows)`` for each with rows: its index in the group, and
        its rows (a slice) in the batch of ``ordered``, whose ranks and
        indices are ``order``.
        """
        own = iter([index for index, n in enumerate(rows) if n])
        me, end, found = dist.get_rank(self.process_group), 0, []
        for (rank, _), (*_, n) in zip(order, ordered):
            start, end = end, end + n
            if rank == me:
                found.append((next(own), slice(start, end)))
        return found

    def all_ranks(self, ok):
        """Return whether ``ok`` holds on every rank (one all-reduce)."""
        flag = torch.tensor(float(ok), device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.process_group)
        return bool(flag)

    def min_over_ranks(self, value):
        """Return the smallest of the int ``value`` over ranks (one all-reduce)."""
        return int(self._over_ranks(value, dist.ReduceOp.MIN))

    def _over_ranks(self, value, op):
        """Return ``value`` reduced over ranks with ``op``, as a float."""
        value = _on_device(value, self.device)
        dist.all_reduce(value, op=op, group=self.process_group)
        return value.item()

    def _agree(self, has_piece, has_more, size):
        """All-reduce this rank's flags; raise if a pass ran out of memory.

        Returns whether any rank has a piece for the coming pass, and
        whether any has one after it. ``size`` is the size a failed pass
        backs off to, or None; the error raised carries the least one, so
        that every rank backs off alike.
        """
        flags = torch.tensor([float(has_piece), float(has_more),
                              -float(size) if size else -float('inf')],
                             dtype=torch.float64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
        any_piece, any_more, size = flags.tolist()
        if size != -float('inf'):
            # torch.OutOfMemoryError, under its name in torch < 2.5 too
            error = torch.cuda.OutOfMemoryError(
                "Out of memory on another rank: every rank backs off.")
            error.micro_batch_size = int(-size)
            raise error
        return any_piece, any_more


class DDPEngine(DataParallelEngine):
    """The engine of a module wrapped in DistributedDataParallel.

    ``no_sync()`` for all backward passes of a step but a rank's last, and
    a communication hook that sums each rank's gradient over ranks;
    :meth:`~DataParallelEngine.end_step` then divides by the step's item
    count over all ranks. Each backward is weighted by its item count
    (:attr:`count_unit` 1), so that ``.grad`` is the gradient of the rank's summed
    loss. With ``fp16``, a weight of ``c`` times the GradScaler's scale
    could overflow the float16 gradients of the activations: the unit is
    then the rank's first count ``u``, and the hook first multiplies by
    ``bucket_scale = u`` (:meth:`set_count_unit`). The hook replaces
    DDP's default one, which averages over ranks; like that one, it starts
    each bucket's all-reduce as soon as the bucket is ready, which overlaps
    the rest of the backward (see :func:`_scaled_allreduce_hook`).

    Parameters
    ----------
    module : torch.nn.parallel.DistributedDataParallel
      The wrapped module; the hook is registered on it.

    process_group, shard
      See :class:`DataParallelEngine`.

    fp16 : bool (default=False)
      Whether the backward passes run under a float16 GradScaler.

    With ``micro_batch_size='auto'``, a rank that runs out of memory takes
    part in the others' last all-reduce with a zero-row pass, and the ranks
    agree at :meth:`end_step` whether any did: then every rank backs off
    to the same size (:meth:`after_error`).

    Attributes
    ----------
    count_unit : float or None
      1, or None with ``fp16``.

    bucket_scale : float or torch.Tensor
      What the next all-reduce multiplies this rank's gradient by.

    allreduces : int
      The number of gradient all-reduces so far: one per DDP bucket and
      step.

    pending : list
      The all-reduces of the running backward, still in flight.

    """

    def __init__(self, module, process_group=None, shard=False, fp16=False):
        if getattr(module, 'static_graph', False):
            raise ValueError(
                "Gradient accumulation runs all backward passes of a step but "
                "the last under DistributedDataParallel's no_sync(), which a "
                "module wrapped with static_graph=True does not support; wrap "
                "it without static_graph.")
        super().__init__(module, process_group=process_group, shard=shard)
        self.count_unit = None if fp16 else 1.0
        self.bucket_scale = 1.0
        self.allreduces = 0
        self.pending = []
        module.register_comm_hook(self, _scaled_allreduce_hook)

    def passes(self, pieces):
        """Yield the pieces as they are; keep a zero-row one for :meth:`after_error`."""
        template = None
        for piece, is_last in pieces:
            if template is None:
                template = self._template = padding_batch(piece)
            yield piece, is_last
            del piece

    def may_skip(self, is_last):
        """Return False for the rank's last backward, which all-reduces."""
        return not is_last

    def after_error(self, run_empty_pass, size):
        """Take part in the step's all-reduces, and tell the other ranks.

        A zero-row pass with the rank's last backward joins the gradient
        all-reduce of the others' last backward; the agreement that follows
        joins theirs in :meth:`end_step`, where every rank backs off to the
        least ``size``. The gradient all-reduced is given up on every rank.
        """
        run_empty_pass(self._template, is_last=True)
        self._agree(False, False, size)

    def end_step(self, net, group, counts):
        """With ``micro_batch_size='auto'``, learn if a rank ran out of memory.

        Then, or else, end the step as every data-parallel engine does.
        """
        if net.micro_batch_size == 'auto':
            self._agree(False, False, None)  # see after_error
        return super().end_step(net, group, counts)

    def context(self, syncs, net=None):
        """``no_sync()`` unless this is the rank's last backward.

        The net's other DDP modules always (:meth:`others_unsynced`).
        """
        stack = self.others_unsynced(net)
        if not syncs:
            stack.enter_context(self.module.no_sync())
        return stack

    def set_count_unit(self, count_unit):
        """Set the hook's bucket_scale: ``u`` (0 without items), 1 if summed."""
        self.bucket_scale = 1.0 if count_unit is None else count_unit


def engine_for(module, fp16=False, shard=False):
    """Return the engine of ``module``.

    A :class:`DDPEngine` (with ``fp16`` and ``shard``) if it is wrapped in
    DistributedDataParallel (and maybe compiled), else the single process's
    :class:`Engine`.
    """
    module = uncompiled(module)
    if isinstance(module, DistributedDataParallel):
        return DDPEngine(module, shard=shard, fp16=fp16)
    return Engine(module)


class _InputsShared:
    """Groups that give all ranks' micro-batches before their step.

    For a callback that reads the batch in ``on_batch_begin``: each group
    is pulled whole, and gathered over ranks (:meth:`~DataParallelEngine.share_step`)
    as the large batch's, its length too.
    """

    def __init__(self, groups, engine):
        self.groups, self.engine = groups, engine

    def __len__(self):
        return len(self.groups)

    def __iter__(self):
        for group in self.groups:
            group.skip_rest()  # kept: pulled whole
            self.engine.share_step(group, {})
            group.global_rows = batch_len(group.shared)
            yield group


def trained_params(net):
    """Return the parameters ``net`` trains, once each.

    Its learnable ones, and those its optimizers hold besides (a parameter
    that an ``initialize_optimizer`` of the user's adds).
    """
    params = itertools.chain(
        (param for _, param in net.get_all_learnable_params()),
        (param for optimizer in net_optimizers(net)
         for group in optimizer.param_groups for param in group['params']))
    return list({id(param): param for param in params}.values())


def learnable_gradients(net):
    """Return the gradients of the parameters ``net`` trains that exist."""
    return [param.grad for param in trained_params(net) if param.grad is not None]


def _on_device(value, device):
    """Return ``value`` as a float64 scalar on ``device``, without waiting.

    A number is filled in on the device, not copied from the host.
    """
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float64).reshape(())
    return torch.full((), float(value), dtype=torch.float64, device=device)


def _scaled_allreduce_hook(state, bucket):
    """Multiply this rank's bucket by ``state.bucket_scale``; sum it over ranks.

    The all-reduce is asynchronous, so that it overlaps the backward of the
    layers before the bucket (on gloo's threads, or NCCL's stream), as with
    DDP's default hook. The future that DDP waits for is completed at the
    end of the backward, in the thread that ran it: the first bucket of a
    backward queues :func:`_complete_allreduces` with the autograd engine,
    which runs it after the last bucket and before DDP's own finalizer. No
    Python callback runs on a communication thread (``future.then(...)``
    would: a process that exits a moment after the step then aborts with
    ``terminate called without an active exception``, as that thread cannot
    take the GIL of an interpreter that is shutting down).
    """
    tensor = bucket.buffer()
    if isinstance(state.bucket_scale, torch.Tensor) or state.bucket_scale != 1:
        tensor.mul_(state.bucket_scale)
    state.allreduces += 1
    future = torch.futures.Future(
        devices=[tensor.device] if tensor.is_cuda else None)
    if not state.pending:
        Variable._execution_engine.queue_callback(
            functools.partial(_complete_allreduces, state.pending))
    work = dist.all_reduce(tensor, group=state.process_group, async_op=True)
    state.pending.append((work, future, tensor))
    return future


def _complete_allreduces(pending):
    """Wait for the backward's all-reduces and complete DDP's futures."""
    try:
        for work, future, tensor in pending:
            work.wait()
            future.set_result(tensor)
    finally:
        pending.clear()
