"""Turn the results of ``benchmarks.run`` into targets, Markdown and a PNG."""

import math

import numpy as np

from benchmarks.harness import markdown_table
from benchmarks.suite import CONTENDERS, RSS_CONTENDERS

OVERHEAD_TARGET, MEMORY_TARGET, EXACT_TARGET, LINEAR_R2 = 1.03, 1.10, 1e-10, 0.99
LABELS = {'mlp': 'MLP', 'cnn': 'CNN', 'transformer': 'Transformer'}
RECIPES = {'gradacc': 'GradAcc', 'faq': 'FAQ recipe', 'accelerate': 'AccelerateMixin',
           'naive': 'naive / k, last group flushed',
           'hand': 'hand-written loop, loss / k',
           'accumgrad': 'AccumGrad in the same loop'}
MALLOCS = {'fixed': 'fixed mmap threshold', 'default': 'glibc defaults'}


def _listed(items, fmt):
    return ', '.join(fmt.format(*item) for item in items)


def evaluate_targets(results):
    """The targets, the measured values (text), and whether each is met."""
    targets = []

    def target(id_, text, measured, met):
        targets.append({'id': id_, 'target': text, 'measured': measured,
                        'met': bool(met)})

    overhead, exactness = results.get('overhead'), results.get('exactness')
    memory, scaling = results.get('memory'), results.get('scaling')
    if overhead:
        by_plain = {LABELS[m]: e['ratios']['cpu']['plain_B']
                    for m, e in overhead.items()}
        ratios = [(m, r['gradacc']['median']) for m, r in by_plain.items()]
        target('overhead', 'GradAcc (B, k) <= {:.2f}x plain skorch at B, per epoch '
               '(median CPU time)'.format(OVERHEAD_TARGET),
               _listed(ratios, '{} {:.3f}x'),
               max(r for _, r in ratios) <= OVERHEAD_TARGET)
        noise = [(m, r['gradacc_k1']['median'], r['plain_B_again']['min'],
                  r['plain_B_again']['max']) for m, r in by_plain.items()]
        measured = '; '.join('{} {:.3f}x (A/A noise {:.3f}-{:.3f})'.format(*n)
                             for n in noise)
        met = all(low <= ratio <= high for _, ratio, low, high in noise)
        if exactness:
            worst = max(e['gradacc']['control_k1_max_param_diff']
                        for e in exactness.values())
            met = met and worst == 0.0
            measured += '; parameters bit for bit equal: {}'.format(
                'yes' if worst == 0.0 else 'no ({:.1e})'.format(worst))
        target('acc_steps_1', 'acc_steps=1 indistinguishable from plain skorch: its '
               "median time ratio within the A/A control's range", measured, met)
    if memory:
        worst = max((ratio, LABELS[m], k) for m, e in memory['activation'].items()
                    for k, ratio in zip(e['ks'], e['gradacc_vs_plain_B']))
        target('memory_activation', 'GradAcc activation memory within {:.0f}% of '
               'plain B, any k'.format(100 * (MEMORY_TARGET - 1)),
               'worst {:.3f}x ({}, k={})'.format(*worst), worst[0] <= MEMORY_TARGET)
        for malloc, entries in memory['rss'].items():
            cases = [(LABELS[m], k, e['train_kib_vs_plain_B']['gradacc'])
                     for m, by_k in entries.items() for k, e in by_k.items()]
            target('memory_rss_' + malloc, 'GradAcc peak RSS growth within {:.0f}% of '
                   'plain B ({})'.format(100 * (MEMORY_TARGET - 1), MALLOCS[malloc]),
                   _listed(cases, '{} k={} {:.2f}x'),
                   max(c[2] for c in cases) <= MEMORY_TARGET)
    if exactness:
        diffs = [(LABELS[m], e['gradacc']['max_param_diff'])
                 for m, e in exactness.items()]
        target('exactness', 'GradAcc parameters within {:.0e} of the large-batch net '
               '(float64)'.format(EXACT_TARGET), _listed(diffs, '{} {:.1e}'),
               max(d for _, d in diffs) < EXACT_TARGET)
    if scaling:
        fits = [(LABELS[m], e['gradacc']['step_fit']['r2'])
                for m, e in scaling['by_k'].items()]
        target('scaling_k', 'cost per optimizer step linear in k (R^2 >= {})'.format(
            LINEAR_R2), _listed(fits, '{} R^2={:.4f}'),
            min(r2 for _, r2 in fits) >= LINEAR_R2)
        fit = [(LABELS[scaling['by_data']['model']],
                scaling['by_data']['gradacc']['fit']['r2'])]
        target('scaling_data', 'epoch time linear in the number of samples (R^2 >= '
               '{})'.format(LINEAR_R2), _listed(fit, '{} R^2={:.4f}'),
               fit[0][1] >= LINEAR_R2)
    return targets


