"""The parameters of a GradAcc net: their checks, and the signature sklearn reads.

:func:`check_grad_acc_params`, :func:`check_accelerate` and
:func:`check_bases` raise a ValueError for a bad value, combination or
order of bases before any training;
:func:`add_combined_init` gives each net class the ``__init__`` signature
that scikit-learn's ``get_params`` and estimator checks read, and
:func:`params_doc` the docstring section that documents the parameters in
one place.
"""

import inspect
import sys

import torch

from skorch_gradacc.batching import check_bool, check_positive_int
from skorch_gradacc.memory import parse_budget
from skorch_gradacc.precision import AUTOCAST_DTYPES

__all__ = []


def check_grad_acc_params(net):
    """Raise a ValueError for a bad value of one of ``net``'s parameters."""
    check_positive_int('acc_steps', net.acc_steps)
    if not (net.micro_batch_size is None or net.micro_batch_size == 'auto'):
        check_positive_int('micro_batch_size', net.micro_batch_size,
                           "None, 'auto' or ")
    parse_budget(net.memory_budget)
    if net.memory_budget is not None and net.micro_batch_size != 'auto':
        raise ValueError(
            "memory_budget={!r} needs micro_batch_size='auto', got {!r}; "
            "set micro_batch_size='auto' or memory_budget=None.".format(
                net.memory_budget, net.micro_batch_size))
    check_bool('check_loss', net.check_loss)
    check_bool('skip_nonfinite', net.skip_nonfinite)
    if not (net.mixed_precision is None
            or isinstance(net.mixed_precision, str)
            and net.mixed_precision in AUTOCAST_DTYPES):
        raise ValueError(
            "mixed_precision must be None, 'bf16' or 'fp16', got {!r} "
            "instead.".format(net.mixed_precision))
    if net._decides_step() and any(
            isinstance(getattr(net, name + '_', None), torch.optim.LBFGS)
            for name in net._optimizers):
        raise ValueError("{} cannot be used with LBFGS, which evaluates the loss "
                         "several times per step.".format(
                             'skip_nonfinite=True' if net.skip_nonfinite
                             else "mixed_precision='fp16'"))


def check_accelerate(net, mixin):
    """Refuse combinations with skorch's ``AccelerateMixin`` that would be wrong.

    ``mixin``: the GradAcc mixin, which must come after ``AccelerateMixin``
    in the bases.
    """
    hf = sys.modules.get('skorch.hf')  # not imported: not an AccelerateMixin
    if hf is None or not isinstance(net, hf.AccelerateMixin):
        return
    name = type(net).__name__
    mro = type(net).__mro__
    if mro.index(mixin) < mro.index(hf.AccelerateMixin):
        raise ValueError(
            "Put AccelerateMixin before GradAccMixin in the bases of {}, "
            "e.g. class {}(AccelerateMixin, GradAccMixin, "
            "NeuralNetClassifier), so that the accelerator prepares the "
            "training iterator.".format(name, name))
    steps = getattr(net.accelerator, 'gradient_accumulation_steps', 1)
    if steps != 1:
        raise ValueError(
            "The accelerator accumulates gradients itself "
            "(gradient_accumulation_steps={}); with GradAccMixin, create "
            "it with gradient_accumulation_steps=1 and set acc_steps={} on "
            "the net instead.".format(steps, steps))
    if net._decides_step() or net.mixed_precision is not None:
        raise ValueError(
            "With AccelerateMixin, the accelerator steps the optimizer: "
            "leave mixed_precision=None and skip_nonfinite=False on {} "
            "(got mixed_precision={!r}, skip_nonfinite={!r}) and use the "
            "accelerator's mixed_precision option instead.".format(
                name, net.mixed_precision, net.skip_nonfinite))


# what GradAccMixin replaces without calling super(): a base class after it
# that overrides them is never called
REPLACED_METHODS = ('train_step', 'count_loss_items')


def check_bases(net, mixin):
    """Refuse an override of ``REPLACED_METHODS`` in a base after ``mixin``.

    The user's, not skorch's or this package's.
    """
    mro = type(net).__mro__
    for cls in mro[mro.index(mixin) + 1:]:
        if cls.__module__.split('.')[0] in ('builtins', 'skorch', 'skorch_gradacc'):
            continue
        for name in [name for name in REPLACED_METHODS if name in vars(cls)]:
            raise ValueError(
                "{cls}.{name} comes after GradAccMixin in the bases of {net}, "
                "which replaces it; put {cls} before GradAccMixin, so that its "
                "super().{name} is GradAccMixin's.".format(
                    cls=cls.__name__, name=name, net=type(net).__name__))


def add_combined_init(cls):
    """Give ``cls`` an ``__init__`` whose signature scikit-learn can read.

    scikit-learn reads a net's parameters from the signature of its
    ``__init__``: that of the net class it extends plus the keyword-only
    parameters of the mixins in front of it (:func:`combined_signature`).
    A class that defines its own ``__init__`` keeps it.
    """
    if '__init__' in vars(cls):
        return

    def __init__(self, *args, **kwargs):
        super(cls, self).__init__(*args, **kwargs)

    __init__.__signature__ = combined_signature(cls)
    __init__.__qualname__ = cls.__qualname__ + '.__init__'
    __init__._generated_by_grad_acc = True
    cls.__init__ = __init__


def combined_signature(cls):
    """Return the signature of ``cls.__init__`` as the classes define it.

    Walks the MRO: the keyword-only parameters of each mixin, whose
    ``__init__`` takes ``(self, *args, ..., **kwargs)`` (GradAccMixin,
    skorch's AccelerateMixin, ...), are added to the parameters of the
    first ``__init__`` that names its own first parameter: the net class
    being extended.
    """
    mixin_params, extended = [], None
    for klass in cls.__mro__[1:]:
        init = vars(klass).get('__init__')
        if init is None or getattr(init, '_generated_by_grad_acc', False):
            continue
        params = list(inspect.signature(init).parameters.values())
        if params[1].kind == params[1].VAR_POSITIONAL:  # (self, *args, ...)
            mixin_params.extend(param for param in params
                                if param.kind == param.KEYWORD_ONLY)
            continue
        extended = inspect.signature(init)
        break
    params = [param for param in extended.parameters.values()
              if param.kind != param.VAR_KEYWORD]
    names = {param.name for param in params}
    params.extend(param for param in mixin_params if param.name not in names)
    params.extend(param for param in extended.parameters.values()
                  if param.kind == param.VAR_KEYWORD)
    return extended.replace(parameters=params)


def params_doc(cls):
    """Return the Parameters section of ``cls``'s docstring, indented.

    The net classes add GradAccMixin's to their own docstrings, so that
    the parameters are documented in one place.
    """
    doc = inspect.getdoc(cls)
    start = doc.index('Parameters\n----------')
    end = doc.index('Attributes\n----------')
    section = doc[start:end].rstrip()
    return '\n' + '\n'.join(
        '    ' + line if line else line for line in section.splitlines()) + '\n'
