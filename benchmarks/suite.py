"""The sections of ``benchmarks.run``, each a function that returns a JSON-able
dict; ``benchmarks.md`` (:mod:`benchmarks.report`) says how to read each."""

import cProfile
import functools
import pstats

import scipy.stats
import torch

from benchmarks.harness import fresh_process, interleave, summary, train_peak_kib
from benchmarks.workloads import AccumGradLoop, HandLoop, make_net, make_workload
from skorch_gradacc.demo import max_param_diff
from skorch_gradacc.meters import track_activation_memory

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
RSS_CONTENDERS = ('plain_B', 'faq', 'gradacc', 'plain_Bk')


def _epoch(kind, module, module_kwargs, B, k, X, y, **kwargs):
    net = make_net(kind, module, module_kwargs, B, k, **kwargs)
    return functools.partial(net.partial_fit, X, y)


def _linear_fit(x, y):
    """Least-squares line through ``(x, y)``: slope, intercept and R^2."""
    fit = scipy.stats.linregress(x, y)
    return {'slope': fit.slope, 'intercept': fit.intercept, 'r2': fit.rvalue ** 2}


def overhead(models, rounds, warmup=1):
    """Time per epoch of the :data:`CONTENDERS`, interleaved, per workload; the
    per-round ratios to ``plain_B`` and ``hand``, and :func:`_gap`."""
    return {name: _overhead_one(name, cfg, rounds, warmup)
            for name, cfg in models.items()}