def _range(summary, scale=1.0, digits=1):
    return '{:.{d}f} [{:.{d}f}-{:.{d}f}]'.format(
        scale * summary['median'], scale * summary['min'], scale * summary['max'],
        d=digits)


def _sci(value):
    return '0' if value == 0 else '{:.1e}'.format(value)


GAP_PARTS = {'data_path': "skorch's data path (Dataset, collation)",
             'skorch_loop': "skorch's loop (notify, history, train_step, GradAcc's "
                            'split/concat)',
             'callbacks': 'default callbacks (EpochTimer, PrintLog, scoring)',
             'total': 'total: GradAcc - hand loop'}


def _md_overhead(overhead):
    out = ['## 1. Overhead: time per epoch', '',
           'Median [min-max] over interleaved rounds. Ratios are taken within each '
           "round, then summarized. CPU time is the process's own "
           '(`time.process_time`), which other processes on the machine disturb '
           'less than wall time; wall-time ratios are given too. Training only '
           '(`train_split=None`), shuffled, SGD with momentum.', '']
    for model, entry in overhead.items():
        cpu, wall = entry['ratios']['cpu'], entry['ratios']['wall']
        out += ['### {}: n={n}, B={B}, k={k}, {} rounds'.format(
            LABELS[model], entry['rounds'], **entry['config']), '', markdown_table(
            ['contender', 'what', 'CPU ms/epoch', 'x plain B (CPU)',
             'x plain B (wall)', 'x hand loop (CPU)'],
            [['`{}`'.format(name), what, _range(entry['cpu_s'][name], 1e3)]
             + [_range(ratios[name], digits=3) for ratios in (
                 cpu['plain_B'], wall['plain_B'], cpu['hand'])]
             for name, what in CONTENDERS.items()]),
            "Where GradAcc's extra time over the hand-written loop goes (per-round "
            'CPU differences):', '', markdown_table(
                ['part', 'ms/epoch', 'us per micro-batch', '% of hand loop'],
                [[GAP_PARTS[part], _range(values['seconds'], 1e3),
                  '{:.0f}'.format(values['us_per_micro_batch']),
                  '{:.0f}%'.format(100 * values['fraction_of_hand'])]
                 for part, values in entry['gap'].items()])]
    return out


def _md_profile(profile):
    return ['## Profile: one GradAcc epoch ({}, B={B}, k={k}, n={n})'.format(
        LABELS[profile['model']], **profile), '',
        'cProfile, top functions by self time; cProfile inflates Python-level '
        'costs, so read it for names, not sizes.', '', markdown_table(
            ['function', 'calls', 'self ms', 'cumulative ms', 'self %'],
            [['`{}`'.format(row['function']), row['calls'],
              '{:.1f}'.format(1e3 * row['self_s']),
              '{:.1f}'.format(1e3 * row['cumulative_s']),
              '{:.1f}%'.format(100 * row['self_fraction'])] for row in profile['top']])]


