"""Time limits on reward code: ``call_with_timeout(fn, args, seconds)`` (reward.fn's reward.timeout_s,
a judge's parser, verl's 10-second sympy limit in ``rlcore.task.verl_scores.prime_math``)."""

from __future__ import annotations

import signal
import threading
import time
from typing import Callable


class RewardTimeout(Exception):
    pass


def call_with_timeout(fn: Callable, args: tuple, timeout_s: float | None):
    """``fn(*args)``, raising RewardTimeout past ``timeout_s`` (None or <= 0: no limit).

    Main thread: SIGALRM via setitimer, which interrupts pure-Python code (a C call that never
    returns to the interpreter is interrupted when it does). Limits nest: an inner call (e.g. verl's
    sympy limit inside a reward.fn under reward.timeout_s) fires no later than the outer deadline,
    and the outer timer is re-armed with what is left of it afterwards (a function that sets its
    own alarm, as math-verify does, still cancels an outer one). Other threads: a daemon worker
    thread; a timed-out call keeps running there in the background but its result is discarded.
    """
    if not timeout_s or timeout_s <= 0:
        return fn(*args)
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return _call_with_alarm(fn, args, timeout_s)
    return _call_in_thread(fn, args, timeout_s)


def _call_with_alarm(fn, args, timeout_s):
    def on_alarm(signum, frame):
        raise RewardTimeout(f"exceeded reward.timeout_s={timeout_s}")

    outer_left = signal.getitimer(signal.ITIMER_REAL)[0]  # 0.0: no outer limit
    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, min(timeout_s, outer_left) if outer_left else timeout_s)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left:  # the outer deadline, past already: it fires at once
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - start), 1e-6))


def _call_in_thread(fn, args, timeout_s):
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # handed to the caller
            box["error"] = e

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RewardTimeout(f"exceeded reward.timeout_s={timeout_s}")
    if "error" in box:
        raise box["error"]
    return box["value"]
