"""Smoke test of the benchmark suite (``python -m benchmarks.run``).

Runs the whole suite once at its ``--quick`` sizes, in a process of its own
in the background from the collection's end (conftest.py), and checks that
the JSON, the Markdown and the PNG are written and well-formed, and that the
numbers are right in kind: GradAcc matches the large-batch net, the FAQ recipe and
Accelerate do not. Speed is never asserted: it depends on the machine.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import background, background_folder, background_result

# the suite compares against AccelerateMixin and draws its plots
pytest.importorskip('accelerate')
pytest.importorskip('matplotlib')

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import run  # noqa: E402
from benchmarks.harness import _git  # noqa: E402
from benchmarks.suite import CONTENDERS, RSS_CONTENDERS  # noqa: E402
from skorch_gradacc.batching import planned_above  # noqa: E402

MODELS = ('mlp', 'cnn', 'transformer')


def python_m(module, *args):
    """``python -m module ARGS`` in a fresh interpreter, here, as documented;
    the checkout first on its path. The timeout guards against a hang, on a
    busy machine: ``memory_plan --quick`` takes 30 s alone, 60 s beside the
    quick suite, and passed 600 s in one of two full suites run at once."""
    return subprocess.run(
        [sys.executable, '-m', module, *args], cwd=ROOT, capture_output=True,
        text=True, timeout=1200, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get('PYTHONPATH')]))))


def run_quick_suite():
    """``python -m benchmarks.run --quick``, in the background from the
    collection's end (conftest.py): its process and output folder."""
    folder = background_folder('benchmarks')
    return python_m('benchmarks.run', '--quick', '--out', str(folder)), folder


def run_memory_plan_quick():
    """``python -m benchmarks.memory_plan --quick``, as :func:`run_quick_suite`
    (each of its fits in a fresh process of its own)."""
    folder = background_folder('memory_plan')
    return python_m('benchmarks.memory_plan', '--quick', '--out',
                    str(folder)), folder


QUICK_SUITE = background(run_quick_suite)


@pytest.fixture(scope='module')
def out():
    proc, folder = background_result(run_quick_suite)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder


@pytest.fixture(scope='module')
def results(out):
    return json.loads((out / 'benchmarks.json').read_text())


def assert_summary(summary, n=None):
    assert summary['min'] <= summary['median'] <= summary['max']
    assert len(summary['values']) == summary['n']
    if n is not None:
        assert summary['n'] == n