def _md_memory(memory):
    out = ['## 2. Memory', '', '### Activation memory as k grows', '',
           'Peak bytes of the tensors saved for backward (`track_activation_memory`) '
           'while training one group of B*k rows; deterministic. Plain B is the k=1 '
           'column.', '', markdown_table(
               ['model', 'B', 'k', 'GradAcc KiB', 'x plain B', 'plain B*k KiB',
                'x plain B'],
               [[LABELS[model], entry['B'], k,
                 '{:.1f}'.format(entry['gradacc'][i]['median'] / 2 ** 10),
                 '{:.3f}'.format(entry['gradacc_vs_plain_B'][i]),
                 '{:.1f}'.format(entry['plain_Bk'][i]['median'] / 2 ** 10),
                 '{:.2f}'.format(entry['plain_Bk_vs_plain_B'][i])]
                for model, entry in memory['activation'].items()
                for i, k in enumerate(entry['ks'])])]
    for malloc, entries in memory['rss'].items():
        out += ['### Peak RSS growth, {}'.format(MALLOCS[malloc]), '',
                'Peak RSS minus the RSS just before training, each configuration in '
                'a fresh process forked from a clean server, one group of B*k rows; '
                'MiB, median [min-max]; the ratio is of medians. The FAQ recipe '
                'accumulates over the same micro-batches as plain B. The last two '
                "columns (MiB) compare GradAcc's excess over plain B with the size "
                "of the inputs of one group of B*k rows, which GradAcc's batches "
                'hold.', '', markdown_table(
                    ['model', 'B', 'k', 'plain B', 'FAQ recipe', 'GradAcc',
                     'plain B*k', 'GradAcc activations x plain B',
                     'GradAcc - plain B', "a group's inputs"],
                    [[LABELS[model], entry['B'], k] + ['{} ({:.2f}x)'.format(
                        _range(entry[label]['train_kib'], 1 / 2 ** 10),
                        entry['train_kib_vs_plain_B'][label])
                        for label in RSS_CONTENDERS] + [
                        '{:.2f}x'.format(entry['activation_bytes_vs_plain_B']['gradacc']),
                        '{:.2f}'.format(entry['gradacc_minus_plain_B_kib'] / 2 ** 10),
                        '{:.2f}'.format(entry['group_input_kib'] / 2 ** 10)]
                     for model, by_k in entries.items() for k, entry in by_k.items()])]
    return out


def _md_exactness(exactness):
    return ['## 3. Exactness', '',
            'Largest absolute parameter difference to plain skorch at B*k after '
            'training, float64, same initial weights and sample order. The data '
            'leave a short last micro-batch and a partial last group. k=1 controls: '
            'each recipe at acc_steps=1 against plain skorch at B. Loss ratio: the '
            "final epoch's reported train_loss over the large-batch net's (-: the "
            'loops keep no history).', '', markdown_table(
                ['model', 'setting', 'recipe', 'max abs param diff', 'loss ratio',
                 'k=1 control'],
                [[LABELS[model], 'n={n}, B={B}, k={k}, {epochs} epochs'.format(
                    **entry['config']), label, _sci(entry[kind]['max_param_diff']),
                  '-' if entry[kind]['train_loss_ratio'] is None else
                  '{:.3f}'.format(entry[kind]['train_loss_ratio']),
                  _sci(entry[kind]['control_k1_max_param_diff'])]
                 for model, entry in exactness.items()
                 for kind, label in RECIPES.items()])]


