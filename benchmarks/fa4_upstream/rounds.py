"""What the same-process runs (same_run_varlen.py, same_run_decode.py, same_run_local.py)
share: the rounds over their cells (a failing cell noted and the run going on, the
results written after each round), a cell's peers timed once per round in turns (the
order reversed every other round), a cell's median and range over rounds, and the
results written out."""
import json
import statistics
import traceback
from pathlib import Path


def note(res, key, e):
    """Records ``e`` as the first error of ``key`` in res["errors"] and prints it."""
    res["errors"].setdefault(key, f"{type(e).__name__}: {str(e)[:300]}")
    print(f"ERROR {key}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    traceback.print_exc(limit=3)


def run_rounds(res, out_json, rounds, cells, run, name, before_round=None):
    """``rounds`` times: ``before_round(r)`` where given, then ``run(cell, r)`` for each of
    ``cells``, a failing one noted under ``name(cell)`` (the run goes on), torch's cache
    emptied after each; ``res`` written to ``out_json`` after every round."""
    import torch

    for r in range(rounds):
        if before_round is not None:
            before_round(r)
        for c in cells:
            try:
                run(c, r)
            except Exception as e:  # noqa: BLE001 (the cell's setup or ours failed)
                note(res, name(c), e)
            torch.cuda.empty_cache()
        Path(out_json).write_text(json.dumps(res, indent=1))


def time_round(key, peers, r, res, bench, rate):
    """Times each of ``peers`` ({name: callable}) once by ``bench`` (ms), in turns reversed
    on odd rounds ``r``; appends ``rate(ms)`` to ``res[field][f"{key}|{name}"]`` and returns
    the round's figures, {name: rate}. ``rate``: (field, a function of ms)."""
    field, of_ms = rate
    order = list(peers.items())
    if r % 2:
        order.reverse()
    figures = {}
    for name, fn in order:
        try:
            figures[name] = of_ms(bench(fn))
            res[field].setdefault(f"{key}|{name}", []).append(figures[name])
        except Exception as e:  # noqa: BLE001 (the run goes on without this peer's figure)
            note(res, f"{key}|{name}", e)
    return figures


def summary(values, key, scale=1.0, digits=0):
    """(median, " (min-max)") of ``values[key]`` divided by ``scale``: NaN and "" where the
    cell has no figure, no range where it has one."""
    v = [x / scale for x in values.get(key, [])]
    if not v:
        return float("nan"), ""
    return statistics.median(v), (f" ({min(v):.{digits}f}-{max(v):.{digits}f})" if len(v) > 1 else "")


def finish(res, out_json, text):
    """Writes ``res`` with its table ``text`` to ``out_json`` and prints the table and the
    errors."""
    res["table"] = text
    Path(out_json).write_text(json.dumps(res, indent=1))
    print(text)
    if res["errors"]:
        print("\nerrors:", json.dumps(res["errors"], indent=1))