@QUICK_SUITE
class TestOutputs:
    def test_files_written(self, out):
        assert sorted(path.name for path in out.iterdir()) == [
            'benchmarks.json', 'benchmarks.md', 'benchmarks.png']
        assert (out / 'benchmarks.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'

    def test_json_has_every_section(self, results):
        assert results['quick'] is True
        for section in run.SECTIONS:
            assert results[section], section
            assert results['seconds'][section] >= 0
        meta = results['meta']
        assert meta['command'].startswith('python -m benchmarks.run --quick')
        assert meta['git_commit']
        assert meta['versions']['torch']
        assert meta['torch_threads'] == 1

    def test_markdown_has_every_section(self, out, results):
        text = (out / 'benchmarks.md').read_text()
        for heading in ('## Targets', '## 1. Overhead', '## 2. Memory',
                        '## 3. Exactness', '## 4. Scaling', '## Profile'):
            assert heading in text
        for target in results['targets']:
            assert target['target'] in text
        # every table row has as many cells as its header
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.startswith('|---'):
                width = lines[i - 1].count('|')
                j = i + 1
                while j < len(lines) and lines[j].startswith('|'):
                    assert lines[j].count('|') == width, lines[j]
                    j += 1

    def test_targets(self, results):
        ids = [target['id'] for target in results['targets']]
        assert ids == ['overhead', 'acc_steps_1', 'memory_activation',
                       'memory_rss_fixed', 'exactness', 'scaling_k',
                       'scaling_data']
        for target in results['targets']:
            assert isinstance(target['met'], bool)
            assert target['measured']


@QUICK_SUITE
class TestOverhead:
    def test_every_contender_timed_every_round(self, results):
        for model in MODELS:
            entry = results['overhead'][model]
            rounds = entry['rounds']
            assert set(entry['cpu_s']) == set(CONTENDERS)
            for name in CONTENDERS:
                assert_summary(entry['cpu_s'][name], rounds)
                assert_summary(entry['wall_s'][name], rounds)
                assert entry['cpu_s'][name]['min'] > 0
            ratios = entry['ratios']['cpu']
            assert ratios['plain_B']['plain_B']['values'] == [1.0] * rounds
            assert ratios['hand']['hand']['values'] == [1.0] * rounds
            gap = entry['gap']
            assert set(gap) == {'data_path', 'skorch_loop', 'callbacks', 'total'}

    def test_gap_parts_add_up(self, results):
        for model in MODELS:
            gap = results['overhead'][model]['gap']
            parts = [gap[part]['seconds']['values']
                     for part in ('data_path', 'skorch_loop', 'callbacks')]
            for i, total in enumerate(gap['total']['seconds']['values']):
                assert sum(part[i] for part in parts) == pytest.approx(total)


@QUICK_SUITE
class TestExactness:
    @pytest.mark.parametrize('model', MODELS)
    def test_gradacc_is_the_large_batch(self, results, model):
        assert results['exactness'][model]['gradacc']['max_param_diff'] < 1e-10
        assert results['exactness'][model]['accumgrad']['max_param_diff'] < 1e-10
        assert results['exactness'][model]['gradacc'][
            'train_loss_ratio'] == pytest.approx(1.0, abs=1e-10)

    @pytest.mark.parametrize('model', MODELS)
    def test_other_recipes_are_not(self, results, model):
        entry = results['exactness'][model]
        for kind in ('faq', 'accelerate', 'naive', 'hand'):
            assert entry[kind]['max_param_diff'] > 1e-4, kind
        # the FAQ recipe reports the loss divided by k
        k = entry['config']['k']
        assert entry['faq']['train_loss_ratio'] < 1.5 / k

    @pytest.mark.parametrize('model', MODELS)
    def test_k1_controls_are_plain_skorch(self, results, model):
        entry = results['exactness'][model]
        for kind in ('gradacc', 'faq', 'accelerate', 'naive', 'hand',
                     'accumgrad'):
            assert entry[kind]['control_k1_max_param_diff'] == 0.0, kind


@QUICK_SUITE
class TestMemory:
    def test_activation_memory_is_that_of_the_micro_batch(self, results):
        for model in MODELS:
            entry = results['memory']['activation'][model]
            assert entry['gradacc_vs_plain_B'] == [1.0] * len(entry['ks'])
            large = entry['plain_Bk_vs_plain_B']
            assert large == sorted(large) and large[-1] > 1.5

    def test_rss_measured(self, results):
        # --quick measures with a fixed mmap threshold only
        assert list(results['memory']['rss']) == ['fixed']
        for by_k in results['memory']['rss']['fixed'].values():
            for entry in by_k.values():
                for label in RSS_CONTENDERS:
                    assert_summary(entry[label]['train_kib'], entry['repeats'])
                    assert entry[label]['train_kib']['min'] > 0
                assert entry['group_input_kib'] > 0


@QUICK_SUITE
class TestScaling:
    def test_shapes(self, results):
        by_k = results['scaling']['by_k']['mlp']
        assert len(by_k['gradacc']['epoch_cpu_s']) == len(by_k['ks'])
        assert len(by_k['gradacc']['step_cpu_s']) == len(by_k['ks'])
        assert 0 <= by_k['gradacc']['step_fit']['r2'] <= 1 + 1e-9
        by_data = results['scaling']['by_data']
        assert len(by_data['gradacc']['epoch_cpu_s']) == len(by_data['ns'])


# ------------------------------------------- the docs quote the committed runs

RESULTS = ROOT / 'benchmarks' / 'results'
PAGE = ROOT / 'docs' / 'benchmarks.rst'


def _span(values, fmt):
    low, high = (fmt.format(value).replace('e-0', 'e-')
                 for value in (min(values), max(values)))
    return low if low == high else '{} to {}'.format(low, high)


def quoted_results():
    """The fragments of docs/benchmarks.rst that quote the committed results,
    computed from the files in benchmarks/results."""
    run, stream, fsdp = (json.loads((RESULTS / name).read_text()) for name in (
        'benchmarks.json', 'stream_memory.json', 'fsdp_memory.json'))
    commits = {result['meta']['git_commit'] for result in (run, stream, fsdp)}
    # one package's code made every table (commits may differ elsewhere)
    assert len({_package_tree(commit) or commit for commit in commits}) == 1, \
        commits
    assert not any(result['meta']['skorch_gradacc']['modified']
                   for result in (run, stream, fsdp))
    ratios = {model: entry['ratios']['cpu']['plain_B']
              for model, entry in run['overhead'].items()}
    exact = run['exactness']
    diffs = {kind: [entry[kind]['max_param_diff'] for entry in exact.values()]
             for kind in ('gradacc', 'accumgrad', 'faq', 'accelerate', 'naive')}
    rss = run['memory']['rss']
    gradacc_rss = {malloc: [entry['train_kib_vs_plain_B']['gradacc']
                            for by_k in rss[malloc].values()
                            for entry in by_k.values()] for malloc in rss}
    over = [row['gradacc'] - row['plain_B'] for row in stream['models'].values()
            if row['gradacc'] > row['plain_B']]
    overlap = json.loads((RESULTS / 'ddp_overlap.json').read_text())
    assert not overlap['meta']['skorch_gradacc']['modified']
    assert overlap['max_param_diff'] == 0
    return [
        "``ddp_overlap.json`` (commit ``{}``".format(
            overlap['meta']['git_commit']),
        '{:.3f}x the wall time and {:.3f}x the CPU time, medians of {} '
        'rounds'.format(overlap['ratio']['wall']['median'],
                        overlap['ratio']['cpu']['median'],
                        overlap['ratio']['wall']['n']),
        '{:.1f} M parameters'.format(overlap['parameters'] / 1e6),
        'commit ``{}``'.format(run['meta']['git_commit']),
        '{:.2f}x (MLP), {:.2f}x (CNN) and {:.2f}x (transformer)'.format(
            *(ratios[model]['gradacc']['median'] for model in ratios)),
        '({:.2f}x for the MLP)'.format(ratios['mlp']['plain_Bk']['median']),
        '``acc_steps=1``, {:.3f}x, {:.3f}x and {:.3f}x'.format(
            *(ratios[model]['gradacc_k1']['median'] for model in ratios)),
        'within {} of the large-batch'.format(
            _span([max(diffs['gradacc'] + diffs['accumgrad'])], '{:.1e}')),
        "FAQ recipe {}, Accelerate's accumulation {}, and ``loss / k`` {} "
        'away'.format(*(_span(diffs[kind], '{:.1e}') for kind in (
            'faq', 'accelerate', 'naive'))),
        'R² ≥ {:.4f}'.format(min(entry['gradacc']['step_fit']['r2'] for entry
                                 in run['scaling']['by_k'].values())),
        "``B``'s for every ``k`` up to {}: {:.3f}x".format(
            max(run['config']['memory']['ks']),
            max(max(entry['gradacc_vs_plain_B'])
                for entry in run['memory']['activation'].values())),
        "{} of plain ``B``'s".format(_span(gradacc_rss['fixed'], '{:.2f}x')),
        "with glibc's defaults, {}".format(
            _span(gradacc_rss['default'], '{:.2f}x')),
        'GradAcc stays within {} of plain skorch at the micro-batch'.format(
            _span([row['ratio'] for row in stream['models'].values()],
                  '{:.2f}x')),
        'above it by {} MiB'.format(_span(over, '{:.1f}')),
        'in about {:.0f} minutes'.format(sum(run['seconds'].values()) / 60),
        'the training peak per rank is {:.0f} MiB with FSDP ({:.0f} MiB with '
        '``sync_each_batch=True``) against {:.0f} MiB with DDP'.format(*(
            max(rank['train_peak'] for rank in fsdp[config])
            for config in ('fsdp', 'fsdp_each', 'ddp'))),
    ]


def test_committed_tables_are_what_the_code_renders():
    # the Markdown and the CSV tables render from the committed JSON alone,
    # so a change to the rendering shows here, not at the next 30-minute run
    from benchmarks import fsdp_memory, memory_plan, report, stream_memory
    run = json.loads((RESULTS / 'benchmarks.json').read_text())
    assert report.evaluate_targets(run) == run['targets']
    assert report.markdown(run) == (RESULTS / 'benchmarks.md').read_text()
    for module, name in ((stream_memory, 'stream_memory'),
                         (fsdp_memory, 'fsdp_memory'), (memory_plan, 'memory_plan')):
        results = json.loads((RESULTS / (name + '.json')).read_text())
        for key, rows in module.tables(results).items():
            lines = (RESULTS / (key + '.csv')).read_text().splitlines()
            assert lines == [','.join(map(str, row)) for row in rows], key
    plan = json.loads((RESULTS / 'memory_plan.json').read_text())
    assert memory_plan.targets(plan) == plan['targets']
    assert memory_plan.markdown(plan) == (RESULTS / 'memory_plan.md').read_text()


def quoted_memory_plan():
    """The fragments of docs/benchmarks.rst that quote memory_plan.json."""
    plan = json.loads((RESULTS / 'memory_plan.json').read_text())
    assert not plan['quick'] and not plan['meta']['skorch_gradacc']['modified']
    budgets = [(int(budget), row) for entry in plan['workloads'].values()
               for budget, row in entry['budgets'].items()]
    rows = [row for _, row in budgets]
    batch_sizes = [entry['batch_size'] for entry in plan['workloads'].values()
                   for _ in entry['budgets']]
    # the chosen sizes over the repeats: one, or neighbours on the plan's grid
    same = [len(set(row['chosen'])) == 1 for row in rows]
    near = sum(None not in row['chosen'] and (alike or max(row['chosen']) == (
        planned_above(batch_size, min(row['chosen']))))
        for row, alike, batch_size in zip(rows, same, batch_sizes))
    fits = [fit for row in rows for fit in row['fits']]
    capped = [row['rlimit_as'] for row in rows if row['rlimit_as']]
    backoffs = sum(len(fit['backoffs']) for fit in capped)

    def every(key):  # a fit that failed has no ratios
        return [value for row in rows for value in row[key]]

    return [
        "``memory_plan.json`` (commit ``{}``".format(plan['meta']['git_commit']),
        '{} workloads, {} budgets, {} fits'.format(
            len(plan['workloads']), len(rows), len(fits)),
        'peaks measured by {}'.format(plan['meta']['method']),
        'the measured peak was {} of the budget'.format(_span(
            every('measured_vs_budget'), '{:.2f}x')),
        '{} of the {} fits failed, {} were killed'.format(
            sum(bool(fit['error']) for fit in fits), len(fits),
            sum(fit['killed'] for fit in fits)),
        'the predicted peak was {} of the measured one'.format(_span(
            every('predicted_vs_measured'), '{:.2f}x')),
        'the same size in all {} repeats for {} of the {} budgets'.format(
            plan['repeats'], sum(same), len(rows)),
        'but at most a grid step apart in {} of the {}'.format(near, len(rows)),
        'Fixed fits at the least planned size peaked at up to {:.2f}x'.format(max(
            row['probes'][str(min(filter(None, row['chosen']), default=1))]
            / budget / 2 ** 20
            for budget, row in budgets)),
        'the planned pieces were {} of the largest fixed size'.format(_span(
            every('chosen_vs_largest'), '{:.2f}x')),
        'as few as the largest fixed size in {} of the {} budgets'.format(
            sum(row['pieces'][0] >= max(row['pieces'][1:]) for row in rows),
            len(rows)),
        'planning took {} optimizer steps'.format(_span(
            every('plan_steps'), '{:.2f}')),
        'under ``RLIMIT_AS``, {} of {} workloads trained ({} back-off{}), within '
        '{} of plain skorch'.format(
            sum(not fit['error'] for fit in capped), len(capped), backoffs,
            '' if backoffs == 1 else 's',
            _span([max(fit.get('max_param_diff', 0) for fit in capped)], '{:.1e}')),
        'the memory plans in about {:.0f} minutes'.format(plan['seconds'] / 60),
    ] + quoted_glibc_threshold(budgets)


def quoted_glibc_threshold(budgets):
    """What docs/benchmarks.rst quotes of the fits under GLIBC_THRESHOLD;
    ``budgets``: (MiB, row) of each budget, whose default fits may have failed."""
    from benchmarks.memory_plan import glibc_threshold

    rows = [row for _, row in budgets]
    cells = [glibc_threshold(row, budget).split('; ') for budget, row in budgets]
    same = sum(len(set(sizes.split('/'))) == 1 for sizes, _, _ in cells)
    return ['chose the same size in all {} repeats for {} of the {} budgets'.format(
                len(rows[0]['fits']), same, len(cells)),
            'peaked at up to {:.2f}x of the budget, with steps {} as long'.format(
                max(float(peak) for _, peak, _ in cells),
                _span([float(ratio) for _, _, ratio in cells], '{:.2f}x'))]


def test_docs_quote_the_committed_results():
    page = ' '.join(PAGE.read_text().split())
    missing = [text for text in quoted_results() + quoted_memory_plan()
               if text not in page]
    assert not missing, missing


# ------------------------------------------------ the memory planner's benchmark

def test_glibc_threshold_column_renders_around_failed_fits():
    # a default fit that failed has no step time: the ratio is of those trained
    from benchmarks.memory_plan import MiB, glibc_threshold
    fit = {'error': None, 'step_seconds': 2.0, 'peak': 16 * MiB,
           'plan': {'micro_batch_size': 5}}
    failed = {'error': 'MemoryError', 'step_seconds': None, 'peak': None}
    row = {'glibc_threshold': [fit], 'fits': [failed, dict(fit, step_seconds=1.0)]}
    assert glibc_threshold(row, 32) == '5; 0.50; 2.00'
    assert glibc_threshold(dict(row, glibc_threshold=[failed]), 32) == 'failed'
    assert glibc_threshold({'fits': [fit]}, 32) == '-'


def test_largest_fitting_bisects_to_the_tolerance():
    from benchmarks.memory_plan import largest_fitting
    for start in (1, 50, 137, 600, 5000):
        probed = []

        def fits(n, probed=probed):
            probed.append(n)
            return n <= 137

        low, fail = largest_fitting(fits, start, 1000)
        assert low <= 137 < fail <= 1.1 * low and low in probed and fail in probed
        assert len(probed) <= 12, probed
    assert largest_fitting(lambda n: True, 10, 1000) == (1000, None)
    assert largest_fitting(lambda n: n == 1, 500, 1000) == (1, 2)
    assert largest_fitting(lambda n: False, 500, 1000) == (0, 1)


@background(run_memory_plan_quick)
def test_memory_plan_quick_run():
    proc, folder = background_result(run_memory_plan_quick)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from benchmarks import memory_plan
    MiB = memory_plan.MiB
    results = json.loads((folder / 'memory_plan.json').read_text())
    assert results['quick'] and results['repeats'] == memory_plan.REPEATS[True]
    assert results['meta']['method'] in ('cgroup', 'sampler')
    assert list(results['workloads']) == list(memory_plan.QUICK)
    keys = {'budget', 'method', 'max_cost', 'cost', 'micro_batch_size',
            'measured_peak', 'predicted_peak', 'plan_seconds', 'passes', 'verified'}
    for name, (batch_size, batches, budgets) in memory_plan.QUICK.items():
        entry = results['workloads'][name]
        assert (entry['batch_size'], entry['batches']) == (batch_size, batches)
        assert list(entry['budgets']) == [str(budget) for budget in budgets]
        for budget, row in entry['budgets'].items():
            budget = int(budget)
            assert len(row['fits']) == results['repeats']
            for fit in row['fits']:  # trained, within the budget, planned
                assert fit['error'] is None and not fit['killed'], fit['error']
                assert 0 < fit['peak'] <= budget * MiB
                assert fit['method'] == results['meta']['method']
                plan = fit['plan']
                assert keys <= set(plan) and plan['budget'] == budget * MiB
                assert 1 <= plan['micro_batch_size'] <= batch_size
                assert plan['predicted_peak'] > 0 and plan['plan_seconds'] > 0
                assert plan['measured_peak'] > 0 and plan['passes']
                assert fit['step_seconds'] > 0 and fit['backoffs'] == []
                assert fit['malloc'] is None  # users' environment: glibc's defaults
            assert row['chosen'] == [fit['plan']['micro_batch_size']
                                     for fit in row['fits']]
            # the bisection: the largest fixed size fits, the next one probed not
            assert 1 <= row['largest'] <= batch_size
            probes = {int(n): peak for n, peak in row['probes'].items()}
            assert probes[row['largest']] <= budget * MiB
            over = row['smallest_over'] and probes[row['smallest_over']]
            assert over is None or over > budget * MiB
            for key in ('measured_vs_budget', 'predicted_vs_measured',
                        'chosen_vs_largest', 'plan_steps'):
                assert len(row[key]) == len(row['fits']), key
            # one budget each: its middle one, under RLIMIT_AS, against plain skorch
            capped = row['rlimit_as']
            assert capped['error'] is None and not capped['killed']
            assert 0 <= capped['max_param_diff'] < 1e-3  # float32
            # and 'auto' in a process started with glibc's threshold, fixed
            assert len(row['glibc_threshold']) == results['repeats']
            for fit in row['glibc_threshold']:
                assert fit['malloc'] == memory_plan.GLIBC_THRESHOLD[
                    'MALLOC_MMAP_THRESHOLD_'] == '131072'
                assert fit['error'] is None and 0 < fit['peak'] <= budget * MiB
                assert fit['plan']['budget'] == budget * MiB
    assert results['targets'] == memory_plan.targets(results)
    assert (folder / 'memory_plan.md').read_text() == memory_plan.markdown(results)
    assert (folder / 'memory_plan.csv').read_text().splitlines() == [
        ','.join(map(str, row)) for row in memory_plan.tables(results)['memory_plan']]


def test_benchmarks_code_stays_within_its_line_budget():
    # issue 24: benchmarks the size of what they show. Every Python file under
    # benchmarks/ counts, as `wc -l` counts; the results (JSON, CSV, Markdown,
    # PNG) are data and do not. 2,100, not 1,800: issue 31 requires
    # memory_plan.py (about 290 lines: six workloads under a cap, bisection,
    # the targets), which the other benchmarks' 1,790 lines leave no room for
    lines = sum(path.read_text().count('\n')
                for path in (ROOT / 'benchmarks').rglob('*.py'))
    assert lines <= 2100, lines


# ------------------------------------- the committed runs come from this code

def _package_tree(commit):
    """The git tree of ``skorch_gradacc/`` at ``commit``, or None if unknown."""
    return _git('rev-parse', '--verify', '--quiet', commit + ':skorch_gradacc')


@pytest.mark.parametrize('path', sorted(RESULTS.glob('*.json')),
                         ids=lambda path: path.name)
def test_results_come_from_the_package_checked_out(path):
    # issue 33: a results file describes the package as checked out, or the
    # page says which older code its numbers describe
    head = _package_tree('HEAD')
    if head is None or _git('rev-parse', '--is-shallow-repository') != 'false':
        pytest.skip('needs a full git clone')
    meta = json.loads(path.read_text())['meta']
    assert meta['skorch_gradacc']['modified'] is False, (
        '{} ran on uncommitted package code'.format(path.name))
    note = '``{}`` describes the package of commit ``{}``'.format(
        path.name, meta['git_commit'])
    # the note, or a list of files that ends in it ("A, B and C describe")
    noted = re.search(r'``{}``(?:(?!commit).)*? describes? the package of '
                      r'commit ``{}``'.format(re.escape(path.name),
                                              meta['git_commit']),
                      ' '.join(PAGE.read_text().split()))
    if _package_tree(meta['git_commit']) == head:
        assert not noted, 'a stale note: ' + note
    else:
        assert noted, (
            '{} ran on the package of commit {}, not the one checked out: '
            'rerun it, or say on docs/benchmarks.rst: {}'.format(
                path.name, meta['git_commit'], note))
