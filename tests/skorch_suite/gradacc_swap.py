"""A pytest plugin that runs skorch's own test-suite against the GradAcc nets.

skorch's tests get their net classes with ``from skorch import
NeuralNetClassifier``, ``from skorch.classifier import
NeuralNetBinaryClassifier`` or ``from skorch.net import NeuralNet``. This
plugin puts the GradAcc nets in all of those places before any test module
is imported. skorch's own code keeps its classes: ``skorch.classifier`` and
``skorch.regressor`` name themselves in ``super(NeuralNetClassifier,
self)``, so the tests see a copy of those modules with the names swapped,
while skorch's functions keep reading the original modules.

The environment variable ``GRADACC_SUITE_MODE`` chooses how the GradAcc nets
train (the mode's name is in the pytest header):

``plain``
  the defaults: ``acc_steps=1``, no option set, plain skorch's training.
``stream``
  ``micro_batch_size`` defaults to ``MICRO_BATCH_SIZE``: every training
  batch larger than that goes through the group loop in several pieces, and
  so do validation and prediction batches.
``acc2``
  ``acc_steps`` defaults to 2, and the training iterator yields
  micro-batches of half the ``batch_size`` the test asks for (when it is
  even; else whole batches with one micro-batch per step), so each step's
  group holds the rows of the batch the test asks for.

Used by ``tests/test_skorch_suite.py``::

    GRADACC_SUITE_MODE=stream python -m pytest -p gradacc_swap \\
        --pyargs skorch.tests.test_net ...

"""

import functools
import inspect
import os
import sys
import types

import skorch
import skorch.classifier
import skorch.net
import skorch.regressor
import torch

import skorch_gradacc

MODE = os.environ.get('GRADACC_SUITE_MODE', 'plain')
# the batch sizes that the files of tests/test_skorch_suite.py ask for are
# at most 16 or above 32: they split as at 16, in half as many pieces, and
# stream's test_net took 43 CPU-seconds, not 66
MICRO_BATCH_SIZE = 32
MODES = ('plain', 'stream', 'acc2')
if MODE not in MODES:
    raise ValueError('GRADACC_SUITE_MODE must be one of {}, got {!r}.'.format(
        MODES, MODE))


def _swapped(base, **defaults):
    """Return a subclass of ``base`` whose parameters default to ``defaults``.

    Its ``__init__`` signature, which scikit-learn reads, shows the new
    defaults, so that ``clone`` and ``get_params`` keep them.
    """

    def __init__(self, *args, **kwargs):
        for name, value in defaults.items():
            kwargs.setdefault(name, value)
        super(cls, self).__init__(*args, **kwargs)

    signature = inspect.signature(base.__init__)
    __init__.__signature__ = signature.replace(parameters=[
        param.replace(default=defaults[name]) if name in defaults else param
        for name, param in signature.parameters.items()])

    def get_iterator(self, dataset, training=False):
        """In training, yield micro-batches of half ``batch_size``, if even."""
        if not training or MODE != 'acc2':
            return super(cls, self).get_iterator(dataset, training=training)
        kwargs = self.get_params_for('iterator_train')
        batch_size = kwargs.get('batch_size', self.batch_size)
        if batch_size == -1:
            batch_size = len(dataset)
        if ('batch_sampler' in kwargs or not isinstance(batch_size, int)
                or batch_size % 2 or self.get_acc_steps() != 2):
            self.acc_steps_ = 1  # this fit's batches as they are
            return super(cls, self).get_iterator(dataset, training=True)
        kwargs['batch_size'] = batch_size // 2
        return self.iterator_train(dataset, **kwargs)

    # defined in this module under its qualified name, so that pickle
    # finds it
    namespace = {'__init__': __init__, 'get_iterator': get_iterator,
                 '__module__': __name__, '__qualname__': '_' + base.__name__,
                 '__doc__': None}  # its examples are the base's
    cls = type(base.__name__, (base,), namespace)
    globals()['_' + base.__name__] = cls
    return cls


DEFAULTS = {
    'plain': {},
    'stream': {'micro_batch_size': MICRO_BATCH_SIZE},
    'acc2': {'acc_steps': 2},
}[MODE]

