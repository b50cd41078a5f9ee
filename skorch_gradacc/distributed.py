"""Data-parallel training of GradAcc nets: DDP, and what FSDP2's mixin shares.

:class:`DistributedGradAccMixin` wraps the module in DistributedDataParallel
and shards the user's own training iterator by micro-batch, for
``torchrun``; its engine is :class:`skorch_gradacc.engine.DDPEngine`. The
mixins it shares with :class:`~skorch_gradacc.FullyShardedGradAccMixin`:
checkpoints written once and loadable anywhere, a random stream of each
rank's own for the forward passes, and evaluation shared among the ranks.
The docs' "Scaling out" page says what each guarantees.
"""

import collections
import contextlib
import datetime
import hashlib
import itertools
import os
import random
import warnings

import numpy as np
import torch
import torch.distributed as dist
from skorch.callbacks import Checkpoint
from skorch.utils import to_device
from torch.nn.parallel import DistributedDataParallel

from skorch_gradacc.batching import (
    n_ranks,
    padding_batch,
    this_rank,
    uncompiled,
    user_stacklevel,
)
from skorch_gradacc.engine import engine_for

__all__ = ['DistributedGradAccMixin']


# Checkpoints of nets that train on several ranks, loadable anywhere

@contextlib.contextmanager
def atomic_files(files):
    """Write files under temporary names; rename them once all are written.

    Parameters
    ----------
    files : dict
      Maps skorch's ``f_*`` arguments to their targets. A path (``str`` or
      ``os.PathLike``) gets a temporary name in the same directory; a
      file-like object or None is passed through.

    Yields
    ------
    targets : dict
      The same keys, with the temporary names to write to. On leaving the
      block, each is renamed to its path with :func:`os.replace`, which is
      atomic; if the block raises, the temporary files are removed.

    """
    temps = {key: '{}.{}.tmp'.format(os.fspath(f), os.getpid())
             for key, f in files.items() if isinstance(f, (str, os.PathLike))}
    try:
        yield dict(files, **temps)
    except BaseException:
        for temp in temps.values():
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp)
        raise
    for key, temp in temps.items():
        os.replace(temp, files[key])


def pickling_checkpoints(callbacks):
    """Yield ``(name, checkpoint)``: skorch's Checkpoints that pickle the net.

    Those in ``callbacks`` (``net.callbacks_``) with an ``f_pickle``, also
    the one a ``TrainEndCheckpoint`` holds.
    """
    for name, callback in callbacks:
        for each in (callback, getattr(callback, 'checkpoint_', None)):
            if isinstance(each, Checkpoint) and each.f_pickle:
                yield name, each


@contextlib.contextmanager
def pickled_by_rank_zero(callbacks):
    """Hold back the ``f_pickle`` of skorch's Checkpoints on ranks but 0.

    ``Checkpoint`` (:func:`pickling_checkpoints`) opens ``f_pickle`` and
    pickles the net itself, not through the net's
    ``save_params``: every rank would truncate and write the same file at
    once, each with its own history. Within the block, the Checkpoints of
    ranks other than 0 have ``f_pickle=None``; after it, their own again.
    """
    checkpoints = [] if this_rank() == 0 else [
        checkpoint for _, checkpoint in pickling_checkpoints(callbacks)]
    targets = [checkpoint.f_pickle for checkpoint in checkpoints]
    for checkpoint in checkpoints:
        checkpoint.f_pickle = None
    try:
        yield
    finally:
        for checkpoint, target in zip(checkpoints, targets):
            checkpoint.f_pickle = target


_arrivals = collections.Counter()