def _overhead_one(name, cfg, rounds, warmup):
    X, y, module, module_kwargs = make_workload(name, cfg)
    B, k = cfg['B'], cfg['k']
    torch.manual_seed(0)
    epoch = functools.partial(_epoch, module=module, module_kwargs=module_kwargs,
                              X=X, y=y)
    data_net = make_net('plain', module, module_kwargs, B).initialize()
    accelerate = make_net('accelerate', module, module_kwargs, B, k)
    contenders = {
        'plain_B': epoch('plain', B=B, k=1),
        'plain_B_again': epoch('plain', B=B, k=1),
        'gradacc_k1': epoch('gradacc', B=B, k=1),
        'gradacc': epoch('gradacc', B=B, k=k),
        'plain_Bk': epoch('plain', B=B * k, k=1),
        'hand': HandLoop.from_arrays(module(**module_kwargs), X, y, B, k).epoch,
        'hand_skorch_data': HandLoop(module(**module_kwargs), data_net.get_iterator(
            data_net.get_dataset(X, y), training=True), k).epoch,
        'accumgrad': AccumGradLoop.from_arrays(module(**module_kwargs), X, y, B,
                                               k).epoch,
        'gradacc_no_callbacks': epoch('gradacc', B=B, k=k, callbacks='disable'),
        'faq': epoch('faq', B=B, k=k),
        'accelerate': functools.partial(accelerate.partial_fit, X, y),
    }
    times = interleave(contenders, rounds, warmup=warmup)
    # all Accelerators share gradient_accumulation_steps: no other changed it
    assert accelerate.accelerator.gradient_accumulation_steps == k
    result = {'config': {'n': len(X), 'B': B, 'k': k,
                         'micro_batches_per_epoch': -(-len(X) // B),
                         'module_kwargs': cfg.get('module_kwargs', {})},
              'rounds': rounds, 'ratios': {}}
    for clock, by_name in times.items():
        result[clock + '_s'] = {name: summary(values)
                                for name, values in by_name.items()}
        result['ratios'][clock] = {base: {name: summary([
            a / b for a, b in zip(values, by_name[base])])
            for name, values in by_name.items()} for base in ('plain_B', 'hand')}
    result['gap'] = _gap(times['cpu'], result['config'])
    return result


def _gap(cpu, config):
    """Split GradAcc's extra time over the hand-written loop into parts:
    per-round differences between contenders that differ in one thing."""
    parts = {'data_path': ('hand_skorch_data', 'hand'),
             'skorch_loop': ('gradacc_no_callbacks', 'hand_skorch_data'),
             'callbacks': ('gradacc', 'gradacc_no_callbacks'),
             'total': ('gradacc', 'hand')}
    hand, gap = summary(cpu['hand'])['median'], {}
    for part, (a, b) in parts.items():
        seconds = summary([x - y for x, y in zip(cpu[a], cpu[b])])
        gap[part] = {'seconds': seconds, 'fraction_of_hand': seconds['median'] / hand,
                     'us_per_micro_batch': 1e6 * seconds['median']
                     / config['micro_batches_per_epoch']}
    return gap


def epoch_peaks(kind, model, module_kwargs, batch_size, acc_steps, n_rows):
    """Peak RSS growth (KiB: in a fresh process, ``harness.fresh_process``) and
    peak bytes saved for backward of one epoch of ``n_rows``."""
    X, y, module, module_kwargs = make_workload(
        model, {'n': n_rows, 'module_kwargs': module_kwargs})
    net = make_net(kind, module, module_kwargs, batch_size, acc_steps)
    torch.manual_seed(0)
    net.initialize()
    # the meter only wraps what autograd saves anyway: it adds no tensors
    with track_activation_memory() as meter:
        train_kib = train_peak_kib(net, X, y)
    return {'train_kib': train_kib, 'activation_bytes': meter.peak_bytes}


def memory(models, ks, repeats, rss_models, rss_repeats, rss_malloc=('fixed',)):
    """Activation memory of a group of ``B * k`` rows, GradAcc at ``(B, k)`` and
    plain at ``B * k``, each ``k`` of ``ks``; peak RSS of the RSS_CONTENDERS."""
    activation = {}
    for name, cfg in models.items():
        B, kwargs = cfg['B'], cfg.get('module_kwargs', {})
        rows = activation[name] = {'B': B, 'ks': list(ks)}
        for kind, key in (('gradacc', 'gradacc'), ('plain', 'plain_Bk')):
            rows[key] = [summary([epoch_peaks(
                kind, name, kwargs, B if kind == 'gradacc' else B * k, k, B * k)[
                    'activation_bytes'] for _ in range(repeats)]) for k in ks]
        plain_b = rows['plain_Bk'][list(ks).index(1)]['median']
        for key in ('gradacc', 'plain_Bk'):
            rows[key + '_vs_plain_B'] = [entry['median'] / plain_b
                                         for entry in rows[key]]
    return {'activation': activation, 'rss': _rss(rss_models, rss_repeats, rss_malloc)}


def _rss(rss_models, repeats, mallocs):
    cases = [(malloc, name, k) for malloc in mallocs
             for name, cfg in rss_models.items() for k in cfg['ks']]
    runs = {(case, label): [] for case in cases for label in RSS_CONTENDERS}
    for _ in range(repeats):  # interleaved
        for (malloc, name, k), label in runs:
            B, kwargs = rss_models[name]['B'], rss_models[name].get('module_kwargs', {})
            runs[(malloc, name, k), label].append(fresh_process(
                epoch_peaks, 'plain' if label.startswith('plain') else label, name,
                kwargs, B * k if label == 'plain_Bk' else B, k, B * k, malloc=malloc))
    rss = {}
    for malloc, name, k in cases:
        cfg = rss_models[name]
        entry = rss.setdefault(malloc, {}).setdefault(name, {})[str(k)] = {
            'B': cfg['B'], 'k': k, 'repeats': repeats,
            'module_kwargs': cfg.get('module_kwargs', {})}
        for key in ('train_kib', 'activation_bytes'):
            for label in RSS_CONTENDERS:
                entry.setdefault(label, {})[key] = summary(
                    [run[key] for run in runs[(malloc, name, k), label]])
            entry[key + '_vs_plain_B'] = {
                label: entry[label][key]['median'] / entry['plain_B'][key]['median']
                for label in RSS_CONTENDERS}
        # GradAcc's batches are whole groups, whose inputs plain B never holds
        X = make_workload(name, cfg, n=2)[0]
        entry['group_input_kib'] = cfg['B'] * k * X[0].nbytes / 2 ** 10
        entry['gradacc_minus_plain_B_kib'] = (entry['gradacc']['train_kib']['median']
                                              - entry['plain_B']['train_kib']['median'])
    return rss


def exactness(models, epochs):
    """Each recipe's largest parameter difference to the large-batch net after
    ``epochs`` (float64), and its ``acc_steps=1`` control's to plain B."""
    return {name: _exactness_one(name, cfg, epochs) for name, cfg in models.items()}


def _exactness_one(name, cfg, epochs):
    X, y, module, module_kwargs = make_workload(name, cfg, dtype=torch.float64)
    B, k = cfg['B'], cfg['k']

    def fit(kind, batch_size, acc_steps):
        # the seed and the shuffling are the same for nets and loops
        torch.manual_seed(0)
        if kind in ('hand', 'accumgrad'):
            loop = {'hand': HandLoop, 'accumgrad': AccumGradLoop}[kind].from_arrays(
                module(**module_kwargs), X, y, batch_size, acc_steps)
            for _ in range(epochs):
                loop.epoch()
            return loop.module
        # built right before fitting: see make_net's 'accelerate'
        return make_net(kind, module, module_kwargs, batch_size, acc_steps,
                        max_epochs=epochs).fit(X, y)

    large, plain_b = fit('plain', B * k, 1), fit('plain', B, 1)
    entry = {'config': {'n': len(X), 'B': B, 'k': k, 'epochs': epochs,
                        'module_kwargs': cfg.get('module_kwargs', {})}}
    for kind in ('gradacc', 'faq', 'accelerate', 'naive', 'hand', 'accumgrad'):
        trained = fit(kind, B, k)
        history = getattr(trained, 'history', None)  # the loops keep none
        entry[kind] = {
            'max_param_diff': max_param_diff(trained, large),
            'train_loss_ratio': None if history is None else float(
                history[-1, 'train_loss'] / large.history[-1, 'train_loss']),
            'control_k1_max_param_diff': max_param_diff(fit(kind, B, 1), plain_b)}
    return entry


def scaling(k_models, ks, data, rounds, warmup=1):
    """GradAcc's epoch and step time for each ``k`` of ``ks``; GradAcc's and plain
    B's epoch time for each size of ``data['ns']``; linear fits."""
    by_k = {}
    for name, cfg in k_models.items():
        X, y, module, module_kwargs = make_workload(name, cfg)
        B, n_micro = cfg['B'], -(-len(X) // cfg['B'])
        times = interleave({k: _epoch('gradacc', module, module_kwargs, B, k, X, y)
                            for k in ks}, rounds, warmup)['cpu']
        epochs = [summary(times[k]) for k in ks]
        medians = [epoch['median'] for epoch in epochs]
        # one optimizer step processes k micro-batches
        step = [median * k / n_micro for median, k in zip(medians, ks)]
        by_k[name] = {
            'config': {'n': len(X), 'B': B, 'micro_batches': n_micro,
                       'module_kwargs': cfg.get('module_kwargs', {})},
            'ks': list(ks), 'rounds': rounds,
            'gradacc': {'epoch_cpu_s': epochs, 'step_cpu_s': step,
                        'step_fit': _linear_fit(ks, step),
                        'epoch_spread': max(medians) / min(medians)}}
    name, B, k, ns = data['model'], data['B'], data['k'], data['ns']
    contenders = {}
    for n in ns:
        X, y, module, module_kwargs = make_workload(name, data, n=n)
        contenders['gradacc', n] = _epoch('gradacc', module, module_kwargs, B, k, X, y)
        contenders['plain_B', n] = _epoch('plain', module, module_kwargs, B, 1, X, y)
    times = interleave(contenders, rounds, warmup=warmup)['cpu']
    by_data = {'model': name, 'B': B, 'k': k, 'ns': list(ns), 'rounds': rounds}
    for label in ('gradacc', 'plain_B'):
        epochs = [summary(times[label, n]) for n in ns]
        by_data[label] = {'epoch_cpu_s': epochs, 'fit': _linear_fit(
            ns, [epoch['median'] for epoch in epochs])}
    return {'by_k': by_k, 'by_data': by_data}


def profile(name, cfg, top=15):
    """cProfile one epoch of GradAcc: the top functions by self time."""
    X, y, module, module_kwargs = make_workload(name, cfg)
    net = make_net('gradacc', module, module_kwargs, cfg['B'], cfg['k'])
    torch.manual_seed(0)
    net.partial_fit(X, y)  # warm-up
    (profiler := cProfile.Profile()).runcall(net.partial_fit, X, y)
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, function), (_, calls, own, cumulative, _) in sorted(
            stats.stats.items(), key=lambda item: -item[1][2])[:top]:
        where = filename.split('site-packages/')[-1]
        if 'skorch_gradacc/' in where:
            where = 'skorch_gradacc/' + where.split('skorch_gradacc/')[-1]
        rows.append({'function': '{}:{}({})'.format(where, line, function),
                     'calls': calls, 'self_s': own, 'cumulative_s': cumulative,
                     'self_fraction': own / stats.total_tt})
    return {'model': name, 'B': cfg['B'], 'k': cfg['k'], 'n': len(X),
            'total_s': stats.total_tt, 'top': rows}