SWAPPED = {
    name: _swapped(getattr(skorch_gradacc, 'GradAcc' + name), **DEFAULTS)
    for name in ['NeuralNet', 'NeuralNetClassifier',
                 'NeuralNetBinaryClassifier', 'NeuralNetRegressor']
}


class _PatchesReachAllNets(type):
    """Forward attributes set on the swapped NeuralNet to skorch's NeuralNet.

    skorch's tests patch ``skorch.NeuralNet.save_params`` to patch every
    net; the swapped classifier and regressor derive from skorch's
    ``NeuralNet``, not from the swapped one, so the patch is made there.
    Subclasses (a test's ``class MyNet(NeuralNet)``) are left alone. A
    patch of a method that the mixin overrides too (``initialize_optimizer``)
    ends with skorch's own method back: ``mock.patch`` restores it only if
    the name is gone, and the mixin's is still there.
    """

    replaced = {}  # skorch's own attributes that a patch replaced

    def __setattr__(cls, name, value):
        if cls is globals().get('NeuralNet'):
            if name in vars(ORIGINAL_NEURAL_NET):
                cls.replaced.setdefault(name, vars(ORIGINAL_NEURAL_NET)[name])
            setattr(ORIGINAL_NEURAL_NET, name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(cls, name):
        if cls is globals().get('NeuralNet'):
            delattr(ORIGINAL_NEURAL_NET, name)
            if name in cls.replaced:
                setattr(ORIGINAL_NEURAL_NET, name, cls.replaced.pop(name))
        else:
            super().__delattr__(name)


def _neural_net(base):
    def __init__(self, *args, **kwargs):
        super(NeuralNet, self).__init__(*args, **kwargs)

    __init__.__signature__ = inspect.signature(base.__init__)
    return _PatchesReachAllNets('NeuralNet', (base,), {
        '__init__': __init__, '__module__': __name__, '__doc__': None})


ORIGINAL_NEURAL_NET = skorch.net.NeuralNet
NeuralNet = SWAPPED['NeuralNet'] = _neural_net(SWAPPED['NeuralNet'])


# Tests of skorch's suite that cannot apply to a differently named net class
# or that fail for plain skorch in this environment as well. Each is matched
# by the start of its name (before any parameters).
OUT_OF_SCOPE = {
    'test_not_init_raises': 'asserts the class name in the message',
    'test_not_fitted_raises': 'asserts the class name in the message',
    'test_repr_uninitialized_works': "asserts the repr's class name",
    'test_repr_initialized_works': "asserts the repr's class name",
    'test_repr_fitted_works': "asserts the repr's class name",
    'test_pass_empty_classes_raises': 'asserts the class name in the message',
    'test_error_when_classes_could_not_be_inferred':
        'asserts the class name in the message',
    'test_gradient_accumulation': (
        "builds skorch's FAQ accumulation recipe on top of the net, with its "
        "own parameter named acc_steps, which is GradAccMixin's parameter"),
    'test_load_cuda_params_to_cpu': (
        'fails for plain skorch 1.4.0 with this torch too'),
    'test_pickle_load': 'fails for plain skorch 1.4.0 with this torch too',
    'test_distributed_history': (
        'fits its nets in processes it spawns, which import skorch afresh, '
        "without this plugin: they are plain skorch's"),
}


COUNTS_CALLS = ('counts the calls of the module or the criterion, which run '
                'once per micro-batch')

# Tests that assert what cannot match when the module sees micro-batches,
# as the docs' compatibility page says, in the modes that train in pieces.
OUT_OF_SCOPE_IN_PIECES = {
    'test_module_output_2d_raises': (
        "asserts the module output's shape in the message, (128, 2); the "
        "module's output is a micro-batch's"),
    'test_weights_restore': (
        'relies on the dropout draws of seed 1 to stop early: dropout draws '
        'its masks per micro-batch'),
    # these count the calls of the module's forward or of the criterion,
    # which run once per micro-batch: that is what micro-batches are
    'test_fit_params_passed_to_module': COUNTS_CALLS,
    'test_fit_params_passed_to_module_in_pipeline': COUNTS_CALLS,
    'test_fit_with_extra_params_and_routing': COUNTS_CALLS,
    'test_partial_fit_with_extra_params_and_routing': COUNTS_CALLS,
    'test_criterion_training_set_correctly': COUNTS_CALLS,
    'test_net_overrides_caching': (
        "counts the module's forward calls; a fit's loss check (check_loss) "
        'adds three, for one micro-batch'),
    'test_dimension_mismatch_warning': (
        "counts the criterion's broadcasting warnings, one per shape of its "
        'input: pieces of unequal rows give one each'),
}
# in the acc2 mode, every training batch is split, also the small ones
OUT_OF_SCOPE_ACC2 = {
    'test_net_overrides_caching': COUNTS_CALLS,
}
def _out_of_scope():
    out = dict(OUT_OF_SCOPE)
    if MODE != 'plain':
        out.update(OUT_OF_SCOPE_IN_PIECES)
    if MODE == 'acc2':
        out.update(OUT_OF_SCOPE_ACC2)
    return out


def _any_free_port(tcp_store):
    """``tcp_store``, with a free port for a store of one process.

    test_history's shared-history fixture opens one on port 1234: two
    suites at once on one machine (two checkouts' CI) collide there.
    """
    def store(host, port, world_size, is_master, **kwargs):
        if world_size == 1 and is_master:
            port = 0
        return tcp_store(host, port, world_size, is_master, **kwargs)
    return store


def pytest_collection_modifyitems(config, items):
    selected, deselected = [], []
    out = _out_of_scope()
    for module in {item.module for item in items if hasattr(item, 'module')}:
        if module.__name__.rsplit('.', 1)[-1] == 'test_history':
            module.TCPStore = _any_free_port(module.TCPStore)
    for item in items:
        name = item.name.split('[')[0]
        (deselected if name in out else selected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


def _module_copy(module, **names):
    """A copy of ``module`` for ``import`` statements, with ``names`` swapped."""
    copy = types.ModuleType(module.__name__, module.__doc__)
    copy.__dict__.update(vars(module))
    copy.__dict__.update(names)
    return copy


def _refuse_plain_nets():
    """Make fitting a net that is not a GradAcc net an error.

    So a test that gets skorch's own class from somewhere the swap missed
    fails, instead of passing on plain skorch.
    """
    partial_fit = skorch.net.NeuralNet.partial_fit

    @functools.wraps(partial_fit)  # its signature, which sklearn reads
    def checked_partial_fit(self, *args, **kwargs):
        if not isinstance(self, skorch_gradacc.GradAccMixin):
            raise AssertionError(
                'gradacc_swap: a plain {} was fitted; the swap missed where '
                'this test imports it from'.format(type(self).__name__))
        return partial_fit(self, *args, **kwargs)

    skorch.net.NeuralNet.partial_fit = checked_partial_fit


def _compile_without_inductor():
    """Make ``torch.compile``'s backend default to ``'aot_eager'``.

    skorch's tests that compile for real (``compile=True``, no backend
    given) then run dynamo's graphs and AOT autograd as inductor gets them,
    without inductor's C++ builds: 46 of the stream mode's CPU-seconds where
    inductor's cache is empty, as on a fresh CI machine. The tests here
    check the nets' wrappers and training, not torch's code generation
    (tests/conftest.py's ``COMPILED`` does the same). The tests that mock
    ``torch.compile`` replace it, this default with it.
    """
    compile_ = torch.compile

    @functools.wraps(compile_)
    def compile_with_aot_eager(*args, backend='aot_eager', **kwargs):
        return compile_(*args, backend=backend, **kwargs)

    torch.compile = compile_with_aot_eager


def pytest_configure(config):
    _refuse_plain_nets()
    _compile_without_inductor()
    for name, cls in SWAPPED.items():
        setattr(skorch, name, cls)
    # skorch.net refers to NeuralNet only in docstrings: swapped in place
    skorch.net.NeuralNet = SWAPPED['NeuralNet']
    for module, names in [
            (skorch.classifier, ['NeuralNetClassifier',
                                 'NeuralNetBinaryClassifier']),
            (skorch.regressor, ['NeuralNetRegressor'])]:
        copy = _module_copy(module, **{name: SWAPPED[name] for name in names})
        sys.modules[module.__name__] = copy
        setattr(skorch, module.__name__.rsplit('.', 1)[1], copy)


def pytest_report_header(config):
    return 'gradacc_swap: skorch.{} are the GradAcc nets, mode {}'.format(
        ', skorch.'.join(SWAPPED), MODE)
