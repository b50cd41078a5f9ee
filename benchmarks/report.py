"""Turn the results into targets, Markdown tables and a PNG plot."""

import math

from benchmarks.suite import CONTENDERS, RSS_CONTENDERS

__all__ = ['evaluate_targets', 'markdown', 'plot']

OVERHEAD_TARGET = 1.03
MEMORY_TARGET = 1.10
EXACT_TARGET = 1e-10
LINEAR_R2 = 0.99

MODEL_LABELS = {'mlp': 'MLP', 'cnn': 'CNN', 'transformer': 'Transformer'}


def _label(model):
    return MODEL_LABELS.get(model, model)


def evaluate_targets(results):
    """The targets of the benchmarks, the measured values, and whether met.

    Returns a list of dicts with ``id``, ``target``, ``measured`` (a short
    text) and ``met`` (bool).
    """
    targets = []
    overhead = results.get('overhead')
    exactness = results.get('exactness')
    if overhead:
        ratios = {model: entry['ratios']['cpu']['plain_B']['gradacc']['median']
                  for model, entry in overhead.items()}
        targets.append({
            'id': 'overhead',
            'target': 'GradAcc (B, k) <= {:.2f}x plain skorch at B, per '
                      'epoch (median CPU time)'.format(OVERHEAD_TARGET),
            'measured': ', '.join('{} {:.3f}x'.format(_label(model), ratio)
                                  for model, ratio in ratios.items()),
            'met': all(ratio <= OVERHEAD_TARGET for ratio in ratios.values()),
        })
        parts, met = [], True
        for model, entry in overhead.items():
            by_plain = entry['ratios']['cpu']['plain_B']
            k1, noise = by_plain['gradacc_k1'], by_plain['plain_B_again']
            inside = noise['min'] <= k1['median'] <= noise['max']
            met = met and inside
            parts.append('{} {:.3f}x (A/A noise {:.3f}-{:.3f})'.format(
                _label(model), k1['median'], noise['min'], noise['max']))
        if exactness:
            diffs = [entry['gradacc']['control_k1_max_param_diff']
                     for entry in exactness.values()]
            met = met and max(diffs) == 0.0
            parts.append('parameters bit for bit equal: {}'.format(
                'yes' if max(diffs) == 0.0 else 'no ({:.1e})'.format(max(diffs))))
        targets.append({
            'id': 'acc_steps_1',
            'target': 'acc_steps=1 indistinguishable from plain skorch: its '
                      'median time ratio within the A/A control\'s range',
            'measured': '; '.join(parts),
            'met': met,
        })
    memory = results.get('memory')
    if memory:
        worst = max(
            (ratio, model, k)
            for model, entry in memory['activation'].items()
            for k, ratio in zip(entry['ks'], entry['gradacc_vs_plain_B']))
        targets.append({
            'id': 'memory_activation',
            'target': 'GradAcc activation memory within {:.0f}% of plain B, '
                      'any k'.format(100 * (MEMORY_TARGET - 1)),
            'measured': 'worst {:.3f}x ({}, k={})'.format(
                worst[0], _label(worst[1]), worst[2]),
            'met': worst[0] <= MEMORY_TARGET,
        })
        for malloc, what in (('fixed', 'fixed mmap threshold'),
                             ('default', 'glibc defaults')):
            entries = memory['rss'].get(malloc, {})
            cases = [(entry['train_kib_vs_plain_B']['gradacc'], model, k)
                     for model, by_k in entries.items()
                     for k, entry in by_k.items()]
            if not cases:
                continue
            targets.append({
                'id': 'memory_rss_' + malloc,
                'target': 'GradAcc peak RSS growth within {:.0f}% of plain B '
                          '({})'.format(100 * (MEMORY_TARGET - 1), what),
                'measured': ', '.join('{} k={} {:.2f}x'.format(
                    _label(model), k, ratio) for ratio, model, k in cases),
                'met': all(ratio <= MEMORY_TARGET for ratio, _, _ in cases),
            })
    if exactness:
        diffs = {model: entry['gradacc']['max_param_diff']
                 for model, entry in exactness.items()}
        targets.append({
            'id': 'exactness',
            'target': 'GradAcc parameters within {:.0e} of the large-batch '
                      'net (float64)'.format(EXACT_TARGET),
            'measured': ', '.join('{} {:.1e}'.format(_label(model), diff)
                                  for model, diff in diffs.items()),
            'met': all(diff < EXACT_TARGET for diff in diffs.values()),
        })
    scaling = results.get('scaling')
    if scaling:
        fits = {model: entry['gradacc']['step_fit']['r2']
                for model, entry in scaling['by_k'].items()}
        targets.append({
            'id': 'scaling_k',
            'target': 'cost per optimizer step linear in k (R^2 >= {})'.format(
                LINEAR_R2),
            'measured': ', '.join('{} R^2={:.4f}'.format(_label(model), r2)
                                  for model, r2 in fits.items()),
            'met': all(r2 >= LINEAR_R2 for r2 in fits.values()),
        })
        r2 = scaling['by_data']['gradacc']['fit']['r2']
        targets.append({
            'id': 'scaling_data',
            'target': 'epoch time linear in the number of samples '
                      '(R^2 >= {})'.format(LINEAR_R2),
            'measured': '{} R^2={:.4f}'.format(
                _label(scaling['by_data']['model']), r2),
            'met': r2 >= LINEAR_R2,
        })
    return targets


