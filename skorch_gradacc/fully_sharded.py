"""Fully sharded data-parallel training (FSDP2) of GradAcc nets.

:class:`FullyShardedGradAccMixin` shards the module's parameters, gradients
and optimizer state over the ranks with
:func:`torch.distributed.fsdp.fully_shard`: :func:`shard_module` makes the
the modules it shards, :class:`FullyShardedEngine` is what the step needs of FSDP2,
and :meth:`FullyShardedGradAccMixin.checkpoint_states` gathers one full
checkpoint for rank 0 to write.
"""

import contextlib
import functools

import torch
import torch.distributed as dist
from skorch.callbacks import GradientNormClipping
from skorch.utils import _check_f_arguments

from skorch_gradacc.batching import (
    FSDP2_TORCH,
    check_bool,
    padding_batch,
    uncompiled,
)
from skorch_gradacc.counting import net_optimizers
from skorch_gradacc.distributed import (
    RankRandomStreamMixin,
    RankZeroCheckpointMixin,
    ShardedEvaluationMixin,
    pickling_checkpoints,
)
from skorch_gradacc.engine import DataParallelEngine
from skorch_gradacc.precision import (
    AUTOCAST_DTYPES,
    load_scaler_state,
    save_scaler_state,
)

_TOO_OLD = (
    "skorch_gradacc's FullyShardedGradAccMixin needs torch>={}.{} (FSDP2's "
    "fully_shard with sum-only reductions), got torch {}; the rest of "
    "skorch_gradacc works with it.".format(*FSDP2_TORCH, torch.__version__))
try:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
    )
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
except ImportError as error:
    raise ImportError(_TOO_OLD) from error
if not hasattr(FSDPModule, 'set_force_sum_reduction_for_comms'):
    raise ImportError(_TOO_OLD)

__all__ = ['FullyShardedGradAccMixin']

#: Classes that FSDP2 shards apart by default, wherever they are in the module.
TRANSFORMER_BLOCKS = (torch.nn.TransformerEncoderLayer,
                      torch.nn.TransformerDecoderLayer)


def _matches(module, shard_classes):
    return any(isinstance(module, cls) if isinstance(cls, type)
               else type(module).__name__ == cls for cls in shard_classes)


def default_shard_classes(module):
    """Return the classes whose instances :func:`shard_module` shards.

    The block classes a Hugging Face model names in ``_no_split_modules``
    (as Accelerate's transformer auto-wrap policy reads them), and
    PyTorch's :class:`~torch.nn.TransformerEncoderLayer` and
    :class:`~torch.nn.TransformerDecoderLayer`.
    """
    names = set()
    for sub in module.modules():
        names.update(getattr(sub, '_no_split_modules', None) or ())
    return TRANSFORMER_BLOCKS + tuple(sorted(names))


def modules_to_shard(module, shard_classes=None):
    """Return the submodules of ``module`` that FSDP2 shards apart.

    With ``shard_classes`` given (classes or class names), every outermost
    submodule of one of them. Otherwise the transformer blocks of
    :func:`default_shard_classes`, if the module has any, else every member
    holding parameters of a :class:`torch.nn.Sequential` or
    :class:`torch.nn.ModuleList` (each layer of a plain ``Sequential``),
    outermost first. The root is not included, nor a submodule whose
    parameters are tied to others outside it (shared weights), which its
    parent shards with them.
    """
    explicit = shard_classes is not None
    classes = tuple(shard_classes) if explicit else default_shard_classes(module)
    units = []
    # where each parameter is reached from: a tied one (an embedding and
    # the output layer) from more than one place
    paths = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        paths.setdefault(param, []).append(name)

    def visit(parent, containers):
        for child in parent.children():
            if _matches(child, classes) or (
                    containers and isinstance(parent, (torch.nn.Sequential,
                                                       torch.nn.ModuleList))
                    and next(child.parameters(), None) is not None):
                units.append(child)
            else:
                visit(child, containers)

    visit(module, containers=False)
    if not units and explicit:  # a name misspelt: the root alone, silently
        raise ValueError(
            "shard_classes={!r} matches no submodule of the module; give the "
            "classes of its blocks, or None for the default units.".format(
                shard_classes))
    if not units:
        visit(module, containers=True)
    # FSDP2 manages a parameter in one unit, and only that unit's forward
    # gathers it: a unit whose parameter is tied to one outside it is left
    # to the module that holds both
    names = {id(unit): name + '.' for name, unit in module.named_modules()}
    return [unit for unit in units if all(
        path.startswith(names[id(unit)])
        for param in unit.parameters() for path in paths[param])]


