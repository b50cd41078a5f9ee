"""Checkpoints of nets that train on several ranks, loadable anywhere.

:class:`RankZeroCheckpointMixin` gives a data-parallel net (DDP or FSDP2)
skorch's ``save_params`` and ``load_params`` as ``torchrun`` users expect
(skorch's ``AccelerateMixin`` is the model):

* rank 0 alone writes, in the format of a plain net (the module's own
  keys, the optimizer's state by parameter position), so that a plain net
  in one process, or a DDP or FSDP net at any world size, loads the files;
* each file is written under a temporary name and renamed when complete
  (:func:`atomic_files`): a reader never sees it half-written;
* ``load_params`` (and so skorch's ``LoadInitState``) loads on every rank,
  after every rank has arrived (:func:`wait_for_ranks`), so that no rank
  reads a file while rank 0 still writes it.
* every rank writes its random state (torch's CPU and CUDA generators,
  numpy's, Python's ``random`` and the rank's dropout stream) with
  ``f_params``, in ``<f_params stem>_random_state_rank<r>.pt``, and
  ``load_params`` restores it: a run resumed by ``LoadInitState`` draws
  the numbers the uninterrupted one draws (shuffling, dropout). A rank
  without its file (another world size) keeps its own state.

Under ``torchrun --max-restarts N``, the net warns at ``initialize`` if
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` is not set: without it, restarted
ranks can hang in ``init_process_group`` (:func:`warn_if_restarts_hang`).

An engine whose states must be gathered from every rank first (FSDP2) sets
``save_needs_every_rank`` and overrides :meth:`~RankZeroCheckpointMixin.
_checkpoint_states`; a ``save_params`` called on some ranks only then fails
with an error that names the missing ranks, instead of hanging.
"""

import collections
import contextlib
import datetime
import os
import random
import warnings

import numpy as np
import torch
import torch.distributed as dist

__all__ = ['RankZeroCheckpointMixin', 'atomic_files', 'wait_for_ranks',
           'warn_if_restarts_hang']


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
    if not (dist.is_available() and dist.is_initialized()):
        return
    world_size = dist.get_world_size()
    if world_size == 1:
        return
    _arrivals[what] += 1
    # torchrun keeps one store across restarts: keys of an earlier attempt
    # must not count as arrivals
    prefix = 'skorch_gradacc/{}/{}/{}/'.format(
        os.environ.get('TORCHELASTIC_RESTART_COUNT', 0), what, _arrivals[what])
    keys = [prefix + str(rank) for rank in range(world_size)]
    store = dist.distributed_c10d._get_default_store()
    store.set(keys[dist.get_rank()], b'1')
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
                restarts), UserWarning, stacklevel=3)


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


def get_random_state(net):
    """Return this process's random state, in tensors and numbers.

    ``torch.load`` reads it with ``weights_only=True``.
    """
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    stream = getattr(net, 'rank_stream_', None)
    return {
        'torch': torch.get_rng_state(),
        'cuda': (torch.cuda.get_rng_state_all() if torch.cuda.is_available()
                 and torch.cuda.is_initialized() else None),
        'numpy': [torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                  gauss],
        'random': [version, torch.tensor(internal, dtype=torch.int64),
                   gauss_next],
        'rank_stream': None if stream is None else stream.state,
    }


def set_random_state(net, state):
    """Restore what :func:`get_random_state` returned."""
    torch.set_rng_state(state['torch'])
    if state['cuda'] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state['cuda'])
    keys, pos, has_gauss, gauss = state['numpy']
    np.random.set_state(('MT19937', keys.numpy().astype(np.uint32), pos,
                         has_gauss, gauss))
    version, internal, gauss_next = state['random']
    random.setstate((version, tuple(internal.tolist()), gauss_next))
    stream = getattr(net, 'rank_stream_', None)
    if stream is not None:
        stream.state = state['rank_stream']


def _rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _is_rank_zero():
    return not (dist.is_available() and dist.is_initialized()) or (
        dist.get_rank() == 0)


class RankZeroCheckpointMixin:
    """``save_params`` and ``load_params`` for a net trained on several ranks.

    Put it in front of the net class (the data-parallel mixins do). See the
    module docstring for what it guarantees.

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
        with self._checkpoint_states(files):
            if _is_rank_zero():
                with atomic_files(files) as targets:
                    super().save_params(use_safetensors=use_safetensors,
                                        **targets)
        path = random_state_path(files, _rank())
        if path is not None:  # every rank's own, for an exact resume
            with atomic_files({'f': path}) as targets:
                torch.save(get_random_state(self), targets['f'])
        if self.save_needs_every_rank:
            dist.barrier()  # the files are there for every rank

    def load_params(self, f_params=None, f_optimizer=None, f_criterion=None,
                    f_history=None, checkpoint=None, **kwargs):
        """Load the net's state on every rank; call it on every rank.

        It waits for every rank first, so that a file that rank 0 writes
        is complete. The arguments are those of skorch's ``load_params``.
        The rank's random state is restored too, if its file is there.
        """
        wait_for_ranks('load_params', self.rank_wait_timeout)
        files = dict(kwargs, f_params=f_params, f_optimizer=f_optimizer,
                     f_criterion=f_criterion, f_history=f_history)
        super().load_params(checkpoint=checkpoint, **files)
        if checkpoint is not None:  # explicit arguments override it
            files = dict(checkpoint.get_formatted_files(self), **{
                key: value for key, value in files.items() if value})
        path = random_state_path(files, _rank())
        if path is not None and os.path.exists(path):
            set_random_state(self, torch.load(path, weights_only=True))

    def _checkpoint_states(self, files):
        """Return a context in which the states to save are ready.

        An engine that must gather them from every rank overrides it.
        """
        return contextlib.nullcontext()
