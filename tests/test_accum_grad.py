"""AccumGrad in a plain PyTorch loop, against the large-batch loop.

The oracle is the same loop without accumulation, on batches that are the
concatenation of each group's micro-batches, in float64: parameters must
agree to ``PARAM_ATOL``.
"""

import copy
import gc
import inspect
import pickle
import re
import warnings

import numpy as np
import pytest
import torch
from skorch import NeuralNetClassifier

from skorch_gradacc import AccumGrad
from skorch_gradacc.counting import ItemCounts

DTYPE = torch.float64
PARAM_ATOL = 1e-10

OPTIMIZERS = {
    'sgd_momentum': lambda params: torch.optim.SGD(
        params, lr=0.1, momentum=0.9),
    'adam': lambda params: torch.optim.Adam(params, lr=0.01),
    'adamw': lambda params: torch.optim.AdamW(
        params, lr=0.01, weight_decay=0.1),
}


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(10, 16, dtype=DTYPE), torch.nn.Tanh(),
        torch.nn.Linear(16, 3, dtype=DTYPE))


def make_data(n, seed=1):
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 10, dtype=DTYPE, generator=generator)
    y = torch.randint(0, 3, (n,), generator=generator)
    return X, y


def loss_fn(model, X, y):
    return torch.nn.functional.cross_entropy(model(X), y)


def max_diff(model_a, model_b):
    return max((a - b).abs().max().item() for a, b in
               zip(model_a.parameters(), model_b.parameters()))


def large_batch(X, y, sizes, make_opt=OPTIMIZERS['sgd_momentum'], epochs=1,
                hook=None):
    """The plain loop on batches of ``sizes`` rows; ``hook`` before step."""
    model = make_model()
    opt = make_opt(model.parameters())
    for _ in range(epochs):
        for Xb, yb in zip(X.split(sizes), y.split(sizes)):
            opt.zero_grad()
            loss_fn(model, Xb, yb).backward()
            if hook is not None:
                hook(model)
            opt.step()
    return model, opt


def accumulated(X, y, sizes, acc_steps, make_opt=OPTIMIZERS['sgd_momentum'],
                epochs=1, count=False, model=None):
    """The standard loop with AccumGrad on micro-batches of ``sizes`` rows."""
    model = make_model() if model is None else model
    opt = AccumGrad(make_opt(model.parameters()), acc_steps)
    for _ in range(epochs):
        for Xb, yb in zip(X.split(sizes), y.split(sizes)):
            opt.zero_grad()
            if count:
                opt.set_count(len(yb))
            loss_fn(model, Xb, yb).backward()
            opt.step()
        opt.flush()
    return model, opt


class TestExactness:
    @pytest.mark.parametrize('name', list(OPTIMIZERS))
    def test_equal_micro_batches_are_the_large_batch(self, name):
        X, y = make_data(48)  # 4 groups of 3 micro-batches of 4 per epoch
        large, _ = large_batch(X, y, 12, OPTIMIZERS[name], epochs=3)
        model, _ = accumulated(X, y, 4, 3, OPTIMIZERS[name], epochs=3)
        assert max_diff(model, large) <= PARAM_ATOL
        assert max_diff(model, make_model()) > 1e-2  # it did train

    @pytest.mark.parametrize('name', list(OPTIMIZERS))
    def test_counts_make_a_short_last_micro_batch_exact(self, name):
        # 46 rows: 3 groups of 4 + 4 + 4 rows, then one of 4 + 4 + 2
        X, y = make_data(46)
        large, _ = large_batch(X, y, 12, OPTIMIZERS[name], epochs=2)
        model, _ = accumulated(X, y, 4, 3, OPTIMIZERS[name], epochs=2,
                               count=True)
        assert max_diff(model, large) <= PARAM_ATOL

    def test_without_counts_a_short_micro_batch_is_weighted_as_a_full_one(self):
        X, y = make_data(46)
        large, _ = large_batch(X, y, 12)
        model, _ = accumulated(X, y, 4, 3)
        assert max_diff(model, large) > 1e-4

    def test_counts_of_any_sizes_in_a_group(self):
        # the count changes inside groups: .grad is rescaled in place
        X, y = make_data(21)
        large, _ = large_batch(X, y, [10, 11], epochs=2)
        model, _ = accumulated(X, y, [3, 5, 2, 4, 1, 6], 3, epochs=2,
                               count=True)
        assert max_diff(model, large) <= PARAM_ATOL

    def test_token_counts_from_a_mask(self):
        # a loss averaged over non-padding tokens, counted with a tensor
        X, y = make_data(24)
        mask = make_data(24, seed=2)[1] > 0  # about two thirds of the items

        def masked_loss(model, rows):
            losses = torch.nn.functional.cross_entropy(
                model(X[rows]), y[rows], reduction='none')
            return (losses * mask[rows]).sum() / mask[rows].sum()

        large = make_model()
        large_opt = torch.optim.Adam(large.parameters(), lr=0.01)
        model = make_model()
        opt = AccumGrad(torch.optim.Adam(model.parameters(), lr=0.01), 3)
        for start in range(0, 24, 12):
            large_opt.zero_grad()
            masked_loss(large, slice(start, start + 12)).backward()
            large_opt.step()
            for micro in range(start, start + 12, 4):
                rows = slice(micro, micro + 4)
                opt.zero_grad()
                opt.set_count(mask[rows].sum())
                masked_loss(model, rows).backward()
                opt.step()
        assert len({int(mask[i:i + 4].sum()) for i in range(0, 24, 4)}) > 1
        assert max_diff(model, large) <= PARAM_ATOL

    def test_closure(self):
        X, y = make_data(24)
        large, _ = large_batch(X, y, 8)
        model = make_model()
        opt = AccumGrad(OPTIMIZERS['sgd_momentum'](model.parameters()), 2)
        losses = []
        for Xb, yb in zip(X.split(4), y.split(4)):
            def closure(Xb=Xb, yb=yb):
                opt.zero_grad()
                loss = loss_fn(model, Xb, yb)
                loss.backward()
                return loss
            losses.append(opt.step(closure))
        assert all(isinstance(loss, torch.Tensor) for loss in losses)
        assert max_diff(model, large) <= PARAM_ATOL

    def test_zero_grad_after_step_is_the_same_loop(self):
        X, y = make_data(48)
        large, _ = large_batch(X, y, 12)
        model = make_model()
        opt = AccumGrad(OPTIMIZERS['sgd_momentum'](model.parameters()), 3)
        for Xb, yb in zip(X.split(4), y.split(4)):
            loss_fn(model, Xb, yb).backward()
            opt.step()
            opt.zero_grad()
        assert max_diff(model, large) <= PARAM_ATOL