def wait_for_ranks(what, timeout):
    """Wait until every rank has called ``wait_for_ranks(what, ...)``.

    A barrier through the default process group's store, which works with
    any backend and, unlike :func:`torch.distributed.barrier`, gives up
    after ``timeout`` seconds with an error that names the ranks that did
    not arrive. The n-th call on one rank meets the n-th call on the others.
    Nothing happens without an initialized process group of several ranks.

    Raises
    ------
    RuntimeError
      If some rank has not arrived within ``timeout`` seconds.

    """
    world_size = n_ranks()
    if world_size == 1:
        return
    _arrivals[what] += 1
    # torchrun keeps one store across restarts: keys of an earlier attempt
    # must not count as arrivals
    prefix = 'skorch_gradacc/{}/{}/{}/'.format(
        os.environ.get('TORCHELASTIC_RESTART_COUNT', 0), what, _arrivals[what])
    keys = [prefix + str(rank) for rank in range(world_size)]
    store = dist.distributed_c10d._get_default_store()
    store.set(keys[this_rank()], b'1')
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError) as exc:
        missing = [rank for rank, key in enumerate(keys)
                   if not store.check([key])]
        raise RuntimeError(
            "{} must be called on every rank: rank(s) {} did not call it "
            "within {} s (rank_wait_timeout). Call it on every rank, not "
            "under `if rank == 0:`.".format(what, missing, timeout)) from exc


def warn_if_restarts_hang():
    """Warn if torchrun may restart the ranks on a store they would share.

    torchrun tells its workers how many restarts it allows
    (``TORCHELASTIC_MAX_RESTARTS``). Unless
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` is set, all attempts share one
    store, where a restarted rank can read a dead rank's address: its
    ``init_process_group`` then fails or hangs. The warning comes in the
    first attempt, before any crash.
    """
    restarts = os.environ.get('TORCHELASTIC_MAX_RESTARTS', '0')
    if restarts.isdigit() and int(restarts) > 0 and not os.environ.get(
            'TORCH_DISABLE_SHARE_RDZV_TCP_STORE'):
        warnings.warn(
            "torchrun may restart the ranks (TORCHELASTIC_MAX_RESTARTS={}), "
            "but restarted ranks can hang in init_process_group on the store "
            "of the first attempt; launch with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ...".format(
                restarts), UserWarning, stacklevel=user_stacklevel())


def random_state_path(files, rank):
    """Return the file of rank ``rank``'s random state, or None.

    Next to ``f_params`` (``f_module`` as skorch's ``Checkpoint`` calls
    it, which saves each file in a call of its own), if it is a path:
    ``params.pt`` gives ``params_random_state_rank0.pt``.
    """
    f = files.get('f_params') or files.get('f_module')
    if not isinstance(f, (str, os.PathLike)):
        return None
    return '{}_random_state_rank{}.pt'.format(
        os.path.splitext(os.fspath(f))[0], rank)


def get_random_state():
    """Return this process's random state, in tensors and numbers.

    ``torch.load`` reads it with ``weights_only=True``.
    """
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    # not the rank's dropout stream: checkpoints are written at epoch ends,
    # and the stream is reseeded at each epoch's first step
    return {
        'torch': torch.get_rng_state(),
        'cuda': (torch.cuda.get_rng_state_all() if torch.cuda.is_available()
                 and torch.cuda.is_initialized() else None),
        'numpy': [torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                  gauss],
        'random': [version, torch.tensor(internal, dtype=torch.int64),
                   gauss_next],
    }


def set_random_state(state):
    """Restore what :func:`get_random_state` returned."""
    torch.set_rng_state(state['torch'])
    if state['cuda'] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state['cuda'])
    keys, pos, has_gauss, gauss = state['numpy']
    np.random.set_state(('MT19937', keys.numpy().astype(np.uint32), pos,
                         has_gauss, gauss))
    version, internal, gauss_next = state['random']
    random.setstate((version, tuple(internal.tolist()), gauss_next))