def _md_scaling(scaling):
    data, by_k = scaling['by_data'], scaling['by_k']
    fit = {kind: data[kind]['fit'] for kind in ('gradacc', 'plain_B')}
    return [
        '## 4. Scaling', '', '### As k grows, at a fixed micro-batch', '',
        'Every k sees the same micro-batches per epoch, so the epoch should cost the '
        'same and one optimizer step (k micro-batches) k times more. CPU ms, median '
        '[min-max].', '',
        markdown_table(['model', 'B', 'k', 'GradAcc epoch', 'GradAcc per step'],
                       [[LABELS[model], entry['config']['B'], k,
                         _range(entry['gradacc']['epoch_cpu_s'][i], 1e3),
                         '{:.2f}'.format(1e3 * entry['gradacc']['step_cpu_s'][i])]
                        for model, entry in by_k.items()
                        for i, k in enumerate(entry['ks'])]),
        markdown_table(['model', 'step cost slope (ms per micro-batch)',
                        'intercept ms', 'R^2', 'epoch time max/min over k'],
                       [[LABELS[model], '{:.3f}'.format(1e3 * e['step_fit']['slope']),
                         '{:.3f}'.format(1e3 * e['step_fit']['intercept']),
                         '{:.4f}'.format(e['step_fit']['r2']),
                         '{:.2f}'.format(e['epoch_spread'])]
                        for model, e in ((m, v['gradacc']) for m, v in by_k.items())]),
        '### As the data grow ({}, B={}, k={})'.format(
            LABELS[data['model']], data['B'], data['k']), '',
        markdown_table(['n', 'GradAcc epoch ms', 'plain B epoch ms'],
                       [[n] + [_range(data[kind]['epoch_cpu_s'][i], 1e3)
                               for kind in ('gradacc', 'plain_B')]
                        for i, n in enumerate(data['ns'])]),
        'Linear fit of the medians: GradAcc {:.3f} ms per 1000 samples (R^2={:.4f}); '
        'plain B {:.3f} ms per 1000 samples (R^2={:.4f}).'.format(
            1e6 * fit['gradacc']['slope'], fit['gradacc']['r2'],
            1e6 * fit['plain_B']['slope'], fit['plain_B']['r2']), '']


def markdown(results):
    """The results as a Markdown document."""
    meta = results['meta']
    out = ['# skorch-gradacc benchmarks', '']
    if results.get('quick'):
        out += ['**Quick smoke run: tiny sizes, the numbers mean nothing.**', '']
    out += [
        '- command: `{}`'.format(meta['command'].strip()),
        '- date: {}, commit {}'.format(meta['date'], meta['git_commit']),
        '- machine: {}, {} cores, torch threads: {}; {}'.format(
            meta['cpu'], meta['cpu_count'], meta['torch_threads'], meta['platform']),
        '- load average (1, 5, 15 min) at start: {}, at end: {}'.format(*(
            ', '.join('{:.1f}'.format(x) for x in meta[key])
            for key in ('load_average_start', 'load_average_end'))),
        '- versions: Python {}, {}'.format(meta['python'], ', '.join(
            '{} {}'.format(*item) for item in meta['versions'].items())),
        '- skorch_gradacc imported from `{}`; modified since the commit: {}'.format(
            meta['skorch_gradacc']['path'], {True: '**yes**', False: 'no',
                                             None: 'unknown'}[
                meta['skorch_gradacc']['modified']]),
        '- section run times: {}'.format(', '.join(
            '{} {:.0f} s'.format(*item) for item in results['seconds'].items())),
        '', '## Targets', '', markdown_table(
            ['target', 'measured', 'met'],
            [[t['target'], t['measured'], 'yes' if t['met'] else '**no**']
             for t in results['targets']])]
    for section, render in (('overhead', _md_overhead), ('profile', _md_profile),
                            ('memory', _md_memory), ('exactness', _md_exactness),
                            ('scaling', _md_scaling)):
        if results.get(section):
            out += render(results[section])
    return '\n'.join(out)


PLOT_CONTENDERS = {'gradacc': 'GradAcc (B, k)', 'gradacc_k1': 'GradAcc (B, 1)',
                   'plain_B_again': 'plain B (A/A)', 'faq': 'FAQ recipe',
                   'accelerate': 'Accelerate', 'plain_Bk': 'plain B*k',
                   'hand': 'hand loop', 'accumgrad': 'AccumGrad loop'}