def sum_loss_fn(model, X, y):
    return torch.nn.functional.cross_entropy(model(X), y, reduction='sum')


COUNT_KINDS = ['int', 'tensor', 'device tensor']


@pytest.fixture
def count_kind(request, monkeypatch):
    """How counts are given: Python ints, CPU tensors (read on the host),
    or CPU tensors counted as on a GPU: never read on the host."""
    if request.param == 'device tensor':
        monkeypatch.setattr(ItemCounts, 'host_devices', frozenset())
    return request.param


def as_count(kind, mask):
    """The items of ``mask`` as a Python int or as a tensor, ``mask.sum()``."""
    return int(mask.sum()) if kind == 'int' else mask.sum()


class TestSums:
    @pytest.mark.parametrize('name', ['sgd_momentum', 'adam'])
    def test_summed_losses_are_the_large_batch(self, name):
        # 46 rows: groups of 4 + 4 + 4 rows, and a last one of 4 + 4 + 2
        X, y = make_data(46)
        large = make_model()
        large_opt = OPTIMIZERS[name](large.parameters())
        model = make_model()
        opt = AccumGrad(OPTIMIZERS[name](model.parameters()), 3,
                        reduction='sum')
        for _ in range(2):
            for Xb, yb in zip(X.split(12), y.split(12)):
                large_opt.zero_grad()
                sum_loss_fn(large, Xb, yb).backward()
                large_opt.step()
            for Xb, yb in zip(X.split(4), y.split(4)):
                opt.zero_grad()
                sum_loss_fn(model, Xb, yb).backward()
                opt.step()
            opt.flush()
        assert max_diff(model, large) <= PARAM_ATOL
        assert max_diff(model, make_model()) > 1e-2

    def test_the_default_is_the_mean(self):
        X, y = make_data(24)
        large, _ = large_batch(X, y, 12)
        model, _ = accumulated(X, y, 4, 3)
        assert AccumGrad(torch.optim.SGD(model.parameters(), lr=0.1),
                         2).reduction == 'mean'
        assert max_diff(model, large) <= PARAM_ATOL


def token_data(n=48):
    """Rows whose targets are partly ignored; some micro-batches of 4 rows
    and one whole group of 3 micro-batches have no target at all."""
    X, y = make_data(n)
    y = y.clone()
    y[make_data(n, seed=3)[1] == 0] = -100
    y[0:4] = -100  # the first micro-batch of the first group
    y[20:24] = -100  # the last micro-batch of the second group
    y[36:48] = -100  # the whole fourth group
    return X, y


