"""The four benchmark sections, plus a profile: each returns a JSON-able dict.

* :func:`overhead`: time per epoch of every contender, interleaved.
* :func:`memory`: activation memory as ``k`` grows, and peak RSS.
* :func:`exactness`: parameter distance to the large-batch net, float64.
* :func:`scaling`: cost as ``k`` grows and as the data grow.
* :func:`profile`: where a ``GradAccNeuralNetClassifier`` epoch spends time.
"""

import cProfile
import functools
import pstats
import sys
import types

import numpy as np
import torch

from benchmarks.contenders import AccumGradLoop, HandLoop, make_net
from benchmarks.memory import activation_peak, rss_peaks
from benchmarks.models import make_data, make_module
from benchmarks.timing import interleave, ratio_summary, summary

__all__ = ['CONTENDERS', 'exactness', 'memory', 'overhead', 'profile', 'scaling']

CONTENDERS = {
    'plain_B': 'skorch `NeuralNetClassifier(batch_size=B)`',
    'plain_B_again': 'the same net again (A/A control: the noise floor)',
    'gradacc_k1': '`GradAccNeuralNetClassifier(batch_size=B, acc_steps=1)`',
    'gradacc': '`GradAccNeuralNetClassifier(batch_size=B, acc_steps=k)`',
    'plain_Bk': 'skorch `NeuralNetClassifier(batch_size=B*k)`',
    'hand': 'hand-written PyTorch loop, `loss / k` (the floor)',
    'hand_skorch_data': 'the same loop, fed by skorch\'s training iterator',
    'accumgrad': 'the hand-written loop with `AccumGrad(SGD, k)`, no `loss / k`',
    'gradacc_no_callbacks': 'GradAcc with `callbacks="disable"`',
    'faq': 'skorch\'s FAQ recipe at (B, k)',
    'accelerate': '`AccelerateMixin` + `Accelerator(gradient_accumulation_steps=k)`',
}


def _workload(name, cfg, n=None, dtype=torch.float32):
    kwargs = cfg.get('module_kwargs', {})
    X, y = make_data(name, cfg['n'] if n is None else n, dtype=dtype, **kwargs)
    module, module_kwargs = make_module(name, dtype=dtype, **kwargs)
    return X, y, module, module_kwargs


def _epoch_fn(net, X, y):
    return functools.partial(net.partial_fit, X, y)