# ---------------------------------------------------------------- Markdown

def _range(summary, scale=1.0, digits=1):
    return '{:.{d}f} [{:.{d}f}-{:.{d}f}]'.format(
        scale * summary['median'], scale * summary['min'],
        scale * summary['max'], d=digits)


def _ratio(summary):
    return '{:.3f} [{:.3f}-{:.3f}]'.format(
        summary['median'], summary['min'], summary['max'])


def _table(header, rows):
    lines = ['| ' + ' | '.join(header) + ' |',
             '|' + '|'.join('---' for _ in header) + '|']
    lines += ['| ' + ' | '.join(str(cell) for cell in row) + ' |'
              for row in rows]
    return '\n'.join(lines)


def _sci(value):
    return '0' if value == 0 else '{:.1e}'.format(value)


def _md_overhead(overhead):
    out = ['## 1. Overhead: time per epoch', '',
           'Median [min-max] over interleaved rounds. Ratios are taken within '
           'each round, then summarized. CPU time is the process\'s own '
           '(`time.process_time`), which other processes on the machine '
           'disturb less than wall time; wall-time ratios are given too. '
           'Training only (`train_split=None`), shuffled, SGD with momentum.',
           '']
    for model, entry in overhead.items():
        cfg = entry['config']
        out += ['### {}: n={}, B={}, k={}, {} rounds'.format(
            _label(model), cfg['n'], cfg['B'], cfg['k'], entry['rounds']), '']
        rows = []
        for name, description in CONTENDERS.items():
            rows.append([
                '`{}`'.format(name), description,
                _range(entry['cpu_s'][name], 1e3),
                _ratio(entry['ratios']['cpu']['plain_B'][name]),
                _ratio(entry['ratios']['wall']['plain_B'][name]),
                _ratio(entry['ratios']['cpu']['hand'][name]),
            ])
        out += [_table(['contender', 'what', 'CPU ms/epoch',
                        'x plain B (CPU)', 'x plain B (wall)', 'x hand loop (CPU)'],
                       rows), '']
        gap = entry['gap']
        names = {
            'data_path': "skorch's data path (Dataset, collation)",
            'skorch_loop': "skorch's loop (notify, history, train_step, "
                           "GradAcc's split/concat)",
            'callbacks': 'default callbacks (EpochTimer, PrintLog, scoring)',
            'total': 'total: GradAcc - hand loop',
        }
        out += ['Where GradAcc\'s extra time over the hand-written loop goes '
                '(per-round CPU differences):', '',
                _table(['part', 'ms/epoch', 'us per micro-batch',
                        '% of hand loop'],
                       [[names[part], _range(values['seconds'], 1e3),
                         '{:.0f}'.format(values['us_per_micro_batch']),
                         '{:.0f}%'.format(100 * values['fraction_of_hand'])]
                        for part, values in gap.items()]), '']
    return out


def _md_profile(profile):
    out = ['## Profile: one GradAcc epoch ({}, B={}, k={}, n={})'.format(
        _label(profile['model']), profile['B'], profile['k'], profile['n']), '',
        'cProfile, top functions by self time; cProfile inflates '
        'Python-level costs, so read it for names, not sizes.', '']
    out += [_table(['function', 'calls', 'self ms', 'cumulative ms', 'self %'],
                   [['`{}`'.format(row['function']), row['calls'],
                     '{:.1f}'.format(1e3 * row['self_s']),
                     '{:.1f}'.format(1e3 * row['cumulative_s']),
                     '{:.1f}%'.format(100 * row['self_fraction'])]
                    for row in profile['top']]), '']
    return out