class TestZeroCounts:
    @pytest.mark.parametrize('count_kind', COUNT_KINDS, indirect=True)
    @pytest.mark.parametrize('name', ['sgd_momentum', 'adam'])
    def test_item_less_micro_batches_are_the_large_batch(self, name,
                                                         count_kind):
        X, y = token_data()
        # CrossEntropyLoss with every target ignored: loss NaN, gradient 0
        large, _ = large_batch(X, y, 12, OPTIMIZERS[name], epochs=2)
        model = make_model()
        opt = AccumGrad(OPTIMIZERS[name](model.parameters()), 3)
        losses = []
        for _ in range(2):
            for Xb, yb in zip(X.split(4), y.split(4)):
                opt.zero_grad()
                opt.set_count(as_count(count_kind, yb != -100))
                loss = loss_fn(model, Xb, yb)
                loss.backward()
                losses.append(loss.item())
                opt.step()
        assert sum(np.isnan(losses)) == 2 * 5  # 5 item-less micro-batches
        assert max_diff(model, large) <= PARAM_ATOL

    @pytest.mark.parametrize('count_kind', COUNT_KINDS, indirect=True)
    def test_a_group_without_items_steps_as_the_large_batch(self, count_kind):
        # groups 3 and 4 of token_data: Adam steps on group 4's zero
        # gradient, with the moments of group 3
        X, y = token_data()
        X, y = X[24:], y[24:]
        large, _ = large_batch(X, y, 12, OPTIMIZERS['adam'])
        model = make_model()
        opt = AccumGrad(OPTIMIZERS['adam'](model.parameters()), 3)
        snapshots = []
        for Xb, yb in zip(X.split(4), y.split(4)):
            opt.zero_grad()
            opt.set_count(as_count(count_kind, yb != -100))
            loss_fn(model, Xb, yb).backward()
            opt.step()
            if opt.stepped:
                snapshots.append(copy.deepcopy(model))
        assert (y[12:] == -100).all() and len(snapshots) == 2
        assert all((param.grad == 0).all() for param in model.parameters())
        assert opt.state[model[0].weight]['step'] == 2
        assert max_diff(*snapshots) > 1e-3
        assert max_diff(model, large) <= PARAM_ATOL

    @pytest.mark.parametrize('name', ['sgd_momentum', 'adam'])
    def test_a_group_without_items_whose_backward_is_left_out_steps_too(self, name):
        # set_count(0) allows leaving the backward out; in a group of none
        # but such micro-batches the large batch still steps, on zeros
        X, y = token_data()
        large, _ = large_batch(X, y, 12, OPTIMIZERS[name])
        model = make_model()
        opt = AccumGrad(OPTIMIZERS[name](model.parameters()), 3)
        for Xb, yb in zip(X.split(4), y.split(4)):
            opt.zero_grad()
            opt.set_count(int((yb != -100).sum()))
            if (yb != -100).any():
                loss_fn(model, Xb, yb).backward()
            opt.step()
        assert opt.stepped and (y[36:] == -100).all()
        assert opt.state[model[0].weight]['step' if name == 'adam' else
                                           'momentum_buffer'] is not None
        assert max_diff(model, large) <= PARAM_ATOL

    @pytest.mark.parametrize('count_kind', COUNT_KINDS, indirect=True)
    def test_a_group_without_items_keeps_the_gradient_its_losses_gave(
            self, count_kind):
        # counts of 0 with a loss that has a gradient all the same (say, a
        # penalty): normalize leaves the summed gradient as it is
        X, y = make_data(12)
        model, reference = make_model(), make_model()
        opt = AccumGrad(torch.optim.SGD(model.parameters(), lr=0.1), 3)
        for Xb, yb in zip(X.split(4), y.split(4)):
            opt.zero_grad()
            opt.set_count(as_count(count_kind, yb < 0))  # no item
            loss_fn(model, Xb, yb).backward()
            opt.step()
            loss_fn(reference, Xb, yb).backward()
        torch.optim.SGD(reference.parameters(), lr=0.1).step()
        assert opt.stepped
        assert max_diff(model, make_model()) > 1e-3
        assert max_diff(model, reference) <= PARAM_ATOL

    @pytest.mark.parametrize('count_kind', COUNT_KINDS[1:], indirect=True)
    @pytest.mark.parametrize('sizes', [[3, 5, 2, 4, 1, 6], [4, 4, 4, 4, 4, 1]])
    def test_tensor_counts_of_any_sizes(self, sizes, count_kind):
        X, y = make_data(21)
        large, _ = large_batch(X, y, [sum(sizes[:3]), sum(sizes[3:])],
                               OPTIMIZERS['adam'], epochs=2)
        model = make_model()
        opt = AccumGrad(OPTIMIZERS['adam'](model.parameters()), 3)
        for _ in range(2):
            for Xb, yb in zip(X.split(sizes), y.split(sizes)):
                opt.zero_grad()
                opt.set_count(torch.ones(len(yb), dtype=torch.int64).sum())
                loss_fn(model, Xb, yb).backward()
                opt.step()
        assert max_diff(model, large) <= PARAM_ATOL