def _linear_fit(x, y):
    """Least-squares line through ``(x, y)``: slope, intercept and R^2."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (slope * x + intercept)
    total = ((y - y.mean()) ** 2).sum()
    r2 = 1.0 - (residual ** 2).sum() / total if total > 0 else 1.0
    return {'slope': float(slope), 'intercept': float(intercept), 'r2': float(r2)}


def _timing_summaries(times, baselines):
    """Summaries of the times, and per-round ratios to each baseline."""
    result = {'cpu_s': {}, 'wall_s': {}, 'ratios': {}}
    for clock in ('cpu', 'wall'):
        for name, values in times[clock].items():
            result[clock + '_s'][name] = summary(values)
        result['ratios'][clock] = {
            baseline: {name: ratio_summary(times[clock], name, baseline)
                       for name in times[clock]}
            for baseline in baselines
        }
    return result


def overhead(models, rounds, warmup=1):
    """Time per epoch of every contender, per workload, in interleaved rounds.

    For each workload, all contenders of :data:`CONTENDERS` train epochs in
    turns, on the same data. Besides the times, the result holds the
    per-round ratios to ``plain_B`` and to ``hand``, and a decomposition of
    the gap between GradAcc and the hand-written loop.
    """
    return {name: _overhead_one(name, cfg, rounds, warmup)
            for name, cfg in models.items()}


def _overhead_one(name, cfg, rounds, warmup):
    X, y, module, module_kwargs = _workload(name, cfg)
    B, k = cfg['B'], cfg['k']
    torch.manual_seed(0)

    def net(kind, batch_size, acc_steps=1, **kwargs):
        return make_net(kind, module, module_kwargs, batch_size, acc_steps,
                        **kwargs)

    data_net = net('plain', B).initialize()
    skorch_iterator = data_net.get_iterator(
        data_net.get_dataset(X, y), training=True)
    accelerate_net = net('accelerate', B, k)
    contenders = {
        'plain_B': _epoch_fn(net('plain', B), X, y),
        'plain_B_again': _epoch_fn(net('plain', B), X, y),
        'gradacc_k1': _epoch_fn(net('gradacc', B, 1), X, y),
        'gradacc': _epoch_fn(net('gradacc', B, k), X, y),
        'plain_Bk': _epoch_fn(net('plain', B * k), X, y),
        'hand': HandLoop.from_arrays(
            module(**module_kwargs), X, y, B, k).epoch,
        'hand_skorch_data': HandLoop(
            module(**module_kwargs), skorch_iterator, k).epoch,
        'accumgrad': AccumGradLoop.from_arrays(
            module(**module_kwargs), X, y, B, k).epoch,
        'gradacc_no_callbacks': _epoch_fn(
            net('gradacc', B, k, callbacks='disable'), X, y),
        'faq': _epoch_fn(net('faq', B, k), X, y),
        'accelerate': _epoch_fn(accelerate_net, X, y),
    }
    times = interleave(contenders, rounds, warmup=warmup)
    # Accelerate shares gradient_accumulation_steps between all its
    # Accelerator objects; make sure no other one changed it meanwhile.
    assert accelerate_net.accelerator.gradient_accumulation_steps == k

    result = {
        'config': {'n': len(X), 'B': B, 'k': k,
                   'micro_batches_per_epoch': -(-len(X) // B),
                   'module_kwargs': cfg.get('module_kwargs', {})},
        'rounds': rounds,
    }
    result.update(_timing_summaries(times, ['plain_B', 'hand']))
    result['gap'] = _gap(times['cpu'], result['config'])
    return result


def _gap(cpu, config):
    """Split GradAcc's extra time over the hand-written loop into parts.

    Per-round differences between contenders that differ in one thing:
    skorch's data path (its ``Dataset`` and collation), skorch's loop without
    callbacks (``notify``, history, ``train_step`` plumbing and GradAcc's
    splitting), and the default callbacks.
    """
    def diff(a, b):
        return summary([x - y for x, y in zip(cpu[a], cpu[b])])

    parts = {
        'data_path': diff('hand_skorch_data', 'hand'),
        'skorch_loop': diff('gradacc_no_callbacks', 'hand_skorch_data'),
        'callbacks': diff('gradacc', 'gradacc_no_callbacks'),
        'total': diff('gradacc', 'hand'),
    }
    hand = summary(cpu['hand'])['median']
    n_micro = config['micro_batches_per_epoch']
    return {
        part: {
            'seconds': values,
            'fraction_of_hand': values['median'] / hand,
            'us_per_micro_batch': 1e6 * values['median'] / n_micro,
        }
        for part, values in parts.items()
    }


def memory(models, ks, repeats, rss_models, rss_repeats,
           rss_malloc=('fixed', 'default'), threads=1):
    """Activation memory as ``k`` grows; peak RSS in fresh processes.

    Activation memory: for each workload and each ``k`` in ``ks``, one epoch
    of ``B * k`` rows (one group) with ``GradAccNeuralNetClassifier(B, k)``
    and with plain skorch at ``B * k``; plain skorch at ``B`` is ``k=1``.

    Peak RSS: for each workload in ``rss_models`` (sized so that activations
    matter) and each of its ``ks``, plain at ``B``, the FAQ recipe and
    GradAcc at ``(B, k)`` and plain at ``B * k``, each trained on one group
    of ``B * k`` rows in its own process; with a fixed mmap threshold
    (``'fixed'``) and/or glibc's default allocator settings (``'default'``),
    as ``rss_malloc`` lists.
    """
    if 1 not in ks:
        raise ValueError('ks must include 1: plain skorch at B is k=1')
    activation = {}
    for name, cfg in models.items():
        kwargs = cfg.get('module_kwargs', {})
        B = cfg['B']
        rows = {'B': B, 'ks': list(ks), 'gradacc': [], 'plain_Bk': []}
        for k in ks:
            for kind, batch_size, key in (
                    ('gradacc', B, 'gradacc'), ('plain', B * k, 'plain_Bk')):
                rows[key].append(summary([
                    activation_peak(kind, name, kwargs, batch_size, k, B * k)
                    for _ in range(repeats)]))
        plain_b = rows['plain_Bk'][list(ks).index(1)]['median']
        rows['gradacc_vs_plain_B'] = [
            entry['median'] / plain_b for entry in rows['gradacc']]
        rows['plain_Bk_vs_plain_B'] = [
            entry['median'] / plain_b for entry in rows['plain_Bk']]
        activation[name] = rows

    return {'activation': activation,
            'rss': _rss(rss_models, rss_repeats, rss_malloc, threads)}


RSS_CONTENDERS = ('plain_B', 'faq', 'gradacc', 'plain_Bk')


def _rss(rss_models, repeats, mallocs, threads):
    """Peak RSS of plain B, the FAQ recipe, GradAcc and plain B*k.

    The FAQ recipe accumulates over the same micro-batches as plain skorch
    at ``B``: it shows what accumulation itself costs, and GradAcc's excess
    over it what GradAcc's whole-group batches cost.
    """
    if not sys.platform.startswith('linux'):
        return {}  # see benchmarks.memory: peak RSS is read the Linux way
    jobs, keys = [], []
    for malloc in mallocs:
        for name, cfg in rss_models.items():
            B = cfg['B']
            for k in cfg['ks']:
                for label in RSS_CONTENDERS:
                    kind = {'plain_B': 'plain', 'plain_Bk': 'plain'}.get(
                        label, label)
                    jobs.append({
                        'kind': kind, 'model': name,
                        'module_kwargs': cfg.get('module_kwargs', {}),
                        'batch_size': B * k if label == 'plain_Bk' else B,
                        'acc_steps': k, 'n_rows': B * k, 'malloc': malloc})
                    keys.append((malloc, name, k, label))
    if not jobs:
        return {}
    rss = {}
    for (malloc, name, k, label), values in zip(
            keys, rss_peaks(jobs, repeats, threads=threads)):
        cfg = rss_models[name]
        entry = rss.setdefault(malloc, {}).setdefault(name, {}).setdefault(
            str(k), {'B': cfg['B'], 'k': k, 'repeats': repeats,
                     'module_kwargs': cfg.get('module_kwargs', {})})
        entry[label] = values
    for by_model in rss.values():
        for name, by_k in by_model.items():
            X, _ = make_data(name, 2, **rss_models[name].get('module_kwargs', {}))
            for entry in by_k.values():
                for key in ('train_kib', 'activation_bytes'):
                    base = entry['plain_B'][key]['median']
                    entry[key + '_vs_plain_B'] = {
                        label: entry[label][key]['median'] / base
                        for label in RSS_CONTENDERS}
                # GradAcc's batches are whole groups: their inputs are in
                # memory at once, which plain B never has
                entry['group_input_kib'] = (
                    entry['B'] * entry['k'] * X[0].nbytes / 2 ** 10)
                entry['gradacc_minus_plain_B_kib'] = (
                    entry['gradacc']['train_kib']['median']
                    - entry['plain_B']['train_kib']['median'])
    return rss


def exactness(models, epochs):
    """Largest parameter difference to the large-batch net after ``epochs``.

    float64 throughout, the same initial weights and sample order. The data
    have a short last micro-batch and a partial last group, where the
    recipes differ. Controls: each recipe with ``acc_steps=1`` against plain
    skorch at ``B``.
    """
    return {name: _exactness_one(name, cfg, epochs)
            for name, cfg in models.items()}


def _exactness_one(name, cfg, epochs):
    X, y, module, module_kwargs = _workload(name, cfg, dtype=torch.float64)
    B, k = cfg['B'], cfg['k']

    def fit(kind, batch_size, acc_steps):
        # build right before fitting: see make_accelerator
        net = make_net(kind, module, module_kwargs, batch_size, acc_steps,
                       max_epochs=epochs)
        torch.manual_seed(0)
        return net.fit(X, y)

    large, plain_b = fit('plain', B * k, 1), fit('plain', B, 1)
    entry = {'config': {'n': len(X), 'B': B, 'k': k, 'epochs': epochs,
                        'module_kwargs': cfg.get('module_kwargs', {})},
             'max_abs_param': _max_abs(large)}
    for kind in ('gradacc', 'faq', 'accelerate', 'naive'):
        net = fit(kind, B, k)
        entry[kind] = {
            'max_param_diff': _max_param_diff(net, large),
            'train_loss_ratio': float(
                net.history[-1, 'train_loss']
                / large.history[-1, 'train_loss']),
            'control_k1_max_param_diff': _max_param_diff(
                fit(kind, B, 1), plain_b),
        }

    def fit_loop(loop_class, acc_steps):
        # the seed and the DataLoader's shuffling are the nets' own
        torch.manual_seed(0)
        loop = loop_class.from_arrays(
            module(**module_kwargs), X, y, B, acc_steps)
        for _ in range(epochs):
            loop.epoch()
        return loop.module

    for kind, loop_class in (('hand', HandLoop), ('accumgrad', AccumGradLoop)):
        entry[kind] = {
            'max_param_diff': _max_module_diff(fit_loop(loop_class, k), large),
            'train_loss_ratio': None,  # the loops keep no history
            'control_k1_max_param_diff': _max_module_diff(
                fit_loop(loop_class, 1), plain_b),
        }
    return entry


def _max_abs(net):
    return max(value.abs().max().item()
               for value in net.module_.state_dict().values())


def _max_param_diff(net, reference):
    state = reference.module_.state_dict()
    return max((value - state[key]).abs().max().item()
               for key, value in net.module_.state_dict().items())


def _max_module_diff(module, reference):
    return _max_param_diff(types.SimpleNamespace(module_=module), reference)


def scaling(k_models, ks, data, rounds, warmup=1):
    """Cost as ``k`` grows at a fixed micro-batch, and as the data grow.

    ``k``: per workload in ``k_models``, GradAcc at ``(B, k)`` for every
    ``k`` in ``ks``, interleaved. An epoch has
    the same micro-batches whatever ``k``, so the epoch time should stay
    flat and the cost of one optimizer step (``k`` micro-batches) should grow
    linearly.

    Data: ``data`` names a ``model``, its ``B``, ``k`` and the sizes ``ns``;
    GradAcc at ``(B, k)`` and plain skorch at ``B`` train on ``n`` rows for
    every ``n``, interleaved. The epoch time should be linear in ``n``.
    """
    by_k = {}
    for name, cfg in k_models.items():
        X, y, module, module_kwargs = _workload(name, cfg)
        B = cfg['B']
        contenders = {}
        for k in ks:
            contenders['gradacc_k{}'.format(k)] = _epoch_fn(make_net(
                'gradacc', module, module_kwargs, B, k), X, y)
        times = interleave(contenders, rounds, warmup=warmup)['cpu']
        n_micro = -(-len(X) // B)
        entry = {'config': {'n': len(X), 'B': B, 'micro_batches': n_micro,
                            'module_kwargs': cfg.get('module_kwargs', {})},
                 'ks': list(ks), 'rounds': rounds}
        epochs = [summary(times['gradacc_k{}'.format(k)]) for k in ks]
        # one optimizer step processes k micro-batches
        step = [epoch['median'] * k / n_micro for epoch, k in zip(epochs, ks)]
        entry['gradacc'] = {'epoch_cpu_s': epochs, 'step_cpu_s': step}
        medians = [epoch['median'] for epoch in entry['gradacc']['epoch_cpu_s']]
        entry['gradacc']['step_fit'] = _linear_fit(ks, entry['gradacc']['step_cpu_s'])
        entry['gradacc']['epoch_spread'] = max(medians) / min(medians)
        by_k[name] = entry

    name, B, k, ns = data['model'], data['B'], data['k'], data['ns']
    contenders = {}
    for n in ns:
        X, y, module, module_kwargs = _workload(name, data, n=n)
        contenders['gradacc_n{}'.format(n)] = _epoch_fn(make_net(
            'gradacc', module, module_kwargs, B, k), X, y)
        contenders['plain_B_n{}'.format(n)] = _epoch_fn(make_net(
            'plain', module, module_kwargs, B), X, y)
    times = interleave(contenders, rounds, warmup=warmup)['cpu']
    by_data = {'model': name, 'B': B, 'k': k, 'ns': list(ns), 'rounds': rounds}
    for kind in ('gradacc', 'plain_B'):
        epochs = [summary(times['{}_n{}'.format(kind, n)]) for n in ns]
        by_data[kind] = {
            'epoch_cpu_s': epochs,
            'fit': _linear_fit(ns, [epoch['median'] for epoch in epochs]),
        }
    return {'by_k': by_k, 'by_data': by_data}


def profile(name, cfg, top=15):
    """cProfile one epoch of GradAcc at ``(B, k)``; the top functions by self time.

    cProfile inflates Python-level costs; use it to name the hot spots and
    the interleaved timings in :func:`overhead` for their size.
    """
    X, y, module, module_kwargs = _workload(name, cfg)
    net = make_net('gradacc', module, module_kwargs, cfg['B'], cfg['k'])
    torch.manual_seed(0)
    net.partial_fit(X, y)  # warm-up
    profiler = cProfile.Profile()
    profiler.enable()
    net.partial_fit(X, y)
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = stats.total_tt
    rows = []
    for (filename, line, function), (_, ncalls, tottime, cumtime, _) in sorted(
            stats.stats.items(), key=lambda item: -item[1][2])[:top]:
        where = filename.split('site-packages/')[-1]
        if 'skorch_gradacc/' in where:
            where = 'skorch_gradacc/' + where.split('skorch_gradacc/')[-1]
        rows.append({'function': '{}:{}({})'.format(where, line, function),
                     'calls': ncalls, 'self_s': tottime, 'cumulative_s': cumtime,
                     'self_fraction': tottime / total})
    return {'model': name, 'B': cfg['B'], 'k': cfg['k'], 'n': len(X),
            'total_s': total, 'top': rows}
