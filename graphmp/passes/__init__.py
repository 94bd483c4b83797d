"""The conversion passes. Each module has `run(ctx) -> PassResult`; its docstring says
what the pass needs from the context and what it guarantees afterwards. The pipeline
(their order) is written out once, in graphmp/convert.py, as a list of Steps whose
`needs` and `gives` are those contracts as data (names of context fields); `run_steps`
checks them under GRAPHMP_DEBUG=1 and in the test suite. pad/ is the padder, a group of
its own (graphmp/pad.py runs it).

The shape follows onnx_ir's passes: a pass does one job and returns a result that says
whether it changed the model and what it found (that part goes into the report).
"""
from __future__ import annotations

import os
import time
from collections.abc import Sized
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class PassResult:
    changed: bool
    details: dict = field(default_factory=dict)


class ContractError(RuntimeError):
    """A step of a pipeline broke its declared contract: a bug in graphmp, not in the model."""


@dataclass(frozen=True)
class Step:
    """One step of a pipeline and its contract.

    report_key: where the step's PassResult.details go in the report (None: top level).
    run: state -> PassResult | None.
    needs: state fields the step reads; each must have been given by an earlier step or
      be present (not None, not an empty container) when the step starts.
    gives: state fields the step guarantees afterwards: not None, and whatever the
      pipeline's `field_checks` say of that field (e.g. types: an entry for every graph).
    when: state -> bool; the step does its job (so its contract holds) only then (e.g.
      the search with --max-error); None: always. The step runs either way.
    name: for logs, timings and errors; default "module.function" of `run`.
    """
    report_key: str | None
    run: Callable
    needs: tuple = ()
    gives: tuple = ()
    when: Callable | None = None
    name: str = ""

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", f"{self.run.__module__.rsplit('.', 1)[-1]}.{self.run.__name__}")


def checking() -> bool:
    """Whether run_steps checks contracts by default: GRAPHMP_DEBUG=1 (tests/conftest.py sets
    it for the whole suite, and subprocesses inherit it)."""
    return os.environ.get("GRAPHMP_DEBUG") == "1"


def present(state, name: str) -> bool:
    """The field holds something: not None and not an empty container."""
    v = getattr(state, name, None)
    return v is not None and not (isinstance(v, Sized) and not isinstance(v, str) and len(v) == 0)


def check_needs(state, step: Step, given: set) -> None:
    for f in step.needs:
        if f not in given and not present(state, f):
            raise ContractError(f"pipeline contract: step {step.name} needs '{f}', which no earlier step gives "
                                f"and the state does not hold (given so far: {', '.join(sorted(given)) or 'nothing'})")


def check_gives(state, step: Step, field_checks: dict | None = None) -> None:
    for f in step.gives:
        if getattr(state, f, None) is None:
            raise ContractError(f"pipeline contract: step {step.name} declares it gives '{f}', "
                                f"but '{f}' is {'missing' if not hasattr(state, f) else 'None'} after it")
        check = (field_checks or {}).get(f)
        if check is not None and not check[0](state):
            raise ContractError(f"pipeline contract: step {step.name} declares it gives '{f}', "
                                f"but after it '{f}' does not hold {check[1]}")


def run_steps(state, steps, check: bool | None = None, field_checks: dict | None = None, log=None):
    """Run `steps` in order on `state`, yielding (step, result, seconds) after each (the
    caller records the result before the next step starts). With `check` (default:
    `checking()`), each step's needs are checked before it and its gives after it, for
    the steps whose `when` holds; a violation is a ContractError that names the step and
    the field. field_checks: {field: (predicate(state), "what it must hold")}; log: called
    with each step's name before it runs."""
    check = checking() if check is None else check
    given = set()
    for step in steps:
        active = check and (step.when is None or step.when(state))
        if active:
            check_needs(state, step, given)
        if log is not None:
            log(step.name)
        t = time.perf_counter()
        res = step.run(state)
        seconds = time.perf_counter() - t
        if active:
            check_gives(state, step, field_checks)
            given.update(step.gives)
        yield step, res, seconds