def _optimizer_method_cases():
    """For each public method of torch.optim.Optimizer: a check that it
    works on the wrapper and reaches the wrapped optimizer."""
    X, y = make_data(4)

    def backward(model):
        loss_fn(model, X, y).backward()

    def zero_grad(opt, inner, model):
        backward(model)
        opt.zero_grad()
        assert model[0].weight.grad is None

    def step(opt, inner, model):
        before = float(inner.state[model[0].weight].get('step', 0))
        for _ in range(opt.acc_steps):
            backward(model)
            opt.step()
        assert inner.state[model[0].weight]['step'] == before + 1

    def add_param_group(opt, inner, model):
        extra = torch.nn.Parameter(torch.zeros(2, dtype=DTYPE))
        opt.add_param_group({'params': [extra]})
        assert inner.param_groups[-1]['params'] == [extra]

    def state_dict(opt, inner, model):
        step(opt, inner, model)
        assert opt.state_dict()['optimizer'] == inner.state_dict()

    def load_state_dict(opt, inner, model):
        step(opt, inner, model)
        state = copy.deepcopy(opt.state_dict())
        fresh = AccumGrad(torch.optim.Adam(model.parameters()), 2)
        fresh.load_state_dict(state)
        assert fresh.optimizer.state_dict()['state'][0]['step'] == 1

    def hook(method, run, *expected_args):
        def case(opt, inner, model):
            calls = []
            handle = getattr(opt, method)(
                lambda *args: calls.append(args[0]))
            run(opt, inner, model)
            assert calls == [inner]
            handle.remove()
            run(opt, inner, model)
            assert calls == [inner]
        return case

    def save(opt, inner, model):
        opt.state_dict()

    def load(opt, inner, model):
        opt.load_state_dict(opt.state_dict())

    def profile_hook_step(opt, inner, model):
        calls = []
        inner.register_step_pre_hook(lambda *args: calls.append(args[0]))
        decorated = opt.profile_hook_step(type(inner).step.__wrapped__)
        backward(model)
        decorated(inner)
        assert calls == [inner]

    return {
        'zero_grad': zero_grad,
        'step': step,
        'add_param_group': add_param_group,
        'state_dict': state_dict,
        'load_state_dict': load_state_dict,
        'register_step_pre_hook': hook('register_step_pre_hook', step),
        'register_step_post_hook': hook('register_step_post_hook', step),
        'register_state_dict_pre_hook': hook(
            'register_state_dict_pre_hook', save),
        'register_state_dict_post_hook': hook(
            'register_state_dict_post_hook', save),
        'register_load_state_dict_pre_hook': hook(
            'register_load_state_dict_pre_hook', load),
        'register_load_state_dict_post_hook': hook(
            'register_load_state_dict_post_hook', load),
        'profile_hook_step': profile_hook_step,
    }


OPTIMIZER_METHOD_CASES = _optimizer_method_cases()


def optimizer_methods():
    """The public methods of torch.optim.Optimizer, found by inspection."""
    return sorted(
        name for name in dir(torch.optim.Optimizer)
        if not name.startswith('_') and isinstance(
            inspect.getattr_static(torch.optim.Optimizer, name),
            (staticmethod, classmethod, type(lambda: None))))


class TestOptimizerMethods:
    @pytest.mark.parametrize('name', optimizer_methods())
    def test_every_method_reaches_the_wrapped_optimizer(self, name):
        assert name in OPTIMIZER_METHOD_CASES, (
            'no test of AccumGrad.{} yet'.format(name))
        model = make_model()
        inner = torch.optim.Adam(model.parameters())
        OPTIMIZER_METHOD_CASES[name](AccumGrad(inner, 2), inner, model)

    def test_the_methods_are_found(self):
        assert set(optimizer_methods()) == set(OPTIMIZER_METHOD_CASES)


STATE_DICT_HOOKS = {
    'register_state_dict_pre_hook': 'save',
    'register_state_dict_post_hook': 'save',
    'register_load_state_dict_pre_hook': 'load',
    'register_load_state_dict_post_hook': 'load',
}


def state_dict_hook_calls(method, opt, inner):
    """The calls of three hooks registered by ``method``, the second with
    ``prepend=True``, in a save or a load: (name, arguments' types)."""
    calls = []

    def hook(name):
        def record(*args):
            assert args[0] is inner
            calls.append((name, [type(arg).__name__ for arg in args[1:]]))
        return record

    getattr(opt, method)(hook('first'))
    getattr(opt, method)(hook('prepended'), prepend=True)
    getattr(opt, method)(hook('last'))
    state = opt.state_dict()
    if STATE_DICT_HOOKS[method] == 'load':
        calls.clear()
        opt.load_state_dict(state)
    return calls


class TestStateDictHooks:
    @pytest.mark.parametrize('method', sorted(STATE_DICT_HOOKS))
    def test_called_as_on_the_wrapped_optimizer(self, method):
        # the oracle: the same hooks registered on a bare optimizer
        inner = torch.optim.Adam(make_model().parameters())
        calls = state_dict_hook_calls(method, AccumGrad(inner, 2), inner)
        bare = torch.optim.Adam(make_model().parameters())
        expected = state_dict_hook_calls(method, bare, bare)
        assert [name for name, _ in expected] == ['prepended', 'first', 'last']
        assert calls == expected

    def test_post_hook_changes_what_is_saved(self):
        model = make_model()
        opt = AccumGrad(torch.optim.Adam(model.parameters()), 2)

        def note(optimizer, state_dict):
            state_dict['note'] = 'saved with a note'

        opt.register_state_dict_post_hook(note)
        assert opt.state_dict()['optimizer']['note'] == 'saved with a note'


