"""Does ``micro_batch_size='auto'`` with a ``memory_budget`` plan right?

    python -m benchmarks.memory_plan --out benchmark_results   # --quick: smoke

Six workloads, three budgets each; each fit in a fresh process
(``harness.fresh_process``), warmed up on a small fit, capped after
``initialize()`` at its ``VmSize`` plus the budget (``RLIMIT_AS``), one epoch.
Peak: ``VmHWM`` growth over the RSS after ``initialize()`` and ``malloc_trim``,
less code paged in (``RssFile``), against the plan's line at the largest piece that
trained. The plan is set against the largest ``micro_batch_size=n`` that trains under
the cap (bisection to 10%), ``plan_seconds`` (its loss check apart) against one step.
"""

import ctypes
import gc
import math
import multiprocessing
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from benchmarks import harness
from benchmarks.stream_memory import VOCAB, TokenHead
from benchmarks.workloads import make_net, make_workload
from skorch_gradacc.batching import batch_len
from skorch_gradacc.demo import max_param_diff
from skorch_gradacc.memory import batch_cost, is_out_of_memory

sys.path.insert(0, str(harness.ROOT / 'docs'))  # the recipes' modules
import fine_tuning_transformers as bert  # noqa: E402
import lora_causal_lm as lora  # noqa: E402

MiB = 2 ** 20
#: name: (rows per batch, batches, budgets in MiB); a batch is a step
WORKLOADS = {'mlp': (2048, 3, (16, 24, 32)), 'cnn': (128, 3, (16, 32, 48)),
             'transformer': (128, 3, (12, 24, 40)), 'token_lm': (16, 4, (12, 24, 48)),
             'bert_tagger': (128, 3, (16, 40, 72)), 'lora_gpt2': (256, 3, (16, 40, 72))}
QUICK = {'mlp': (512, 2, (16,)), 'token_lm': (4, 3, (12,))}
TARGET = {False: ('mlp', 40), True: ('mlp', 28)}  # by --quick: workload, MiB
MODULES = {'mlp': {'n_hidden': 1024}, 'cnn': {'in_channels': 3, 'image_size': 32},
           'transformer': {'seq_len': 64}}


def ids_and_labels(sequences):
    """The recipe's padding, with the token ids alone as the input."""
    X, y = lora.pad_for_lm(sequences)
    return X['input_ids'], y


def longest_first(dataset, batch_size, collate_fn, **kwargs):
    """Batches of similar lengths, each padded to its longest, the longest
    batch first (as transformers' ``group_by_length``), the others shuffled."""
    lengths = [len(item[0] if isinstance(item, tuple) else item) for item in dataset]
    order = np.argsort(lengths, kind='stable')[::-1]
    batches = [order[i:i + batch_size].tolist()
               for i in range(0, len(order), batch_size)]
    batches[1:] = [batches[1 + i] for i in np.random.default_rng(0).permutation(
        len(batches) - 1)]
    return torch.utils.data.DataLoader(dataset, batch_sampler=batches,
                                       collate_fn=collate_fn)


def build(name, plain, batch_size, rows, dtype, **params):
    """``(net, X, y)``: a workload's plain skorch net or GradAcc net (``params``
    added), for one epoch of ``rows`` rows."""
    params.update(batch_size=batch_size)
    if name in MODULES:
        X, y, module, kwargs = make_workload(
            name, {'n': rows, 'module_kwargs': MODULES[name]}, dtype=dtype)
        net = make_net('plain' if plain else 'gradacc', module, kwargs, **params)
    elif name == 'bert_tagger':  # AdamW: state created at the first step
        texts, y = bert.make_sentences(rows, max_clauses=8)
        X = {'input_ids': bert.make_tokenizer().fit(texts).transform(texts)[
            'input_ids']}
        net = (bert.Tagger if plain else bert.GradAccTagger)(**bert.tagger_params(
            module__hidden_size=64, lr=1e-3, iterator_train=longest_first,
            iterator_train__collate_fn=bert.pad_batch, **params))
    else:  # 8 to 128 random words, whose logits dominate; the recipe's texts
        rng, y, lm = np.random.default_rng(0), None, name == 'token_lm'
        X = ([rng.integers(1, VOCAB, n) for n in rng.integers(8, 129, rows)] if lm
             else lora.tokenize(lora.make_texts(rows)))
        net = lora.lm_pipeline(lora.CausalLM if plain else lora.GradAccCausalLM,
                               **params)[-1].set_params(
            iterator_train=longest_first, **({'module': TokenHead, 'iterator_train__'
                                              'collate_fn': ids_and_labels} if lm else
                                             {'iterator_train__collate_fn':
                                              lora.pad_for_lm}))
    return net.set_params(max_epochs=1), X, y