def _md_memory(memory):
    out = ['## 2. Memory', '',
           '### Activation memory as k grows', '',
           'Peak bytes of the tensors saved for backward '
           '(`track_activation_memory`) while training one group of B*k '
           'rows; deterministic. Plain B is the k=1 column.', '']
    rows = []
    for model, entry in memory['activation'].items():
        for i, k in enumerate(entry['ks']):
            rows.append([
                _label(model), entry['B'], k,
                '{:.1f}'.format(entry['gradacc'][i]['median'] / 2 ** 10),
                '{:.3f}'.format(entry['gradacc_vs_plain_B'][i]),
                '{:.1f}'.format(entry['plain_Bk'][i]['median'] / 2 ** 10),
                '{:.2f}'.format(entry['plain_Bk_vs_plain_B'][i]),
            ])
    out += [_table(['model', 'B', 'k', 'GradAcc KiB', 'x plain B',
                    'plain B*k KiB', 'x plain B'], rows), '']
    for malloc, title in (
            ('fixed', 'fixed mmap threshold (memory in use)'),
            ('default', "glibc's default allocator settings")):
        entries = memory['rss'].get(malloc)
        if not entries:
            continue
        out += ['### Peak RSS growth, {}'.format(title), '',
                'Peak RSS minus the RSS just before training, each '
                'configuration in a fresh process forked from a clean server, '
                'one group of B*k rows; MiB, median [min-max]; the ratio is '
                'of medians. The FAQ recipe accumulates over the same '
                'micro-batches as plain B. The last two columns (MiB) compare '
                'GradAcc\'s excess over plain B with the size of the inputs '
                'of one group of B*k rows, which GradAcc\'s batches hold.', '']
        rows = []
        for model, by_k in entries.items():
            for k, entry in by_k.items():
                row = [_label(model), entry['B'], k]
                for label in RSS_CONTENDERS:
                    row.append('{} ({:.2f}x)'.format(
                        _range(entry[label]['train_kib'], 1 / 2 ** 10),
                        entry['train_kib_vs_plain_B'][label]))
                row.append('{:.2f}x'.format(
                    entry['activation_bytes_vs_plain_B']['gradacc']))
                row.append('{:.2f}'.format(
                    entry['gradacc_minus_plain_B_kib'] / 2 ** 10))
                row.append('{:.2f}'.format(entry['group_input_kib'] / 2 ** 10))
                rows.append(row)
        out += [_table(['model', 'B', 'k', 'plain B', 'FAQ recipe', 'GradAcc',
                        'plain B*k', 'GradAcc activations x plain B',
                        'GradAcc - plain B', "a group's inputs"], rows), '']
    return out


def _md_exactness(exactness):
    out = ['## 3. Exactness', '',
           'Largest absolute parameter difference to plain skorch at B*k '
           'after training, float64, same initial weights and sample order. '
           'The data leave a short last micro-batch and a partial last group. '
           'k=1 controls: each recipe at acc_steps=1 against plain skorch at '
           'B. Loss ratio: the final epoch\'s reported train_loss over the '
           'large-batch net\'s (-: the loops keep no history).', '']
    rows = []
    for model, entry in exactness.items():
        cfg = entry['config']
        for kind, label in (('gradacc', 'GradAcc'), ('faq', 'FAQ recipe'),
                            ('accelerate', 'AccelerateMixin'),
                            ('naive', 'naive / k, last group flushed'),
                            ('hand', 'hand-written loop, loss / k'),
                            ('accumgrad', 'AccumGrad in the same loop')):
            ratio = entry[kind]['train_loss_ratio']
            rows.append([
                _label(model),
                'n={n}, B={B}, k={k}, {epochs} epochs'.format(**cfg), label,
                _sci(entry[kind]['max_param_diff']),
                '-' if ratio is None else '{:.3f}'.format(ratio),
                _sci(entry[kind]['control_k1_max_param_diff']),
            ])
    out += [_table(['model', 'setting', 'recipe', 'max abs param diff',
                    'loss ratio', 'k=1 control'], rows), '']
    return out