class TestGroups:
    def test_zero_grad_clears_only_at_group_start(self):
        model = make_model()
        opt = AccumGrad(OPTIMIZERS['sgd_momentum'](model.parameters()), 2)
        X, y = make_data(4)
        opt.zero_grad()
        loss_fn(model, X, y).backward()
        opt.step()
        grad = model[0].weight.grad.clone()
        opt.zero_grad()
        assert torch.equal(model[0].weight.grad, grad)
        loss_fn(model, X, y).backward()
        opt.step()
        assert opt.stepped and opt.position == 0
        opt.zero_grad()
        assert model[0].weight.grad is None

    def test_step_counts_and_stepped(self):
        model = make_model()
        opt = AccumGrad(OPTIMIZERS['adam'](model.parameters()), 3)
        X, y = make_data(4)
        seen = []
        for _ in range(7):
            opt.zero_grad()
            loss_fn(model, X, y).backward()
            opt.step()
            seen.append((opt.position, opt.stepped))
        assert seen == [(1, False), (2, False), (0, True), (1, False),
                        (2, False), (0, True), (1, False)]
        assert opt.state[model[0].weight]['step'] == 2

    def test_flush_steps_a_partial_group_with_its_mean(self):
        # 5 micro-batches of 4, acc_steps=3: a group of 3, then one of 2
        X, y = make_data(20)
        large, _ = large_batch(X, y, [12, 8], OPTIMIZERS['adam'])
        model, opt = accumulated(X, y, 4, 3, OPTIMIZERS['adam'])
        assert opt.stepped and opt.position == 0
        assert max_diff(model, large) <= PARAM_ATOL

    def test_flush_of_an_empty_group_does_nothing(self):
        X, y = make_data(24)
        model, opt = accumulated(X, y, 4, 3, OPTIMIZERS['adam'])
        before = copy.deepcopy(model)
        state = copy.deepcopy(opt.state_dict())
        opt.flush()
        assert not opt.stepped
        assert max_diff(model, before) == 0
        assert opt.state_dict()['optimizer']['state'][0]['step'] == \
            state['optimizer']['state'][0]['step']

    def test_acc_steps_can_change_between_groups(self):
        X, y = make_data(36)
        large, _ = large_batch(X, y, [12, 8, 8, 8], OPTIMIZERS['adam'])
        model = make_model()
        opt = AccumGrad(OPTIMIZERS['adam'](model.parameters()), 3)
        for Xb, yb in zip(X.split(4), y.split(4)):
            opt.zero_grad()
            loss_fn(model, Xb, yb).backward()
            opt.step()
            if opt.stepped:
                opt.acc_steps = 2
        assert opt.position == 0
        assert max_diff(model, large) <= PARAM_ATOL

    def test_acc_steps_one_is_the_wrapped_optimizer(self):
        X, y = make_data(24)
        large, _ = large_batch(X, y, 4, OPTIMIZERS['adamw'])
        model, _ = accumulated(X, y, 4, 1, OPTIMIZERS['adamw'])
        assert max_diff(model, large) == 0

    def test_shares_param_groups_and_state(self):
        model = make_model()
        inner = OPTIMIZERS['adam'](model.parameters())
        opt = AccumGrad(inner, 2)
        assert opt.param_groups is inner.param_groups
        assert opt.state is inner.state
        assert opt.defaults is inner.defaults
        assert repr(opt).startswith('AccumGrad(Adam (')
        assert repr(opt).endswith('acc_steps=2)')