def _bars(ax, groups, series, value, horizontal=False, spread=None):
    """Grouped bars: for each of ``series`` (key: label), one bar per group (key:
    label) of height ``value(group, series)``; ``spread(group, series)`` gives
    its (min, max) error bar."""
    x, width = np.arange(len(groups)), 0.8 / len(series)
    for i, (key, label) in enumerate(series.items()):
        heights = np.array([value(group, key) for group in groups])
        spreads = spread and np.array([spread(group, key) for group in groups]).T
        err = spread and [heights - spreads[0], spreads[1] - heights]
        (ax.barh if horizontal else ax.bar)(
            x + i * width, heights, width, label=label,
            **{'xerr' if horizontal else 'yerr': err, 'capsize': 2})
    ticks = ax.set_yticks if horizontal else ax.set_xticks
    ticks(x + width * (len(series) - 1) / 2, list(groups.values()), fontsize=8)
    ax.legend(fontsize=8)


def _plot_overhead(ax, overhead):
    def ratio(c, m):
        return overhead[m]['ratios']['cpu']['plain_B'][c]

    _bars(ax, PLOT_CONTENDERS, {m: LABELS[m] for m in overhead},
          lambda c, m: ratio(c, m)['median'], horizontal=True,
          spread=lambda c, m: (ratio(c, m)['min'], ratio(c, m)['max']))
    ax.axvline(1.0, color='k', lw=0.8)
    ax.axvline(OVERHEAD_TARGET, color='r', ls='--', lw=0.8)
    ax.invert_yaxis()
    ax.set(xlabel='time per epoch / plain skorch at B (CPU, median, min-max)',
           title='Overhead (red: target {:.2f})'.format(OVERHEAD_TARGET))


def _plot_gap(ax, overhead):
    parts = {'data_path': "skorch's data path", 'skorch_loop': "skorch's loop",
             'callbacks': 'default callbacks', 'total': 'total'}
    _bars(ax, {m: LABELS[m] for m in overhead}, parts,
          lambda m, p: 100 * overhead[m]['gap'][p]['fraction_of_hand'])
    ax.axhline(0, color='k', lw=0.8)
    ax.set(ylabel="extra CPU time, % of the hand-written loop's epoch",
           title='GradAcc vs hand-written loop: the gap')


def _plot_activation(ax, memory):
    for model, entry in memory['activation'].items():
        line, = ax.plot(entry['ks'], entry['plain_Bk_vs_plain_B'], 'o--',
                        label='plain B*k, ' + LABELS[model])
        ax.plot(entry['ks'], entry['gradacc_vs_plain_B'], 's-',
                color=line.get_color(), label='GradAcc, ' + LABELS[model])
    ax.axhline(MEMORY_TARGET, color='r', ls='--', lw=0.8, label='target 1.10')
    ax.set_xscale('log', base=2)
    ax.set(yscale='log', xlabel='k (micro-batches per step)',
           ylabel='peak activation memory / plain B',
           title='Activation memory as k grows')
    ax.legend(fontsize=7, ncol=2)


def _plot_rss(ax, memory):
    malloc = next(iter(memory['rss']))
    entries = {(m, k): e for m, by_k in memory['rss'][malloc].items()
               for k, e in by_k.items()}
    _bars(ax, {key: '{}\nk={}'.format(LABELS[key[0]], key[1]) for key in entries},
          dict(zip(RSS_CONTENDERS, ('plain B', 'FAQ recipe', 'GradAcc', 'plain B*k'))),
          lambda key, label: entries[key]['train_kib_vs_plain_B'][label])
    ax.axhline(MEMORY_TARGET, color='r', ls='--', lw=0.8)
    ax.set(yscale='log', ylabel='peak RSS growth / plain B (red: target 1.10)',
           title='Peak RSS, fresh process per run ({})'.format(MALLOCS[malloc]))