def shard_module(module, shard_classes=None, **kwargs):
    """Apply :func:`~torch.distributed.fsdp.fully_shard` to a module, in place.

    Each module of :func:`modules_to_shard` is sharded first, then the root, so that
    one module's parameters are gathered at a time in the forward and
    backward passes. Every FSDP module gets a gradient divide factor of 1
    and sum-only reductions: the reduce-scatter sums the ranks' gradients
    (the divide factor of the root does not reach the inner units, and
    ``ReduceOp.PREMUL_SUM`` is refused by gloo).

    Parameters
    ----------
    module : torch.nn.Module
      The module; ``fully_shard`` moves each module to the mesh's device as
      it shards it.

    shard_classes : sequence of classes or class names, or None
      See :func:`modules_to_shard`.

    **kwargs
      Passed on to ``fully_shard`` (``mesh``, ``mp_policy``, ...).

    Returns
    -------
    module : torch.nn.Module
      The same object, now an ``FSDPModule``.

    """
    for part in modules_to_shard(module, shard_classes):
        fully_shard(part, **kwargs)
    fully_shard(module, **kwargs)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)
    return module


class FullyShardedEngine(DataParallelEngine):
    """The engine of a module sharded with ``fully_shard`` (FSDP2).

    :meth:`~skorch_gradacc.engine.DataParallelEngine.groups` and
    :meth:`~skorch_gradacc.engine.DataParallelEngine.end_step` are those of
    every data-parallel engine. What FSDP2 needs besides:

    * the same passes on every rank, as each one gathers parameters from
      all ranks: before each pass the ranks agree, in one all-reduce of
      three numbers, whether any still has a piece, whether any has one
      after it (else the pass is the step's last, which reduce-scatters),
      and whether a pass failed for lack of memory. A rank without a piece
      runs a zero-row pass (:meth:`passes`);
    * the reduce-scatter on the step's last pass only, or on every pass
      with ``sync_each_batch`` (:meth:`context`);
    * the same count unit on every rank: FSDP2 has no hook to scale a rank's
      gradient before its reduce-scatter. It is 1 (:attr:`count_unit`): each
      backward is weighted by its item count itself; with ``fp16``, whose
      float16 gradients that weight (hundreds of tokens) times the loss
      scale would overflow, it is the largest first count over ranks
      (:attr:`share_count_unit`, one all-reduce per step).

    Parameters
    ----------
    module : torch.nn.Module
      The module, sharded by ``fully_shard``.

    sync_each_batch : bool (default=False)
      Whether every pass reduce-scatters.

    process_group : ProcessGroup or None
      The process group; None for the default one.

    fp16 : bool (default=False)
      Whether the backward passes run under a float16 GradScaler.

    Attributes
    ----------
    reduce_scatters : int
      The passes so far whose backward reduce-scattered.

    """

    count_unit = 1.0

    def __init__(self, module, sync_each_batch=False, process_group=None,
                 fp16=False):
        super().__init__(module, process_group=process_group, shard=True)
        self.sync_each_batch = sync_each_batch
        self.reduce_scatters = 0
        if fp16:
            self.count_unit = None
            self.share_count_unit = functools.partial(self._over_ranks,
                                                op=dist.ReduceOp.MAX)

    def passes(self, pieces):
        """Yield ``(piece, is_last)``, the same number on every rank.

        This rank's pieces, then zero-row ones while another rank has
        pieces; ``is_last`` is the step's last pass over all ranks.
        """
        pieces, template = iter(pieces), None
        current = next(pieces, None)
        while True:
            more = current is not None and not current[1]
            if current is not None and template is None:
                # the zero-row pass of this rank, and of after_error
                template = self._template = padding_batch(current[0])
            any_piece, any_more = self._agree(current is not None, more, None)
            if not any_piece:
                return
            piece = template if current is None else current[0]
            current = None
            yield piece, not any_more
            del piece
            # after this rank's last piece too: the generator ends the step
            # there (a plan that verifies measures the piece)
            following = next(pieces, None)
            current = following if more else None

    def may_skip(self, is_last):
        """No pass is left out: each gathers parameters from all ranks."""
        return False

    def context(self, syncs, net=None):
        """Reduce-scatter in this backward if ``syncs``, else accumulate."""
        syncs = syncs or self.sync_each_batch
        self.reduce_scatters += syncs
        self.module.set_requires_gradient_sync(syncs)
        return self.others_unsynced(net)

    def plan_context(self, net=None):
        """Reduce-scatter in a plan's pass: it leaves no unsharded gradient.

        :meth:`plan_gradient_bytes` counts the one a step holds.
        """
        self.module.set_requires_gradient_sync(True)
        return self.others_unsynced(net)

    def plan_gradient_bytes(self, params):
        """Return the gradient bytes a step holds while a later piece runs.

        FSDP2 accumulates each parameter's unsharded gradient until the
        step's reduce-scatter: the whole parameters' bytes (a DTensor's
        ``numel()``) in the sharded dtype, more than a lower ``param_dtype``
        takes; with ``sync_each_batch``, this rank's shard of ``.grad``.
        """
        if self.sync_each_batch:
            grads = [param.grad.to_local() for param in params
                     if param.grad is not None]
            return sum(grad.nelement() * grad.element_size() for grad in grads)
        return sum(param.numel() * param.element_size() for param in params)

    def join_plan_pass(self, run_empty_pass, piece):
        """Run a zero-row pass for the plan's pass that failed on this rank.

        It all-gathers and reduce-scatters with the other ranks' pass.
        """
        run_empty_pass(padding_batch(piece))

    def after_error(self, run_empty_pass, size):
        """Run a zero-row pass for the failed one, and tell the other ranks.

        The others run the failed pass's collectives, and learn of the error
        at the next agreement, where every rank backs off to ``size``.
        """
        run_empty_pass(self._template)
        self._agree(False, False, size)

    def discard_gradient(self, run_empty_pass):
        """Reduce-scatter what FSDP2 accumulated of the failed attempt.

        FSDP2 keeps the unsharded gradient of passes without a
        reduce-scatter out of ``.grad``; a zero-row pass that reduce-scatters
        moves it there, where the net zeroes it.
        """
        run_empty_pass(self._template)


