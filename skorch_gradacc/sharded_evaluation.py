"""Evaluation shared among data-parallel ranks, exact and in order.

Validation and ``forward``/``predict``/``predict_proba`` batches are dealt
out in rounds of ``W`` consecutive batches: rank ``r`` evaluates batch ``r``
of each round, and the round's results are gathered on every rank, in the
iterator's order (:func:`evaluate_in_rounds`). No batch is repeated or
dropped, so every rank records the single process's ``valid_loss`` and
scores, and gets the single process's predictions. In the last round a rank
without a batch runs a zero-row forward pass instead, so that every rank
runs as many forward passes (FSDP gathers parameters in each).

Every rank still loads every batch of the iterator, so that skorch's loop
and callbacks (``BatchScoring``, ``EpochScoring`` with caching) see each
batch as in the single process; only the forward passes are shared. The
results travel as pickled CPU tensors, all of them to every rank.
"""

import collections
import itertools

import torch.distributed as dist
from skorch.utils import to_device

from skorch_gradacc.batching import zero_rows

__all__ = ['ShardedEvaluationMixin', 'evaluate_in_rounds']


def evaluate_in_rounds(iterator, evaluate, rank, world_size, group=None,
                       passes=None):
    """Yield ``(batch, result)`` for every batch of ``iterator``, in order.

    Parameters
    ----------
    iterator : iterable
      The evaluation batches; every rank iterates the same ones.

    evaluate : callable
      ``evaluate(batch, own)`` evaluates a batch; ``own`` is False for a
      zero-row batch that only keeps the forward passes even, whose result
      is ignored. It returns what to gather (CPU tensors, picklable).

    rank, world_size : int
      This rank and the number of ranks.

    group : ProcessGroup or None
      The process group; None for the default one.

    passes : callable or None
      ``passes(batch)``: the number of forward passes that evaluating a
      batch takes (with ``micro_batch_size``, one per piece). A rank whose
      batch of the round takes fewer than another's runs zero-row passes
      until every rank has run as many. None: one pass per batch.

    """
    batches = iter(iterator)
    while True:
        round_ = list(itertools.islice(batches, world_size))
        if not round_:
            return
        own = rank < len(round_)
        empty = zero_rows(round_[0])
        result = evaluate(round_[rank] if own else empty, own)
        if passes is not None:
            ran = passes(round_[rank]) if own else 1
            for _ in range(max(passes(batch) for batch in round_) - ran):
                evaluate(empty, False)
        results = [None] * world_size
        dist.all_gather_object(results, result if own else None, group=group)
        del result
        yield from zip(round_, results)


def _ranks():
    """Return ``(rank, world_size)`` when evaluation is shared, else None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world_size = dist.get_world_size()
    return None if world_size == 1 else (dist.get_rank(), world_size)


class ShardedEvaluationMixin:
    """Share validation and inference among the ranks; see the module.

    A base of :class:`~skorch_gradacc.DistributedGradAccMixin` and
    :class:`~skorch_gradacc.FullyShardedGradAccMixin`. ``predict``,
    ``predict_proba``, ``forward`` and ``score`` must then be called on
    every rank, as validation is.
    """

    def run_single_epoch(self, iterator, training, prefix, step_fn,
                         **fit_params):
        """Run the epoch; validation is shared among the ranks.

        skorch's own loop runs over every batch, with each batch's
        ``step_fn`` result taken from the rank that evaluated it.
        """
        ranks = _ranks()
        if training or iterator is None or ranks is None:
            return super().run_single_epoch(
                iterator, training, prefix, step_fn, **fit_params)

        def evaluate(batch, own):
            if not own:
                return self.evaluation_step(batch, training=False)
            return to_device(step_fn(batch, **fit_params), 'cpu')

        results = collections.deque()

        def batches():
            for batch, result in evaluate_in_rounds(
                    iterator, evaluate, *ranks, passes=self._evaluation_passes):
                results.append(result)
                yield batch

        def gathered_step(batch, **_):
            return results.popleft()

        return super().run_single_epoch(batches(), training, prefix,
                                        gathered_step)

    def forward_iter(self, X, training=False, device='cpu'):
        """Yield the module's output for each batch, shared among ranks."""
        ranks = _ranks()
        if ranks is None:
            yield from super().forward_iter(X, training=training,
                                            device=device)
            return
        iterator = self.get_iterator(self.get_dataset(X), training=training)

        def evaluate(batch, own):
            y_pred = self.evaluation_step(batch, training=training)
            return to_device(y_pred, 'cpu') if own else None

        for _, y_pred in evaluate_in_rounds(
                iterator, evaluate, *ranks, passes=self._evaluation_passes):
            yield to_device(y_pred, device)

    def _evaluation_passes(self, batch):
        """Return the forward passes that evaluating ``batch`` takes.

        One, or with ``micro_batch_size`` one per piece
        (:meth:`~skorch_gradacc.GradAccMixin._eval_pieces`).
        """
        pieces = self._eval_pieces(batch)
        return 1 if pieces is None else len(pieces)