def _md_scaling(scaling):
    out = ['## 4. Scaling', '',
           '### As k grows, at a fixed micro-batch', '',
           'Every k sees the same micro-batches per epoch, so the epoch should '
           'cost the same and one optimizer step (k micro-batches) k times '
           'more. CPU ms, median [min-max].', '']
    rows = []
    for model, entry in scaling['by_k'].items():
        for i, k in enumerate(entry['ks']):
            rows.append([
                _label(model), entry['config']['B'], k,
                _range(entry['gradacc']['epoch_cpu_s'][i], 1e3),
                '{:.2f}'.format(1e3 * entry['gradacc']['step_cpu_s'][i]),
            ])
    out += [_table(['model', 'B', 'k', 'GradAcc epoch', 'GradAcc per step'],
                   rows), '']
    out += [_table(['model', 'step cost slope (ms per micro-batch)',
                    'intercept ms', 'R^2', 'epoch time max/min over k'],
                   [[_label(model),
                     '{:.3f}'.format(1e3 * entry['gradacc']['step_fit']['slope']),
                     '{:.3f}'.format(1e3 * entry['gradacc']['step_fit']['intercept']),
                     '{:.4f}'.format(entry['gradacc']['step_fit']['r2']),
                     '{:.2f}'.format(entry['gradacc']['epoch_spread'])]
                    for model, entry in scaling['by_k'].items()]), '']
    data = scaling['by_data']
    out += ['### As the data grow ({}, B={}, k={})'.format(
        _label(data['model']), data['B'], data['k']), '']
    out += [_table(['n', 'GradAcc epoch ms', 'plain B epoch ms'],
                   [[n, _range(data['gradacc']['epoch_cpu_s'][i], 1e3),
                     _range(data['plain_B']['epoch_cpu_s'][i], 1e3)]
                    for i, n in enumerate(data['ns'])]), '']
    out += ['Linear fit of the medians: GradAcc {:.3f} ms per 1000 samples '
            '(R^2={:.4f}); plain B {:.3f} ms per 1000 samples '
            '(R^2={:.4f}).'.format(
                1e6 * data['gradacc']['fit']['slope'],
                data['gradacc']['fit']['r2'],
                1e6 * data['plain_B']['fit']['slope'],
                data['plain_B']['fit']['r2']), '']
    return out


def markdown(results):
    """The results as a Markdown document."""
    meta = results['meta']
    versions = ', '.join('{} {}'.format(name, version)
                         for name, version in meta['versions'].items())
    out = ['# skorch-gradacc benchmarks', '']
    if results.get('quick'):
        out += ['**Quick smoke run: tiny sizes, the numbers mean nothing.**', '']
    out += [
        '- command: `{}`'.format(meta['command'].strip()),
        '- date: {}, commit {}'.format(meta['date'], meta['git_commit']),
        '- machine: {}, {} cores, torch threads: {}; {}'.format(
            meta['cpu'], meta['cpu_count'], meta['torch_threads'],
            meta['platform']),
        '- load average (1, 5, 15 min) at start: {}, at end: {}'.format(
            ', '.join('{:.1f}'.format(x) for x in meta['load_average_start']),
            ', '.join('{:.1f}'.format(x) for x in meta['load_average_end'])),
        '- versions: Python {}, {}'.format(meta['python'], versions),
        '- skorch_gradacc imported from `{}`; modified since the commit: '
        '{}'.format(meta['skorch_gradacc']['path'],
                    {True: '**yes**', False: 'no', None: 'unknown'}[
                        meta['skorch_gradacc']['modified']]),
        '- section run times: {}'.format(', '.join(
            '{} {:.0f} s'.format(name, seconds)
            for name, seconds in results['seconds'].items())),
        '',
        '## Targets', '',
        _table(['target', 'measured', 'met'],
               [[target['target'], target['measured'],
                 'yes' if target['met'] else '**no**']
                for target in results['targets']]),
        '',
    ]
    for section, render in (('overhead', _md_overhead),
                            ('profile', _md_profile),
                            ('memory', _md_memory),
                            ('exactness', _md_exactness),
                            ('scaling', _md_scaling)):
        if results.get(section):
            out += render(results[section])
    return '\n'.join(out)


# -------------------------------------------------------------------- plot

PLOT_CONTENDERS = ('gradacc', 'gradacc_k1', 'plain_B_again', 'faq',
                   'accelerate', 'plain_Bk', 'hand', 'accumgrad')
PLOT_NAMES = {'gradacc': 'GradAcc (B, k)', 'gradacc_k1': 'GradAcc (B, 1)',
              'plain_B_again': 'plain B (A/A)', 'faq': 'FAQ recipe',
              'accelerate': 'Accelerate', 'plain_Bk': 'plain B*k',
              'hand': 'hand loop', 'accumgrad': 'AccumGrad loop'}