class FullyShardedGradAccMixin(RankZeroCheckpointMixin,
                               RankRandomStreamMixin,
                               ShardedEvaluationMixin):
    """Mixin that trains a GradAcc net with fully sharded data parallel.

    Put it in front of a GradAcc net, e.g. ``class
    FSDPNet(FullyShardedGradAccMixin, GradAccNeuralNetClassifier)``, start
    one process per rank with ``torchrun`` and call
    :func:`torch.distributed.init_process_group` before ``fit``. Use it
    instead of :class:`~skorch_gradacc.DistributedGradAccMixin` when the
    model, its gradients and its optimizer state do not fit on one device:
    each rank holds ``1 / world_size`` of each, and gathers one sharded module's
    parameters at a time. The iterator is sharded, and the step weighted,
    as with DDP; every rank runs as many passes (zero-row ones where it has
    no micro-batch), so validation, prediction, ``save_params`` and
    ``load_params`` must be called on every rank. ``mixed_precision``
    becomes FSDP's :class:`~torch.distributed.fsdp.MixedPrecisionPolicy`,
    with a ``ShardedGradScaler`` for ``'fp16'``. The docs' "Scaling out"
    page gives the details.

    .. note::

       Tested with 2 ranks on the CPU (gloo). GPUs (NCCL) are untested.

    Parameters
    ----------
    shard_classes : sequence of classes or class names, or None (default=None)
      The submodule classes whose instances each are sharded apart, e.g.
      the transformer block. By default: the classes a Hugging Face model
      names in ``_no_split_modules`` and PyTorch's transformer layers, or,
      for a model without them, every member holding parameters of a
      :class:`torch.nn.Sequential` or :class:`torch.nn.ModuleList` (the
      layers of a plain ``Sequential``). The root is always sharded too.

    sync_each_batch : bool (default=False)
      If False, gradients are reduce-scattered once per optimizer step, on
      the group's last micro-batch; until then each rank holds the
      unsharded gradient. If True, every micro-batch's gradient is
      reduce-scattered, so that only the shards accumulate: less memory,
      ``acc_steps`` times the communication (Accelerate's
      ``sync_each_batch``). Both give the same update.

    Examples
    --------
    >>> from skorch_gradacc import GradAccNeuralNetClassifier
    >>> class FSDPNet(FullyShardedGradAccMixin, GradAccNeuralNetClassifier):
    ...     '''GradAcc classifier with FSDP2, to be run under torchrun'''
    >>> net = FSDPNet(torch.nn.Linear, module__in_features=4,
    ...               module__out_features=2, acc_steps=4,
    ...               shard_classes=['Linear'])
    >>> net.shard_classes
    ['Linear']

    """

    def __init__(self, *args, shard_classes=None, sync_each_batch=False,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.shard_classes = shard_classes
        self.sync_each_batch = sync_each_batch

    # Validation

    def _check_fsdp_params(self):
        check_bool('sync_each_batch', self.sync_each_batch)
        classes = self.shard_classes
        if classes is not None and (
                isinstance(classes, (str, type)) or not all(
                    isinstance(cls, (str, type)) for cls in classes)):
            raise ValueError(
                "shard_classes must be None or a list of module classes or "
                "class names, got {!r} instead.".format(classes))
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "FullyShardedGradAccMixin needs the default process group: "
                "start the script with torchrun and call "
                "torch.distributed.init_process_group() before initializing "
                "the net.")

    def _validate_params(self):
        super()._validate_params()
        self._check_fsdp_params()

    def check_training_readiness(self):
        """Check that the net is ready to train, its FSDP options included.

        A ``Checkpoint`` that pickles the net (``f_pickle``) is refused:
        an FSDP2 net does not pickle; so are ``'fp16'`` and
        ``GradientNormClipping`` beside learnable parameters outside
        ``module_`` (:meth:`_check_gradients_of_one_kind`), and LBFGS beside
        uneven shards (:meth:`_check_lbfgs_shards`).
        """
        super().check_training_readiness()
        if getattr(self, 'initialized_', False):
            self._check_fsdp_params()
        for name, checkpoint in pickling_checkpoints(getattr(self, 'callbacks_', [])):
            raise ValueError(
                "callback {!r} has f_pickle={!r}, but an FSDP2 net does not "
                "pickle; set f_pickle=None and keep f_params and f_optimizer "
                "(save_params).".format(name, checkpoint.f_pickle))
        self._check_gradients_of_one_kind()
        self._check_lbfgs_shards()

    def _check_lbfgs_shards(self):
        """Refuse LBFGS beside a shard that torch cannot flatten.

        LBFGS views each gradient as a vector, and a DTensor sharded
        unevenly (a dimension that the ranks do not divide) has no such
        view: the first step would fail after its forward pass.
        """
        if not getattr(self, 'initialized_', False) or not any(
                isinstance(opt, torch.optim.LBFGS) for opt in net_optimizers(self)):
            return
        for name, param in self.module_.named_parameters():
            for mesh_dim, placement in enumerate(getattr(param, 'placements', ())):
                size = param.device_mesh.size(mesh_dim)
                if placement.is_shard() and param.shape[placement.dim] % size:
                    raise ValueError(
                        "LBFGS needs evenly sharded parameters, but {!r} of "
                        "shape {} is sharded over {} ranks by dimension {}; "
                        "use DistributedGradAccMixin (DDP) or sizes the ranks "
                        "divide.".format(name, tuple(param.shape), size,
                                         placement.dim))

    def _check_gradients_of_one_kind(self):
        """Refuse what takes sharded and plain gradients in one torch call.

        Torch's GradScaler (``'fp16'``) and ``clip_grad_norm_`` refuse
        plain tensors (a criterion's parameters, another module's) beside
        FSDP2's DTensors.
        """
        if not getattr(self, 'initialized_', False):
            return
        sharded = {id(param) for param in self.module_.parameters()}
        plain = [name for name, param in self.get_all_learnable_params()
                 if param.requires_grad and id(param) not in sharded]
        clipping = [name for name, cb in self.callbacks_
                    if isinstance(cb, GradientNormClipping)]
        if plain and (self.mixed_precision == 'fp16' or clipping):
            raise ValueError(
                "FSDP2 shards module_'s parameters, and torch's {} takes no "
                "other parameters beside them, but {} are learnable outside "
                "module_; freeze them, move them into module_, or use "
                "DistributedGradAccMixin (DDP).".format(
                    "GradScaler (mixed_precision='fp16')"
                    if self.mixed_precision == 'fp16' else
                    "clip_grad_norm_ (callback {!r})".format(clipping[0]),
                    plain))

    def __getstate__(self):
        if isinstance(uncompiled(getattr(self, 'module_', None)), FSDPModule):
            raise TypeError(
                "An FSDP2 net does not pickle (fully_shard makes classes of "
                "its own); use save_params and load_params.")
        return super().__getstate__()

    # Initialization

    def _mesh(self):
        device = torch.device(self.device) if self.device else torch.device('cpu')
        if device.type == 'cuda':
            torch.cuda.set_device(device)
        return init_device_mesh(device.type, (dist.get_world_size(),))

    def initialize_module(self):
        """Initialize the module and shard it with ``fully_shard``."""
        self._check_fsdp_params()
        super().initialize_module()
        if isinstance(uncompiled(self.module_), FSDPModule):
            return self
        # fully_shard moves each module to the mesh's device as it shards it,
        # so that the whole module never has to fit there
        kwargs = {'mesh': self._mesh()}
        if self.mixed_precision is not None:
            kwargs['mp_policy'] = MixedPrecisionPolicy(
                param_dtype=AUTOCAST_DTYPES[self.mixed_precision],
                reduce_dtype=torch.float32)
        self.module_ = shard_module(self.module_, self.shard_classes, **kwargs)
        return self

    def make_engine(self):
        """Return the FSDP2 engine of the sharded module (maybe compiled)."""
        if isinstance(module := uncompiled(self.module_), FSDPModule):
            return FullyShardedEngine(module, self.sync_each_batch,
                                      fp16=self.mixed_precision == 'fp16')
        return super().make_engine()

    def autocast(self):
        """Return a null context: FSDP2's MixedPrecisionPolicy casts instead."""
        return contextlib.nullcontext()

    def infer(self, x, **fit_params):
        """Infer; without gradients, outputs in the module's dtype.

        FSDP2's policy computes in low precision in validation and
        prediction too, where a single process's net runs without autocast:
        their outputs and the validation loss come in the module's dtype.
        """
        y_infer = super().infer(x, **fit_params)
        if torch.is_grad_enabled():  # training: the loss takes them as they are
            return y_infer
        return self.in_module_dtype(y_infer)

    def make_grad_scaler(self):
        """Return a ShardedGradScaler, which agrees on a skip over ranks."""
        # every rank unscales its shards; the scaler all-reduces whether any
        # was not finite, so that all ranks step or skip alike. The loss is
        # float16 here (no autocast): its gradient, the scale times a
        # weight near 1, must stay below float16's largest number, 65504
        return ShardedGradScaler(self._device_type(), init_scale=2.0 ** 15)

    # Checkpoints: one full, unsharded copy

    def _is_sharded(self, attr):
        return attr == 'module_' or attr[:-1] in self._optimizers

    def _get_module(self, name, msg):
        # skorch's save_params and load_params read and write the module and
        # the optimizers through this: give them the full, unsharded state
        module = super()._get_module(name, msg)
        if self._is_sharded(name) and isinstance(uncompiled(self.module_), FSDPModule):
            return _FullState(self, name)
        return module

    def _full_state_dict(self, attr):
        """Gather the full state of ``module_`` or an optimizer (collective)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if attr == 'module_':
            state = get_model_state_dict(uncompiled(self.module_), options=options)
            prefix = self._compiled_prefix()
            return {prefix + key: value for key, value in state.items()}
        optimizer = getattr(self, attr)
        if not optimizer.state:  # torch's would step it to make one
            return optimizer.state_dict()  # a plain one's: nothing sharded
        state = get_optimizer_state_dict(self._state_model(), optimizer,
                                         options=options)
        if not state:  # cpu_offload: only rank 0 gets the full state
            return state
        # the format of a plain optimizer: parameters by their position
        names = self._param_names(optimizer)
        state = _renamed(state, {name: i for i, name in enumerate(names)})
        if (scaler := self._get_grad_scaler()) is not None:  # as its own hook
            save_scaler_state(scaler, optimizer, state)
        return state

    def _state_model(self):
        """Return a module of the net's modules and criteria, by attribute.

        What ``torch.distributed.checkpoint`` names the optimizers'
        parameters through: besides the sharded module's, they may hold a
        criterion's (replicated), which ``module_`` alone does not name.
        """
        model = torch.nn.Module()
        for name in self._modules + self._criteria:
            module = getattr(self, name + '_', None)
            if isinstance(module, torch.nn.Module):  # named as by DCP: uncompiled
                model.add_module(name, uncompiled(module))
        return model

    def _compiled_prefix(self):
        """Return what ``compile=True`` puts before module keys in a plain net."""
        return '' if uncompiled(self.module_) is self.module_ else '_orig_mod.'

    def _param_names(self, optimizer):
        names = {param: name for name, param
                 in self._state_model().named_parameters()}
        return [names[param] for group in optimizer.param_groups
                for param in group['params']]

    def _load_full_state_dict(self, attr, state_dict):
        """Shard a full state dict into ``module_`` or an optimizer."""
        options = StateDictOptions(full_state_dict=True)
        if attr == 'module_':
            prefix = self._compiled_prefix()
            set_model_state_dict(uncompiled(self.module_), {
                key[len(prefix):] if key.startswith(prefix) else key: value
                for key, value in state_dict.items()}, options=options)
            return
        optimizer = getattr(self, attr)
        if (scaler := self._get_grad_scaler()) is not None:  # as its own hook
            load_scaler_state(scaler, optimizer, state_dict)
        state_dict = _renamed(state_dict, self._param_names(optimizer))
        # as a plain optimizer's load_state_dict: the file's hyper-parameters
        # (a scheduler's initial_lr too), and no state where it has none
        for group, saved in zip(optimizer.param_groups, state_dict['param_groups']):
            group.update({key: saved[key] for key in saved if key != 'params'})
        options = StateDictOptions(
            # a stateless optimizer's (SGD without momentum): nothing to
            # shard, and the full load needs a local state tensor for its device
            full_state_dict=bool(state_dict['state']), strict=False)
        set_optimizer_state_dict(self._state_model(), optimizer, state_dict,
                                 options=options)
        # torch's load steps a stateless optimizer with zero gradients first
        names = dict(zip(self._param_names(optimizer), (
            param for group in optimizer.param_groups for param in group['params'])))
        for name in set(names) - set(state_dict['state']):
            optimizer.state.pop(names[name], None)

    save_needs_every_rank = True  # the full states are gathered

    @contextlib.contextmanager
    def checkpoint_states(self, files):
        """Gather the full states to save from all ranks (collective)."""
        modules, _ = _check_f_arguments('save_params', **files)
        if getattr(self, 'initialized_', False):
            # a root with parameters of its own stays unsharded after a
            # forward pass without backward (validation, predict); the
            # optimizer holds the sharded ones
            for module in self.module_.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        self._full_states_ = {
            attr: self._full_state_dict(attr) for attr in modules
            if self._is_sharded(attr) and getattr(self, 'initialized_', False)}
        try:
            yield
        finally:
            self._full_states_ = None


class _FullState:
    """The full state dict of a sharded module or optimizer.

    What skorch's ``save_params`` and ``load_params`` see of it; loading
    shards the state again, on every rank.
    """

    def __init__(self, net, attr):
        self.net = net
        self.attr = attr

    def state_dict(self):
        return self.net._full_states_[self.attr]

    def load_state_dict(self, state_dict):
        self.net._load_full_state_dict(self.attr, state_dict)


def _renamed(state, names):
    """Return an optimizer state dict whose parameter keys are ``names[key]``.

    Between a plain optimizer's keys (positions) and the parameter names
    of ``torch.distributed.checkpoint``'s state dicts, either way.
    """
    return {
        'state': {names[key]: value for key, value in state['state'].items()},
        'param_groups': [dict(group, params=[names[key]
                                             for key in group['params']])
                         for group in state['param_groups']],
    }