class RankZeroCheckpointMixin:
    """``save_params`` and ``load_params`` for a net trained on several ranks.

    Rank 0 alone writes, in a plain net's format (loadable at any world
    size), each file under a temporary name renamed when complete
    (:func:`atomic_files`); every rank writes its random state next to
    ``f_params``. ``load_params`` loads on every rank once all have arrived
    (:func:`wait_for_ranks`), and restores the rank's random state.

    Attributes
    ----------
    save_needs_every_rank : bool
      Class attribute: whether ``save_params`` gathers the states from all
      ranks (FSDP2), so that it must be called on every rank. If False
      (DDP, whose ranks hold the same parameters), rank 0 writes without
      waiting, and the habit ``if rank == 0: net.save_params(...)`` works.

    rank_wait_timeout : float
      Class attribute: how many seconds a call that needs every rank
      waits for the others before it raises, naming the missing ranks.

    """

    save_needs_every_rank = False
    rank_wait_timeout = 60.0

    def initialize(self):
        """Initialize the net; warn if torchrun's restarts could hang."""
        warn_if_restarts_hang()
        return super().initialize()

    def save_params(self, f_params=None, f_optimizer=None, f_criterion=None,
                    f_history=None, use_safetensors=False, **kwargs):
        """Save the net's state once, from rank 0, in a plain net's format.

        The arguments are those of skorch's ``save_params``; every path is
        written under a temporary name, then renamed. The other ranks write
        nothing.
        """
        files = dict(kwargs, f_params=f_params, f_optimizer=f_optimizer,
                     f_criterion=f_criterion, f_history=f_history)
        if self.save_needs_every_rank:
            wait_for_ranks('save_params', self.rank_wait_timeout)
        with self.checkpoint_states(files):
            if this_rank() == 0:
                with atomic_files(files) as targets:
                    super().save_params(use_safetensors=use_safetensors,
                                        **targets)
        path = random_state_path(files, this_rank())
        if path is not None:  # every rank's own, for an exact resume
            with atomic_files({'f': path}) as targets:
                torch.save(get_random_state(), targets['f'])
        if self.save_needs_every_rank:
            dist.barrier()  # the files are there for every rank

    def load_params(self, f_params=None, f_optimizer=None, f_criterion=None,
                    f_history=None, checkpoint=None, **kwargs):
        """Load the net's state on every rank; call it on every rank.

        It waits for every rank first, so that a file that rank 0 writes
        is complete. The arguments are those of skorch's ``load_params``.
        The rank's random state is restored too, if its file is there, but
        at the end of training (``Checkpoint(load_best=True)``): there plain
        skorch's random state goes on.
        """
        wait_for_ranks('load_params', self.rank_wait_timeout)
        files = dict(kwargs, f_params=f_params, f_optimizer=f_optimizer,
                     f_criterion=f_criterion, f_history=f_history)
        super().load_params(checkpoint=checkpoint, **files)
        if checkpoint is not None:  # explicit arguments override it
            files = dict(checkpoint.get_formatted_files(self), **{
                key: value for key, value in files.items() if value})
        path = random_state_path(files, this_rank())
        if (path is not None and os.path.exists(path)
                and not getattr(self, '_at_train_end_', False)):
            set_random_state(torch.load(path, weights_only=True))

    def notify(self, method_name, **cb_kwargs):
        """Call the callbacks; note when it is the end of training.

        Checkpoints pickle the net (``f_pickle``) from rank 0 alone
        (:func:`pickled_by_rank_zero`).
        """
        self._at_train_end_ = method_name == 'on_train_end'
        try:
            with pickled_by_rank_zero(getattr(self, 'callbacks_', [])):
                super().notify(method_name, **cb_kwargs)
        finally:
            self._at_train_end_ = False

    def checkpoint_states(self, files):
        """Return the context in which ``save_params`` writes ``files``.

        The override point of a mixin whose states must first be gathered
        from every rank (FSDP2); here, nothing to do.

        Parameters
        ----------
        files : dict
          The ``f_*`` arguments of ``save_params``.

        """
        return contextlib.nullcontext()