def run(name, plain, batch_size, rows, budget_mib=None, params=(),
        dtype=torch.float32, state=False):
    """One fit in this process (through ``harness.fresh_process``): its peak (MiB,
    see above), allocation error, back-offs, plan, seconds per step."""
    warm, X, y = build(name, True, 2, 4, dtype)  # kernels' code paged in
    warm.partial_fit(X, y)
    del warm, X, y
    net, X, y = build(name, plain, batch_size, rows, dtype, **dict(params))
    torch.manual_seed(0)
    net.initialize()
    limit = resource.getrlimit(resource.RLIMIT_AS)
    if budget_mib:
        gc.collect()
        resource.setrlimit(resource.RLIMIT_AS, (
            harness._status_kib('VmSize') * 1024 + budget_mib * MiB, limit[1]))

    # the pieces that train after the plan: a batch of shorter rows may take more
    costs, train_step_single = [0], net.train_step_single
    def tracked_step(batch, **fit_params):
        if getattr(net, 'memory_plan_', None) is not None:
            costs.append(batch_cost(batch) or batch_len(batch))
        return train_step_single(batch, **fit_params)
    net.train_step_single = tracked_step

    def fit():
        code, start = harness._status_kib('RssFile'), time.perf_counter()
        try:
            net.partial_fit(X, y)
        except (RuntimeError, MemoryError) as error:  # the back-off's, too
            text = '{}: {}'.format(type(error).__name__, error).splitlines()[0]
            if not (is_out_of_memory(error) or 'fit in memory' in text
                    or isinstance(error, MemoryError)):
                raise
            return text[:160], code, None
        return None, code, time.perf_counter() - start

    # malloc's free memory given back first, as the plan's meter does: a
    # fit that reuses it would look smaller than it is
    ctypes.CDLL(None).malloc_trim(0)
    kib, _, (error, code, seconds) = harness.peak_growth_kib(fit)
    resource.setrlimit(resource.RLIMIT_AS, limit)  # to send the results
    code = harness._status_kib('RssFile') - code
    plan, batches = getattr(net, 'memory_plan_', None), net.history[-1, 'batches']
    return {'peak_mib': (kib - code) / 1024, 'code_mib': code / 1024, 'error': error,
            'plan': plan, 'largest_piece_cost': max(costs), 'predicted_peak': plan and
            int(plan['fixed'] + plan['slope'] * max(costs)), 'backoffs': sum(
                (row.get('micro_batch_size_backoff', []) for row in batches), []),
            'step_s': seconds and (seconds - sum((plan or {}).get(key, 0) for key in (
                'plan_seconds', 'loss_check_seconds'))) / len(batches),
            # numpy: torch would share memory through file descriptors
            'state': state and {key: value.numpy() for key, value in
                                net.module_.state_dict().items()}}


