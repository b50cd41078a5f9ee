"""Combining GradAccMixin with skorch's AccelerateMixin.

The accelerator must not accumulate on its own: GradAccMixin does the
accumulation, and the accelerator prepares the module, optimizer and
iterators. The last test documents what skorch 1.4's own route
(``Accelerator(gradient_accumulation_steps=k)``) computes instead.
"""

import copy

import numpy as np
import pytest
import torch
from skorch import NeuralNetClassifier

from skorch_gradacc import GradAccMixin

from conftest import (
    PARAM_ATOL,
    MLPClassifier,
    assert_same_history,
    classification_data,
    fit_seeded,
    make_nets,
    max_param_diff,
)

accelerate = pytest.importorskip('accelerate')
from skorch.hf import AccelerateMixin  # noqa: E402


class AcceleratedGradAccNet(AccelerateMixin, GradAccMixin, NeuralNetClassifier):
    """The supported order: AccelerateMixin first."""


class WrongOrderNet(GradAccMixin, AccelerateMixin, NeuralNetClassifier):
    pass


class AcceleratedNet(AccelerateMixin, NeuralNetClassifier):
    """skorch's own accelerate route."""


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    yield
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def accelerator(steps=1):
    return accelerate.Accelerator(cpu=True, gradient_accumulation_steps=steps)


def test_accelerated_grad_acc_net_matches_large_batch(clf_data):
    X, y = clf_data
    acc_net, plain_net = make_nets(4, optimizer__momentum=0.9)
    params = acc_net.get_params()
    params.pop('device')
    acc_net = AcceleratedGradAccNet(accelerator=accelerator(), **params)
    fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
    assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
    assert_same_history(acc_net, plain_net)


def test_wrong_order_is_refused_at_initialization():
    net = WrongOrderNet(MLPClassifier, accelerator=accelerator(), acc_steps=2)
    msg = ("Put AccelerateMixin before GradAccMixin in the bases of "
           "WrongOrderNet, e.g. class WrongOrderNet(AccelerateMixin, "
           "GradAccMixin, NeuralNetClassifier), so that the accelerator "
           "prepares the training iterator.")
    with pytest.raises(ValueError) as exc:
        net.initialize()
    assert str(exc.value) == msg


def test_accelerator_that_accumulates_is_refused():
    net = AcceleratedGradAccNet(MLPClassifier, accelerator=accelerator(4),
                                acc_steps=2)
    msg = ("The accelerator accumulates gradients itself "
           "(gradient_accumulation_steps=4); with GradAccMixin, create it "
           "with gradient_accumulation_steps=1 and set acc_steps=4 on the "
           "net instead.")
    with pytest.raises(ValueError) as exc:
        net.initialize()
    assert str(exc.value) == msg


def test_skorch_accelerate_accumulation_keeps_only_last_micro_batch():
    # skorch 1.4: train_step's closure zeroes the gradients before each
    # backward, and on the step micro-batch the accelerator lets that
    # through, so the update is the last micro-batch's gradient / k.
    X, y = classification_data(32)
    lr, k, batch_size = 0.1, 4, 8
    net = AcceleratedNet(MLPClassifier, accelerator=accelerator(k),
                         batch_size=batch_size, lr=lr, max_epochs=1,
                         train_split=None, verbose=0)
    torch.manual_seed(0)
    net.initialize()
    initial = {name: p.detach().clone()
               for name, p in net.module_.named_parameters()}

    # the gradient of the last micro-batch alone, from the initial weights
    reference = NeuralNetClassifier(MLPClassifier, batch_size=batch_size,
                                    train_split=None).initialize()
    reference.module_.load_state_dict(initial)
    reference.train_step_single((torch.as_tensor(X[-batch_size:]),
                                 torch.as_tensor(y[-batch_size:])))
    last_grad = {name: p.grad.clone()
                 for name, p in reference.module_.named_parameters()}

    net.partial_fit(X, y)
    for name, param in net.module_.named_parameters():
        expected = initial[name] - lr * last_grad[name] / k
        torch.testing.assert_close(param.detach(), expected, rtol=0,
                                   atol=1e-12)

    # and that is far from the large-batch update
    plain = NeuralNetClassifier(MLPClassifier, batch_size=batch_size * k,
                                lr=lr, max_epochs=1, train_split=None,
                                verbose=0).initialize()
    plain.module_.load_state_dict(initial)
    plain.partial_fit(X, y)
    diff = max((p.detach() - q.detach()).abs().max().item() for p, q in zip(
        net.module_.parameters(), plain.module_.parameters()))
    assert diff > 1e-3
    assert np.isfinite(diff)


def test_signature_shows_every_mixins_parameters():
    import inspect

    params = inspect.signature(AcceleratedGradAccNet).parameters
    for name in ['module', 'criterion', 'classes', 'accelerator',
                 'unwrap_after_train', 'acc_steps', 'micro_batch_size',
                 'skip_nonfinite', 'mixed_precision']:
        assert name in params, name
    # the extended net's defaults, not NeuralNet's
    assert params['criterion'].default is torch.nn.NLLLoss
    assert list(params)[-1] == 'kwargs'


@pytest.mark.parametrize('kwargs', [
    {'mixed_precision': 'bf16'}, {'skip_nonfinite': True}])
def test_step_options_with_accelerate_are_refused(kwargs):
    net = AcceleratedGradAccNet(MLPClassifier, accelerator=accelerator(),
                                **kwargs)
    with pytest.raises(ValueError) as exc:
        net.initialize()
    assert str(exc.value) == (
        "With AccelerateMixin, the accelerator steps the optimizer: leave "
        "mixed_precision=None and skip_nonfinite=False on "
        "AcceleratedGradAccNet (got mixed_precision={!r}, skip_nonfinite={!r}) "
        "and use the accelerator's mixed_precision option instead.".format(
            kwargs.get('mixed_precision'), kwargs.get('skip_nonfinite', False)))


def test_auto_plans_under_the_accelerator(clf_data):
    # AccelerateMixin's initialize is a copy of skorch's; the plan's state
    # starts in its first step, as in skorch's
    X, y = clf_data
    acc_net, plain_net = make_nets(4)
    params = dict(acc_net.get_params(), micro_batch_size='auto', memory_budget='1GiB')
    params.pop('device')
    acc_net = AcceleratedGradAccNet(accelerator=accelerator(), **params)
    fit_seeded(acc_net, X, y), fit_seeded(plain_net, X, y)
    assert acc_net.memory_plan_['measured_peak'] is not None
    assert max_param_diff(acc_net, plain_net) < PARAM_ATOL
    assert_same_history(acc_net, plain_net, ignore=['micro_batch_size'])


def test_an_accelerator_that_came_to_accumulate_is_refused_before_training(clf_data):
    # Accelerate keeps one accumulation state per process: a second
    # Accelerator changes the first's gradient_accumulation_steps
    net = AcceleratedGradAccNet(MLPClassifier, accelerator=accelerator(), acc_steps=2,
                                max_epochs=1, verbose=0).initialize()
    before = copy.deepcopy(net.module_.state_dict())
    accelerator(4)
    with pytest.raises(ValueError, match=r'gradient_accumulation_steps=4\)'):
        net.partial_fit(*clf_data)
    for key, value in net.module_.state_dict().items():
        assert torch.equal(value, before[key]), key
