"""A pytest plugin that runs skorch's own test-suite against the GradAcc nets.

skorch's tests get their net classes with ``from skorch import
NeuralNetClassifier`` (and so on). This plugin replaces those names in the
``skorch`` package with the GradAcc nets, with the default ``acc_steps=1``,
before any test module is imported. skorch's internals refer to the classes
through their own modules, which are left alone.

Used by ``tests/test_skorch_suite.py``::

    python -m pytest -p gradacc_swap --pyargs skorch.tests.test_net ...

"""

import skorch

import skorch_gradacc

SWAPPED = {
    'NeuralNet': skorch_gradacc.GradAccNeuralNet,
    'NeuralNetClassifier': skorch_gradacc.GradAccNeuralNetClassifier,
    'NeuralNetBinaryClassifier': skorch_gradacc.GradAccNeuralNetBinaryClassifier,
    'NeuralNetRegressor': skorch_gradacc.GradAccNeuralNetRegressor,
}


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
}


def pytest_collection_modifyitems(config, items):
    selected, deselected = [], []
    for item in items:
        name = item.name.split('[')[0]
        (deselected if name in OUT_OF_SCOPE else selected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


def pytest_configure(config):
    for name, cls in SWAPPED.items():
        setattr(skorch, name, cls)


def pytest_report_header(config):
    return 'gradacc_swap: skorch.{} are the GradAcc nets'.format(
        ', skorch.'.join(SWAPPED))