def _plot_overhead(ax, overhead):
    import numpy as np

    models = list(overhead)
    width = 0.8 / len(models)
    y = np.arange(len(PLOT_CONTENDERS))
    for i, model in enumerate(models):
        ratios = overhead[model]['ratios']['cpu']['plain_B']
        med = np.array([ratios[name]['median'] for name in PLOT_CONTENDERS])
        low = med - [ratios[name]['min'] for name in PLOT_CONTENDERS]
        high = np.array([ratios[name]['max'] for name in PLOT_CONTENDERS]) - med
        ax.barh(y + i * width, med, width, xerr=[low, high], capsize=2,
                label=_label(model))
    ax.axvline(1.0, color='k', lw=0.8)
    ax.axvline(OVERHEAD_TARGET, color='r', ls='--', lw=0.8,
               label='target {:.2f}'.format(OVERHEAD_TARGET))
    ax.set_yticks(y + width * (len(models) - 1) / 2)
    ax.set_yticklabels([PLOT_NAMES[name] for name in PLOT_CONTENDERS])
    ax.invert_yaxis()
    ax.set_xlabel('time per epoch / plain skorch at B (CPU, median, min-max)')
    ax.set_title('Overhead')
    ax.legend(fontsize=8)


def _plot_gap(ax, overhead):
    import numpy as np

    parts = [('data_path', "skorch's data path"),
             ('skorch_loop', "skorch's loop"),
             ('callbacks', 'default callbacks'),
             ('total', 'total')]
    models = list(overhead)
    x = np.arange(len(models))
    width = 0.8 / len(parts)
    for i, (part, name) in enumerate(parts):
        values = [100 * overhead[model]['gap'][part]['fraction_of_hand']
                  for model in models]
        ax.bar(x + i * width, values, width, label=name,
               color='k' if part == 'total' else None)
    ax.axhline(0, color='k', lw=0.8)
    ax.set_xticks(x + width * (len(parts) - 1) / 2)
    ax.set_xticklabels([_label(model) for model in models])
    ax.set_ylabel("extra CPU time, % of the hand-written loop's epoch")
    ax.set_title('GradAcc vs hand-written loop: the gap')
    ax.legend(fontsize=8)


def _plot_activation(ax, memory):
    for model, entry in memory['activation'].items():
        line, = ax.plot(entry['ks'], entry['plain_Bk_vs_plain_B'], 'o--',
                        label='plain B*k, ' + _label(model))
        ax.plot(entry['ks'], entry['gradacc_vs_plain_B'], 's-',
                color=line.get_color(), label='GradAcc, ' + _label(model))
    ax.axhline(MEMORY_TARGET, color='r', ls='--', lw=0.8, label='target 1.10')
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    ax.set_xlabel('k (micro-batches per step)')
    ax.set_ylabel('peak activation memory / plain B')
    ax.set_title('Activation memory as k grows')
    ax.legend(fontsize=7, ncol=2)


def _plot_rss(ax, memory):
    import numpy as np

    malloc = 'fixed' if memory['rss'].get('fixed') else 'default'
    entries = memory['rss'].get(malloc, {})
    if not entries:
        ax.axis('off')
        ax.text(0.5, 0.5, 'peak RSS not measured (Linux only)', ha='center')
        return
    labels, groups = [], []
    for model, by_k in entries.items():
        for k, entry in by_k.items():
            labels.append('{}\nk={}'.format(_label(model), k))
            groups.append(entry)
    x = np.arange(len(groups))
    width = 0.8 / len(RSS_CONTENDERS)
    names = {'plain_B': 'plain B', 'faq': 'FAQ recipe', 'gradacc': 'GradAcc',
             'plain_Bk': 'plain B*k'}
    for i, label in enumerate(RSS_CONTENDERS):
        ax.bar(x + i * width,
               [entry['train_kib_vs_plain_B'][label] for entry in groups],
               width, label=names[label])
    ax.axhline(MEMORY_TARGET, color='r', ls='--', lw=0.8, label='target 1.10')
    ax.set_xticks(x + width * (len(RSS_CONTENDERS) - 1) / 2)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_yscale('log')
    ax.set_ylabel('peak RSS growth / plain B')
    ax.set_title('Peak RSS, fresh process per run ({})'.format(
        'fixed mmap threshold' if malloc == 'fixed' else 'glibc defaults'))
    ax.legend(fontsize=8)