class TestErrors:
    @pytest.mark.parametrize('acc_steps', [0, -1, 1.5, '2', True, None])
    def test_bad_acc_steps(self, acc_steps):
        model = make_model()
        with pytest.raises(ValueError, match=r'acc_steps must be a positive '
                           r'integer, got {}'.format(repr(acc_steps))):
            AccumGrad(torch.optim.SGD(model.parameters(), lr=0.1), acc_steps)

    @pytest.mark.parametrize('optimizer', [None, 'sgd', torch.optim.SGD])
    def test_not_an_optimizer(self, optimizer):
        with pytest.raises(TypeError, match='optimizer must be a torch.optim'
                           '.Optimizer, got'):
            AccumGrad(optimizer, 2)

    def test_nested(self):
        model = make_model()
        opt = AccumGrad(torch.optim.SGD(model.parameters(), lr=0.1), 2)
        with pytest.raises(TypeError, match='already an AccumGrad'):
            AccumGrad(opt, 2)

    def test_lbfgs(self):
        model = make_model()
        with pytest.raises(ValueError, match='LBFGS'):
            AccumGrad(torch.optim.LBFGS(model.parameters()), 2)

    def test_bad_grad_scaler(self):
        model = make_model()
        with pytest.raises(TypeError, match='grad_scaler must be'):
            AccumGrad(torch.optim.SGD(model.parameters(), lr=0.1), 2,
                      grad_scaler='fp16')

    @pytest.mark.parametrize('count', [-1, float('nan'), float('inf'), True,
                                       'a', None])
    def test_bad_count(self, count):
        model = make_model()
        opt = AccumGrad(torch.optim.SGD(model.parameters(), lr=0.1), 2)
        with pytest.raises(ValueError, match=re.escape(
                "count must be a number of items, 0 or more, got {!r} "
                "instead.".format(count))):
            opt.set_count(count)

    @pytest.mark.parametrize('count', [-1, float('nan')])
    def test_bad_count_in_a_cpu_tensor(self, count):
        # read on the host, so checked; on a GPU, a count is not read
        model = make_model()
        opt = AccumGrad(torch.optim.SGD(model.parameters(), lr=0.1), 2)
        with pytest.raises(ValueError, match=re.escape(
                "count must be a number of items, 0 or more, got {!r} "
                "instead.".format(count))):
            opt.set_count(torch.tensor(count))

    @pytest.mark.parametrize('count', [torch.ones(2), torch.tensor(True),
                                       torch.tensor(1j)])
    def test_bad_count_tensor(self, count):
        model = make_model()
        opt = AccumGrad(torch.optim.SGD(model.parameters(), lr=0.1), 2)
        with pytest.raises(ValueError, match=re.escape(
                "count must be a number or a one-element tensor of numbers, "
                "got a tensor of shape {} and dtype {} instead.".format(
                    tuple(count.shape), count.dtype))):
            opt.set_count(count)

    @pytest.mark.parametrize('reduction', ['none', 'Sum', None, 1])
    def test_bad_reduction(self, reduction):
        model = make_model()
        with pytest.raises(ValueError, match=re.escape(
                "reduction must be 'mean' or 'sum', got {!r} instead."
                .format(reduction))):
            AccumGrad(torch.optim.SGD(model.parameters(), lr=0.1), 2,
                      reduction=reduction)

    def test_set_count_with_sums(self):
        model = make_model()
        opt = AccumGrad(torch.optim.SGD(model.parameters(), lr=0.1), 2,
                        reduction='sum')
        with pytest.raises(RuntimeError, match="set_count weights mean losses; "
                           "with reduction='sum'"):
            opt.set_count(4)

    def test_set_count_twice(self):
        model = make_model()
        opt = AccumGrad(torch.optim.SGD(model.parameters(), lr=0.1), 2)
        opt.set_count(4)
        with pytest.raises(RuntimeError, match='set_count was called twice'):
            opt.set_count(4)

    @pytest.mark.parametrize('first_counted', [True, False])
    def test_counted_and_uncounted_in_one_group(self, first_counted):
        model = make_model()
        opt = AccumGrad(torch.optim.SGD(model.parameters(), lr=0.1), 2)
        X, y = make_data(4)
        if first_counted:
            opt.set_count(4)
        loss_fn(model, X, y).backward()
        opt.step()
        if not first_counted:
            opt.set_count(4)
        loss_fn(model, X, y).backward()
        with pytest.raises(RuntimeError, match='every micro-batch of a group'):
            opt.step()


def lr_lambda(update):
    return 1.0 / (1 + update)