# A random stream of its own for each rank's forward passes (dropout)

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

    All ranks take rank 0's random state each epoch, for one shuffled
    order; without this, they would also draw the same dropout masks. The
    module's training forward passes draw from ``rank_stream_``, reseeded
    at each epoch's first step from the common state and the rank; the
    global generator is swapped back after each pass.
    """

    def initialize_module(self):
        """Initialize the module and attach the rank's random stream."""
        super().initialize_module()
        if getattr(self, 'rank_stream_', None) is not None:
            self.rank_stream_.detach()  # from a module that may be reused
        module = getattr(self.module_, 'module', self.module_)  # DDP
        self.rank_stream_ = RankStream().attach(module)
        if 'rank_stream_' not in self.cuda_dependent_attributes_:
            # pickled with the module, whose hooks call it: apart, the
            # module would unpickle calling a copy (and its hooks' handles
            # a copy of its hook dicts, which the next pickle loses)
            self.cuda_dependent_attributes_ = [
                *self.cuda_dependent_attributes_, 'rank_stream_']
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
            if n_ranks() > 1:
                self.rank_stream_.reseed(this_rank())


# Evaluation shared among the ranks, exact and in order

def evaluate_in_rounds(iterator, evaluate, rank, world_size,
                       process_group=None,
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

    process_group : ProcessGroup or None
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
        empty = padding_batch(round_[0])
        result = evaluate(round_[rank] if own else empty, own)
        if passes is not None:
            ran = passes(round_[rank]) if own else 1
            for _ in range(max(passes(batch) for batch in round_) - ran):
                evaluate(empty, False)
        results = [None] * world_size
        dist.all_gather_object(results, result if own else None,
                               group=process_group)
        del result
        yield from zip(round_, results)


def _ranks():
    """Return ``(rank, world_size)`` when evaluation is shared, else None."""
    world_size = n_ranks()
    return None if world_size == 1 else (this_rank(), world_size)


class ShardedEvaluationMixin:
    """Share validation and inference among the ranks, exact and in order.

    Rank ``r`` evaluates batch ``r`` of each round of ``W`` batches, and the
    results are gathered on every rank in order (:func:`evaluate_in_rounds`),
    so every rank records the single process's scores. ``predict``,
    ``predict_proba``, ``forward`` and ``score`` must be called on every
    rank, as validation is.
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
        (:meth:`~skorch_gradacc.GradAccMixin.eval_pieces`).
        """
        pieces = self.eval_pieces(batch)
        return 1 if pieces is None else len(pieces)


# DistributedDataParallel

def requires_grad(module):
    """Return which of ``module``'s parameters require a gradient."""
    return [param.requires_grad for param in module.parameters()]


class DistributedGradAccMixin(RankZeroCheckpointMixin, RankRandomStreamMixin,
                              ShardedEvaluationMixin):
    """Mixin that trains a GradAcc net with DistributedDataParallel.

    Put it in front of a GradAcc net, e.g. ``class
    DDPNet(DistributedGradAccMixin, GradAccNeuralNetClassifier)``, start one
    process per rank with ``torchrun`` and call
    :func:`torch.distributed.init_process_group` before ``fit``. The module
    is wrapped in :class:`~torch.nn.parallel.DistributedDataParallel`, and
    rank ``r`` of ``W`` trains on micro-batches ``r, r + W, ...`` of the
    user's own training iterator, ``acc_steps`` per step, all but its last
    under ``no_sync()``: ``W`` ranks with ``acc_steps=k`` train exactly like
    one process with ``acc_steps=k * W``. Validation and prediction are
    shared among the ranks (call them on every rank); ``save_params`` writes
    once, from rank 0, in a plain net's format. The docs' "Scaling out"
    page gives the details.

    Attributes
    ----------
    engine_ : skorch_gradacc.engine.DDPEngine
      The engine (set at the first step); ``engine_.allreduces`` counts the
      gradient all-reduces (one per bucket and step).

    """

    def initialize_module(self):
        """Initialize the module and wrap it for data-parallel training."""
        super().initialize_module()
        if not isinstance(self.module_, DistributedDataParallel):
            # DDP wants the module on its device, where skorch moves it
            # only after initialize_module
            self.module_ = self._wrap(to_device(self.module_, self.device))
        return self

    def _wrap(self, module):
        """Return ``module`` wrapped in DistributedDataParallel.

        Which of its parameters require a gradient is kept in
        ``_wrapped_requires_grad_``, for :meth:`run_single_epoch`.
        """
        if not dist.is_available() or not dist.is_initialized():
            # e.g. a net unpickled in one process: it predicts, not trains
            raise RuntimeError(
                "DistributedGradAccMixin needs the default process group to "
                "train: start the script with torchrun and call "
                "torch.distributed.init_process_group() before training.")
        param = next(module.parameters(), None)  # DDP says if none
        self._wrapped_requires_grad_ = requires_grad(module)
        return DistributedDataParallel(module, device_ids=(
            [param.device.index] if param is not None and param.is_cuda
            else None))

    def run_single_epoch(self, iterator, training, prefix, step_fn,
                         **fit_params):
        """Run the epoch; in training, wrap the module anew if need be.

        If a callback (skorch's ``Freezer``, ``Unfreezer``) or the user has
        changed which parameters require a gradient since the module was
        wrapped, it is wrapped anew, on every rank; a module unpickled
        (pickled unwrapped), wrapped again; with ``compile=True``, compiled
        around DDP, as skorch compiles it after :meth:`initialize_module`.
        """
        module = uncompiled(self.module_)
        if training and not isinstance(module, DistributedDataParallel):
            self.module_ = self.torch_compile(self._wrap(module), 'module')
        elif (training and module is not self.module  # not the user's own
              and requires_grad(module.module) != self._wrapped_requires_grad_):
            # DDP syncs the parameters that required a gradient when it
            # wrapped: it would raise for want of a frozen one's gradient,
            # and leave an unfrozen one's unsynced
            self.module_ = self.torch_compile(self._wrap(module.module), 'module')
        return super().run_single_epoch(
            iterator, training, prefix, step_fn, **fit_params)

    def _without_ddp(self, module):
        """Return ``module`` as a plain net holds it: without DDP's wrapper.

        Compiled, if it was (``compile=True``), as skorch compiles it: a
        new wrapper, whose parameters are named ``_orig_mod.<name>``.
        """
        inner = uncompiled(module)
        if not isinstance(inner, DistributedDataParallel):
            return module
        return inner.module if inner is module else self.torch_compile(
            inner.module, 'module')

    def __getstate__(self):
        # the module unwrapped: DDP's wrapper unpickles only in a process
        # group; training wraps it again (run_single_epoch)
        module = self.__dict__.get('module_')
        if uncompiled(module) is self.module:  # the user's own: as given
            return super().__getstate__()
        self.__dict__['module_'] = self._without_ddp(module)
        try:
            return super().__getstate__()
        finally:
            self.__dict__['module_'] = module

    def get_all_learnable_params(self):
        """Yield the learnable parameters, named as in the unwrapped module.

        skorch matches these names against the patterns of
        ``optimizer__param_groups``, ``Freezer`` and ``ParamMapper``:
        without DDP's ``module.`` prefix, they match as in a plain net.
        """
        module, names = uncompiled(self.module_), {}
        if isinstance(module, DistributedDataParallel):
            # compile=True's wrapper names them _orig_mod.<name>, in a plain net too
            prefix = '' if module is self.module_ else '_orig_mod.'
            names = {param: prefix + name
                     for name, param in module.module.named_parameters()}
        for name, param in super().get_all_learnable_params():
            yield names.get(param, name), param

    def make_engine(self):
        """Return the DDP engine, which shards the training iterator."""
        return engine_for(self.module_, shard=True,
                          fp16=self.mixed_precision == 'fp16')

    def _get_module(self, name, msg):
        # skorch's save_params and load_params read and write the module
        # through this: give them the unwrapped module, a plain net's keys
        return self._without_ddp(super()._get_module(name, msg))