def _plot_exactness(ax, exactness):
    floor = 1e-18
    kinds = dict(RECIPES, naive='naive / k', hand='hand loop / k',
                 accumgrad='AccumGrad loop')
    _bars(ax, {m: LABELS[m] for m in exactness}, kinds,
          lambda m, kind: max(exactness[m][kind]['max_param_diff'], floor))
    ax.axhline(EXACT_TARGET, color='r', ls='--', lw=0.8)
    ax.set(yscale='log', ylim=(floor / 10, 1), title='Exactness, float64',
           ylabel='max |param - large-batch param| (0 shown at 1e-18)')


def _plot_scaling_k(ax, scaling):
    for model, entry in scaling['by_k'].items():
        step = entry['gradacc']['step_cpu_s']
        ax.plot(entry['ks'], [value / step[0] for value in step], 'o-',
                label='GradAcc, ' + LABELS[model])
    ax.plot(entry['ks'], entry['ks'], 'k--', lw=0.8, label='linear')
    ax.set_xscale('log', base=2)
    ax.set_yscale('log', base=2)
    ax.set(xlabel='k (micro-batches per step)', ylabel='CPU time per optimizer step / '
           'k=1', title='Cost per optimizer step as k grows')
    ax.legend(fontsize=8)


def _plot_scaling_data(ax, scaling):
    ns = np.array((data := scaling['by_data'])['ns'])
    for kind, name in (('gradacc', 'GradAcc (B, k)'), ('plain_B', 'plain B')):
        median, low, high = np.array([[e['median'], e['min'], e['max']]
                                      for e in data[kind]['epoch_cpu_s']]).T * 1e3
        line = ax.errorbar(ns, median, yerr=[median - low, high - median], fmt='o',
                           capsize=2, label=name)
        fit = data[kind]['fit']
        ax.plot(ns, 1e3 * (fit['slope'] * ns + fit['intercept']), '-',
                color=line[0].get_color(), lw=0.8)
    ax.set(xlabel='samples per epoch ({})'.format(LABELS[data['model']]),
           ylabel='CPU ms per epoch',
           title='Cost as the data grow (lines: linear fits)')
    ax.legend(fontsize=8)


def _plot_targets(ax, results):
    meta = results['meta']
    lines = (['QUICK SMOKE RUN'] if results.get('quick') else []) + ['Targets'] + [
        '{} {}'.format('met ' if t['met'] else 'MISS', t['id'])
        for t in results['targets']] + [
        '', meta['cpu'], '{} cores, torch threads {}'.format(
            meta['cpu_count'], meta['torch_threads']), meta['date'],
        'commit {}'.format(meta['git_commit'])]
    ax.axis('off')
    ax.text(0.02, 0.98, '\n'.join(lines), va='top', family='monospace', fontsize=9,
            transform=ax.transAxes)


def plot(results, path):
    """Save the plots of all sections present in ``results`` as a PNG."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    panels = [(draw, results[section]) for section, draw in (
        ('overhead', _plot_overhead), ('overhead', _plot_gap),
        ('memory', _plot_activation), ('memory', _plot_rss),
        ('exactness', _plot_exactness), ('scaling', _plot_scaling_k),
        ('scaling', _plot_scaling_data)) if results.get(section)]
    panels.append((_plot_targets, results))
    rows = math.ceil(len(panels) / 4)
    fig, axes = plt.subplots(rows, 4, figsize=(24, 5 * rows), squeeze=False)
    for ax, (draw, data) in zip(axes.flat, panels):
        draw(ax, data)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis('off')
    fig.suptitle('skorch-gradacc benchmarks' + (
        ' (quick smoke run: tiny sizes, numbers mean nothing)'
        if results.get('quick') else ''))
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