class TestSchedulers:
    @pytest.mark.parametrize('built_on', ['wrapper', 'wrapped optimizer'])
    def test_guarded_scheduler_follows_the_large_batch_schedule(self, built_on):
        # 5 micro-batches per epoch, acc_steps=2: updates of 2, 2, 1 rows
        X, y = make_data(20)
        large = make_model()
        large_opt = OPTIMIZERS['sgd_momentum'](large.parameters())
        large_sched = torch.optim.lr_scheduler.LambdaLR(large_opt, lr_lambda)
        large_lrs = []
        for _ in range(2):
            for Xb, yb in zip(X.split(8), y.split(8)):
                large_opt.zero_grad()
                loss_fn(large, Xb, yb).backward()
                large_opt.step()
                large_sched.step()
                large_lrs.append(large_sched.get_last_lr()[0])

        model = make_model()
        opt = AccumGrad(OPTIMIZERS['sgd_momentum'](model.parameters()), 2)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt if built_on == 'wrapper' else opt.optimizer, lr_lambda)
        lrs = []
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            for _ in range(2):
                for Xb, yb in zip(X.split(4), y.split(4)):
                    opt.zero_grad()
                    opt.set_count(len(yb))
                    loss_fn(model, Xb, yb).backward()
                    opt.step()
                    if opt.stepped:
                        sched.step()
                        lrs.append(sched.get_last_lr()[0])
                opt.flush()
                if opt.stepped:
                    sched.step()
                    lrs.append(sched.get_last_lr()[0])
        assert lrs == large_lrs and len(lrs) == 6
        assert opt.optimizer.param_groups[0]['lr'] == large_opt.param_groups[0]['lr']
        assert max_diff(model, large) <= PARAM_ATOL

    def test_scheduler_stepped_per_micro_batch_warns(self):
        model = make_model()
        opt = AccumGrad(OPTIMIZERS['sgd_momentum'](model.parameters()), 2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        X, y = make_data(4)
        loss_fn(model, X, y).backward()
        opt.step()  # counts the micro-batch, applies no update
        with pytest.warns(UserWarning, match='before `optimizer.step'):
            sched.step()

    def test_pickles_with_a_scheduler_attached(self):
        model = make_model()
        opt = AccumGrad(OPTIMIZERS['adam'](model.parameters()), 2)
        torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        X, y = make_data(4)
        loss_fn(model, X, y).backward()
        opt.step()
        copied = pickle.loads(pickle.dumps(opt))
        assert copied.position == 1 and copied.acc_steps == 2


class TestStateDict:
    def run(self, X, y, model, opt, micro_batches):
        for Xb, yb in list(zip(X.split(4), y.split(4)))[micro_batches]:
            opt.zero_grad()
            loss_fn(model, Xb, yb).backward()
            opt.step()

    def test_resume_at_a_group_boundary_continues_exactly(self):
        X, y = make_data(48)
        large, _ = large_batch(X, y, 12, OPTIMIZERS['adam'])
        model = make_model()
        opt = AccumGrad(OPTIMIZERS['adam'](model.parameters()), 3)
        self.run(X, y, model, opt, slice(0, 6))
        assert opt.position == 0
        saved = pickle.dumps((model.state_dict(), opt.state_dict()))
        del model, opt

        model_state, opt_state = pickle.loads(saved)
        model = make_model(seed=123)
        model.load_state_dict(model_state)
        opt = AccumGrad(OPTIMIZERS['adam'](model.parameters()), 3)
        opt.load_state_dict(opt_state)
        self.run(X, y, model, opt, slice(6, None))
        assert max_diff(model, large) <= PARAM_ATOL

    def test_mid_group_the_gradient_is_in_grad(self):
        X, y = make_data(48)
        large, _ = large_batch(X, y, 12, OPTIMIZERS['adam'])
        model = make_model()
        opt = AccumGrad(OPTIMIZERS['adam'](model.parameters()), 3)
        self.run(X, y, model, opt, slice(0, 5))
        state = opt.state_dict()
        assert state['position'] == 2
        grads = [param.grad.clone() for param in model.parameters()]
        model_state = copy.deepcopy(model.state_dict())

        fresh = make_model(seed=123)
        fresh.load_state_dict(model_state)
        fresh_opt = AccumGrad(OPTIMIZERS['adam'](fresh.parameters()), 3)
        fresh_opt.load_state_dict(copy.deepcopy(state))
        for param, grad in zip(fresh.parameters(), grads):
            param.grad = grad
        self.run(X, y, fresh, fresh_opt, slice(5, None))
        assert max_diff(fresh, large) <= PARAM_ATOL

    def test_a_plain_optimizers_state_resumes_at_a_group_boundary(self):
        # a checkpoint of a loop without accumulation, at its step 2
        X, y = make_data(48)
        large, _ = large_batch(X, y, 12, OPTIMIZERS['adam'])
        model = make_model()
        plain = OPTIMIZERS['adam'](model.parameters())
        for Xb, yb in list(zip(X.split(12), y.split(12)))[:2]:
            plain.zero_grad()
            loss_fn(model, Xb, yb).backward()
            plain.step()
        opt = AccumGrad(OPTIMIZERS['adam'](model.parameters()), 3)
        self.run(X, y, model, opt, slice(0, 1))  # a group begun: it starts anew
        opt.load_state_dict(copy.deepcopy(plain.state_dict()))
        assert opt.position == 0
        self.run(X, y, model, opt, slice(6, None))
        assert max_diff(model, large) <= PARAM_ATOL

    def test_position_must_fit_acc_steps(self):
        model = make_model()
        opt = AccumGrad(OPTIMIZERS['adam'](model.parameters()), 3)
        X, y = make_data(8)
        self.run(X, y, model, opt, slice(0, 2))
        smaller = AccumGrad(OPTIMIZERS['adam'](model.parameters()), 2)
        with pytest.raises(ValueError, match='acc_steps=2'):
            smaller.load_state_dict(opt.state_dict())


def clip(max_norm):
    def hook(model):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return hook


class TestClippingAndMixedPrecision:
    MAX_NORM = 0.05

    def test_clipping_once_per_group_on_the_mean_gradient(self):
        X, y = make_data(48)
        norms = []
        large, _ = large_batch(
            X, y, 12, epochs=2,
            hook=lambda model: norms.append(clip(self.MAX_NORM)(model)))
        assert min(norms) > self.MAX_NORM  # clipping acts on every update

        model = make_model()
        opt = AccumGrad(OPTIMIZERS['sgd_momentum'](model.parameters()), 3)
        calls = []
        opt.register_step_pre_hook(
            lambda optimizer, args, kwargs: calls.append(
                clip(self.MAX_NORM)(model)))
        for _ in range(2):
            for Xb, yb in zip(X.split(4), y.split(4)):
                opt.zero_grad()
                loss_fn(model, Xb, yb).backward()
                opt.step()
        assert len(calls) == len(norms) == 8
        assert max_diff(model, large) <= PARAM_ATOL

    # a fused optimizer: the scaler would leave unscaling to its kernel and
    # call it on inf too
    @pytest.mark.parametrize('fused', [False, True])
    def test_grad_scaler_unscales_once_per_group_before_clipping(self, fused):
        # float64 and a power-of-two scale: scaling is exact, so the result
        # is the large-batch loop's
        X, y = make_data(46)
        large, _ = large_batch(X, y, 12, hook=clip(self.MAX_NORM))
        model = make_model()
        scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 10)
        opt = AccumGrad(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                        fused=fused), 3, grad_scaler=scaler)

        def clip_hook(optimizer, args, kwargs):
            clip(self.MAX_NORM)(model)

        opt.register_step_pre_hook(clip_hook)
        for Xb, yb in zip(X.split(4), y.split(4)):
            opt.zero_grad()
            opt.set_count(len(yb))
            scaler.scale(loss_fn(model, Xb, yb)).backward()
            opt.step()
        opt.flush()
        assert scaler.get_scale() == 2.0 ** 10
        assert max_diff(model, large) <= PARAM_ATOL

    @pytest.mark.parametrize('fused', [False, True])
    def test_grad_scaler_skips_a_group_with_inf(self, fused):
        X, y = make_data(24)
        model = make_model()
        scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 10)
        opt = AccumGrad(torch.optim.Adam(model.parameters(), lr=0.01, fused=fused),
                        3, grad_scaler=scaler)
        stepped, snapshots = [], []
        for i, (Xb, yb) in enumerate(zip(X.split(4), y.split(4))):
            opt.zero_grad()
            loss = loss_fn(model, Xb, yb)
            if i == 1:
                loss = loss * float('inf')
            scaler.scale(loss).backward()
            opt.step()
            if opt.position == 0:
                stepped.append(opt.stepped)
                snapshots.append(copy.deepcopy(model))
        assert stepped == [False, True]
        assert max_diff(snapshots[0], make_model()) == 0
        assert scaler.get_scale() == 2.0 ** 9
        assert opt.state[model[0].weight]['step'] == 1
        assert all(torch.isfinite(param).all() for param in model.parameters())

    def test_float16_autocast_on_cpu(self):
        X, y = make_data(48)
        X, model, large = X.float(), make_model().float(), make_model().float()
        scalers = [torch.amp.GradScaler('cpu') for _ in range(2)]
        large_opt = torch.optim.SGD(large.parameters(), lr=0.1)
        opt = AccumGrad(torch.optim.SGD(model.parameters(), lr=0.1), 3,
                        grad_scaler=scalers[1])
        for Xb, yb in zip(X.split(12), y.split(12)):
            with torch.autocast('cpu', dtype=torch.float16):
                loss = loss_fn(large, Xb, yb)
            scalers[0].scale(loss).backward()
            scalers[0].step(large_opt)
            scalers[0].update()
            large_opt.zero_grad()
        for Xb, yb in zip(X.split(4), y.split(4)):
            opt.zero_grad()
            with torch.autocast('cpu', dtype=torch.float16):
                loss = loss_fn(model, Xb, yb)
            assert loss.dtype == torch.float32
            scalers[1].scale(loss).backward()
            opt.step()
        assert model[0].weight.grad is not None
        assert max_diff(model, make_model().float()) > 1e-2
        assert max_diff(model, large) < 1e-4  # float16 rounding


    def test_a_grad_scaler_steps_with_one_wrapper(self):
        # a second wrapper would unscale with the scale the first's update()
        # changed (3.9e-2 off PyTorch's recipe for two optimizers): refused;
        # the same optimizer wrapped again, or after the first is gone, is not
        model = make_model()
        scaler = torch.amp.GradScaler('cpu')
        first = torch.optim.SGD(model[0].parameters(), lr=0.1)
        opt = AccumGrad(first, 2, grad_scaler=scaler)
        with pytest.raises(ValueError) as exc:
            AccumGrad(torch.optim.SGD(model[2].parameters(), lr=0.1), 2,
                      grad_scaler=scaler)
        assert str(exc.value) == (
            "grad_scaler is given to another AccumGrad already, whose update "
            "would change its scale before this one unscales; wrap one "
            "optimizer, with a param group per part, instead.")
        AccumGrad(first, 3, grad_scaler=scaler)
        del opt
        gc.collect()
        AccumGrad(torch.optim.SGD(model[2].parameters(), lr=0.1), 2,
                  grad_scaler=scaler)