def largest_fitting(fits, start, high, tolerance=1.1):
    """The largest ``n <= high`` with ``fits(n)``, from ``start``: doubling until
    a size fails, then bisecting until the largest size that fit and the smallest
    that failed are within ``tolerance``. Returns both (None: none failed)."""
    low, fail = 0, high + 1
    n = max(1, min(start, high))
    while fail - low > 1 and fail > tolerance * low:
        low, fail = (n, fail) if fits(n) else (low, n)
        n = (min(2 * low, high) if fail > high else int(math.sqrt(low * fail))
             if low else fail // 2)
        n = min(max(n, low + 1), fail - 1)
    return low, None if fail > high else fail


def measure(name, batch_size, batches, budget):
    """The plan under ``budget`` against the fit and the fixed sizes."""
    rows, probes = batch_size * batches, {}
    auto = harness.fresh_process(run, name, False, batch_size, rows, budget, {
        'micro_batch_size': 'auto', 'memory_budget': '{}MiB'.format(budget)})

    def fits(n):
        probes[n] = harness.fresh_process(run, name, False, batch_size, rows, budget,
                                          {'micro_batch_size': n})['error']
        return probes[n] is None

    # no plan: the fit failed before its first step
    plan = auto['plan'] = auto['plan'] or dict.fromkeys(
        ('unit', 'micro_batch_size', 'predicted_peak', 'plan_seconds'))
    chosen, predicted = plan['micro_batch_size'], auto['predicted_peak']
    largest, failed = largest_fitting(fits, chosen or 1, batch_size)
    return dict(auto, largest=largest, smallest_failed=failed, probes=probes,
                chosen_vs_largest=chosen / largest if chosen and largest else None,
                predicted_vs_measured=predicted and predicted / MiB / auto['peak_mib'],
                plan_steps=auto['step_s'] and plan['plan_seconds'] / auto['step_s'])


def target_row(name, budget, batch_size, batches):
    """Under the cap in float64: plain skorch at the batch and 'auto', and 'auto'
    against plain skorch without the cap."""
    auto = {'micro_batch_size': 'auto', 'memory_budget': '{}MiB'.format(budget)}
    plain, auto, reference = (harness.fresh_process(
        run, name, not params, batch_size, batch_size * batches, cap, params,
        torch.float64, True) for cap, params in ((budget, ()), (budget, auto),
                                                 (None, ())))
    return {'budget_mib': budget, 'batch_size': batch_size, 'plain_error':
            plain['error'], 'auto': dict(auto, state=None), 'max_param_diff':
            max_param_diff(*({key: torch.as_tensor(value) for key, value in
                              fit['state'].items()} for fit in (auto, reference)))}


HEADER = ['workload', 'unit', 'B', 'plain at B (MiB)', 'budget (MiB)', 'chosen',
          'largest that fits', 'chosen / largest', 'predicted (MiB)',
          'measured (MiB)', 'predicted / measured', 'plan (s)', 'step (s)',
          'plan / step', 'back-offs']


def tables(results):
    """The CSV table (rows, the header first) of the saved results."""
    rows = [[name, fit['plan']['unit'], entry['batch_size'],
             round(entry['plain_peak_mib']), budget, fit['plan']['micro_batch_size'],
             fit['largest']] + ['-' if value is None else fmt.format(value) for value,
                                fmt in zip((
                 fit['chosen_vs_largest'], fit['predicted_peak'] and fit[
                     'predicted_peak'] / MiB,
                 fit['peak_mib'], fit['predicted_vs_measured'], fit['plan'][
                     'plan_seconds'], fit['step_s'], fit['plan_steps']), (
                 '{:.2f}', '{:.1f}', '{:.1f}', '{:.2f}', '{:.2f}', '{:.2f}', '{:.2f}'))]
            + [len(fit['backoffs']) if fit['error'] is None else 'failed']
            for name, entry in results['workloads'].items()
            for budget, fit in entry['budgets'].items()]
    # a fit that failed before its plan has none of the plan's values
    rows = [['-' if value is None else value for value in row] for row in rows]
    return {'memory_plan': [HEADER] + rows}


def targets(results):
    """The issue's targets: text, what was measured, whether it was met."""
    fits = [fit for entry in results['workloads'].values()
            for fit in entry['budgets'].values()]
    # a fit that failed before its plan or its end has no ratio of one; one
    # that failed where a size fits chose none of it
    ratio, chosen, steps = ([fit[key] for fit in fits if fit[key]] or [0.0] for key
                            in ('predicted_vs_measured', 'chosen_vs_largest',
                                'plan_steps'))
    chosen += [0.0 for fit in fits if fit['error'] and fit['largest']]
    # where no micro-batch fits, the clean outcome is the plan's error
    clean, target = [not fit['backoffs'] and (not fit['error'] or (
        fit['largest'] == 0 and 'fit in memory' in fit['error']))
        for fit in fits], results['target']
    return [{'target': text, 'measured': measured, 'met': bool(met)} for text,
            measured, met in [
        ('predicted peak within 20% of the measured peak', '{:.2f}x to {:.2f}x'
         .format(min(ratio), max(ratio)), all(abs(r - 1) <= 0.2 for r in ratio)),
        ('chosen >= 0.5x the largest that fits (aim: 0.8x)', '{:.2f}x to {:.2f}x, '
         '{} of {} >= 0.8x'.format(min(chosen), max(chosen), sum(
             c >= 0.8 for c in chosen), len(chosen)), min(chosen) >= 0.5),
        ('planning <= 2 training steps', '{:.2f} to {:.2f} steps'.format(
            min(steps), max(steps)), 0 < max(steps) <= 2),
        ('the plan fits the cap: no back-off (where not one row fits: the '
         "plan's error, before any step)", '{} of {} fits'.format(
            sum(clean), len(clean)), all(clean)),
        ('under a {} MiB cap, plain skorch at {} rows fails; auto trains without '
         'back-off, within 1e-10 of it (float64)'.format(
             target['budget_mib'], target['batch_size']),
         'plain: {}; auto: {}, {} back-offs, {:.1e}'.format(
             target['plain_error'] or 'trained', target['auto']['error'] or
             'trained', len(target['auto']['backoffs']), target['max_param_diff']),
         target['plain_error'] and not target['auto']['error'] and not target[
             'auto']['backoffs'] and target['max_param_diff'] <= 1e-10)]]


def markdown(results):
    """The Markdown of the saved results."""
    meta = results['meta']
    return '\n'.join([
        '# Memory plans against measurements', '', '`{}`, commit `{}`, {} CPUs '
        '(load average {:.1f}), {:.0f} s. MiB over the RSS after `initialize()`, '
        'a fresh process per fit, under an address-space cap of the budget (see '
        '`benchmarks/memory_plan.py`); times in seconds.'.format(
            meta['command'], meta['git_commit'], meta['cpu_count'],
            meta['load_average'][0], results['seconds']), '',
        harness.markdown_table(['target', 'measured', 'met'], [
            [row['target'], row['measured'], 'yes' if row['met'] else '**no**']
            for row in results['targets']]),
        harness.markdown_table(HEADER, tables(results)['memory_plan'][1:])])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = harness.parser('benchmarks.memory_plan', __doc__.split('\n\n')[0])
    parser.add_argument('--quick', action='store_true', help='a smoke run')
    args = parser.parse_args(argv)
    # the fits fork from a server that has imported transformers and peft
    # (seconds each): started here, before the harness starts one without them
    multiprocessing.get_context('forkserver').set_forkserver_preload([
        'torch', 'torch._dynamo', 'skorch', 'sklearn', 'skorch_gradacc', 'peft',
        'transformers', 'benchmarks.workloads', 'fine_tuning_transformers',
        'lora_causal_lm'])
    multiprocessing.forkserver.ensure_running()
    workloads, start = QUICK if args.quick else WORKLOADS, time.perf_counter()
    results = {'meta': harness.provenance('benchmarks.memory_plan', argv),
               'quick': args.quick}
    with ThreadPoolExecutor(2) as pool:  # two cores
        plain = {name: pool.submit(harness.fresh_process, run, name, True, B, B * n)
                 for name, (B, n, _) in workloads.items()}
        fits = {(name, budget): pool.submit(measure, name, B, n, budget)
                for name, (B, n, budgets) in workloads.items() for budget in budgets}
        name, budget = TARGET[args.quick]
        target = pool.submit(target_row, name, budget, *workloads[name][:2])
        results['workloads'] = {name: {
            'batch_size': B, 'rows': B * n, 'plain_peak_mib': plain[name].result()[
                'peak_mib'], 'budgets': {str(budget): fits[name, budget].result()
                                         for budget in budgets}}
            for name, (B, n, budgets) in workloads.items()}
        results['target'] = target.result()
    results['seconds'] = time.perf_counter() - start
    results['targets'] = targets(results)
    harness.save(args.out, 'memory_plan', results, markdown(results), **tables(results))
    return 0


if __name__ == '__main__':
    sys.exit(main())