def _plot_exactness(ax, exactness):
    import numpy as np

    kinds = [('gradacc', 'GradAcc'), ('faq', 'FAQ recipe'),
             ('accelerate', 'Accelerate'), ('naive', 'naive / k'),
             ('hand', 'hand loop / k'), ('accumgrad', 'AccumGrad loop')]
    models = list(exactness)
    x = np.arange(len(models))
    width = 0.8 / len(kinds)
    floor = 1e-18
    for i, (kind, name) in enumerate(kinds):
        values = [max(exactness[model][kind]['max_param_diff'], floor)
                  for model in models]
        ax.bar(x + i * width, values, width, label=name)
    ax.axhline(EXACT_TARGET, color='r', ls='--', lw=0.8, label='1e-10')
    ax.set_yscale('log')
    ax.set_ylim(floor / 10, 1)
    ax.set_xticks(x + width * (len(kinds) - 1) / 2)
    ax.set_xticklabels([_label(model) for model in models])
    ax.set_ylabel('max |param - large-batch param| (0 shown at 1e-18)')
    ax.set_title('Exactness, float64')
    ax.legend(fontsize=8, loc='lower right', framealpha=0.9)


def _plot_scaling_k(ax, scaling):
    for model, entry in scaling['by_k'].items():
        ks = entry['ks']
        step = [value / entry['gradacc']['step_cpu_s'][0]
                for value in entry['gradacc']['step_cpu_s']]
        ax.plot(ks, step, 'o-', label='GradAcc, ' + _label(model))
    ks = next(iter(scaling['by_k'].values()))['ks']
    ax.plot(ks, ks, 'k--', lw=0.8, label='linear')
    ax.set_xscale('log', base=2)
    ax.set_yscale('log', base=2)
    ax.set_xlabel('k (micro-batches per step)')
    ax.set_ylabel('CPU time per optimizer step / k=1')
    ax.set_title('Cost per optimizer step as k grows')
    ax.legend(fontsize=8)


def _plot_scaling_data(ax, scaling):
    import numpy as np

    data = scaling['by_data']
    ns = np.array(data['ns'])
    for kind, name in (('gradacc', 'GradAcc (B, k)'), ('plain_B', 'plain B')):
        medians = [1e3 * epoch['median'] for epoch in data[kind]['epoch_cpu_s']]
        low = [m - 1e3 * epoch['min']
               for m, epoch in zip(medians, data[kind]['epoch_cpu_s'])]
        high = [1e3 * epoch['max'] - m
                for m, epoch in zip(medians, data[kind]['epoch_cpu_s'])]
        line = ax.errorbar(ns, medians, yerr=[low, high], fmt='o', capsize=2,
                           label=name)
        fit = data[kind]['fit']
        ax.plot(ns, 1e3 * (fit['slope'] * ns + fit['intercept']), '-',
                color=line[0].get_color(), lw=0.8)
    ax.set_xlabel('samples per epoch ({})'.format(_label(data['model'])))
    ax.set_ylabel('CPU ms per epoch')
    ax.set_title('Cost as the data grow (lines: linear fits)')
    ax.legend(fontsize=8)


def _plot_targets(ax, results):
    ax.axis('off')
    lines = ['Targets']
    for target in results['targets']:
        lines.append('{} {}'.format('met ' if target['met'] else 'MISS',
                                    target['id']))
    meta = results['meta']
    lines += ['', meta['cpu'], '{} cores, torch threads {}'.format(
        meta['cpu_count'], meta['torch_threads']), meta['date']]
    if results.get('quick'):
        lines.insert(0, 'QUICK SMOKE RUN')
    ax.text(0.02, 0.98, '\n'.join(lines), va='top', family='monospace',
            fontsize=9, transform=ax.transAxes)


def plot(results, path):
    """Save the plots of all sections present in ``results`` as a PNG."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    panels = []
    if results.get('overhead'):
        panels += [(_plot_overhead, results['overhead']),
                   (_plot_gap, results['overhead'])]
    if results.get('memory'):
        panels += [(_plot_activation, results['memory']),
                   (_plot_rss, results['memory'])]
    if results.get('exactness'):
        panels.append((_plot_exactness, results['exactness']))
    if results.get('scaling'):
        panels += [(_plot_scaling_k, results['scaling']),
                   (_plot_scaling_data, results['scaling'])]
    panels.append((_plot_targets, results))
    cols = 4
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 5 * rows),
                             squeeze=False)
    for ax, (draw, data) in zip(axes.flat, panels):
        draw(ax, data)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis('off')
    title = 'skorch-gradacc benchmarks'
    if results.get('quick'):
        title += ' (quick smoke run: tiny sizes, numbers mean nothing)'
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