def accum_sgd(params, acc_steps=1, **kwargs):
    """An optimizer factory for skorch's ``optimizer=``."""
    return AccumGrad(torch.optim.SGD(params, **kwargs), acc_steps)


class TestSkorchOptimizer:
    def fit(self, n, batch_size, **kwargs):
        X, y = make_data(n)
        net = NeuralNetClassifier(
            make_model, criterion=torch.nn.CrossEntropyLoss, lr=0.1,
            optimizer__momentum=0.9, batch_size=batch_size, max_epochs=2,
            train_split=None, verbose=0, **kwargs)
        torch.manual_seed(0)
        return net.fit(X.numpy(), y.numpy())

    def test_equal_groups_are_the_large_batch_net(self):
        large = self.fit(48, 12)
        net = self.fit(48, 4, optimizer=accum_sgd, optimizer__acc_steps=3)
        assert isinstance(net.optimizer_, AccumGrad)
        assert max_diff(net.module_, large.module_) <= PARAM_ATOL
        # the history has one row per micro-batch, not per update
        assert len(net.history[-1, 'batches']) == 12
        assert np.isclose(net.history[-1, 'train_loss'],
                          large.history[-1, 'train_loss'])
        copied = pickle.loads(pickle.dumps(net))
        assert copied.optimizer_.acc_steps == 3

    def test_the_last_partial_group_is_not_flushed(self):
        large = self.fit(40, 12)
        net = self.fit(40, 4, optimizer=accum_sgd, optimizer__acc_steps=3)
        assert net.optimizer_.position == 2  # 20 micro-batches, 6 updates
        assert max_diff(net.module_, large.module_) > 1e-4
