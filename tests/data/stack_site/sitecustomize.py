"""Loaded by every rank of a job whose PYTHONPATH starts here (tests/e2e/serving/
test_fault_free_path.py): wraps DecodeDieLoop.step and, over a window of turns, records the Python
stack depth from step() to the deepest line that calls MPI, and every call whose callee sits in a
higher layer than its caller (the layer order of pyproject.toml's import contracts). Off unless
XDS_STACK_OUT is set."""

import importlib.abc
import importlib.util
import json
import linecache
import os
import re
import sys

OUT = os.environ.get("XDS_STACK_OUT")
REPO = os.environ.get("XDS_STACK_REPO", "").rstrip("/") + "/"
FIRST, LAST = 3, 40  # the turns measured (start-up's first turns left out)
XDS = ["config", "model", "train", "workload", "eplb", "plan", "projection", "report",
       "scheduling", "execution", "results", "ems", "afd", "pd", "quant"]  # fmt: skip
RANKS = {"core": 1, "recovery": 2, "ems": 2, "faults": 2, "colocated": 3, "afd": 3, "pd": 4}
RANKS["shell"] = 5
MPI_CALL = re.compile(
    r"\.(Sync|Get|Put|Accumulate|Fetch_and_op|Get_accumulate|Compare_and_swap|Flush\w*|Lock\w*"
    r"|Unlock\w*|Iprobe|iprobe|improbe|Improbe|Isend|isend|Irecv|irecv|Send|send|Recv|recv"
    r"|Barrier|Ibarrier|Test\w*|Wait\w*|Allgather|allgather|Allreduce|allreduce|Bcast|bcast)\("
)
_layers: dict = {}
_lines: dict = {}


def layer(filename):
    if filename not in _layers:
        value = None
        if filename.startswith(REPO):
            parts = filename[len(REPO) :].split("/")
            top, sub = parts[0], parts[1].removesuffix(".py") if len(parts) > 1 else ""
            if top == "xccl":
                value = (0, 0)
            elif top == "xds_mpi":
                value = (1, XDS.index(sub) if sub in XDS else 0)
            elif top == "ranks":
                value = (2, RANKS.get(sub, 1))
            elif top == "launch":
                value = (3, 0)
        _layers[filename] = value
    return _layers[filename]


def calls_mpi(filename, lineno):
    key = (filename, lineno)
    if key not in _lines:
        _lines[key] = bool(MPI_CALL.search(linecache.getline(filename, lineno)))
    return _lines[key]


def name(frame):
    return f"{frame.f_code.co_filename.removeprefix(REPO)}:{frame.f_code.co_name}"


def measured(step):
    turns = [0]

    def wrapped(self):
        turns[0] += 1
        if not FIRST <= turns[0] <= LAST:
            return step(self)
        stats = {"depth": 0, "chain": [], "up": {}}
        top = {}

        def local(frame, event, arg):
            if event == "line" and calls_mpi(frame.f_code.co_filename, frame.f_lineno):
                chain, f = [], frame
                while f is not None and f is not top.get("step"):
                    chain.append(f)
                    f = f.f_back
                if f is not None and len(chain) + 2 > stats["depth"]:
                    stats["depth"] = len(chain) + 2  # + step's own frame + the MPI call
                    stats["chain"] = [name(x) for x in [f, *reversed(chain)]]
            return local

        def tracer(frame, event, arg):
            if event != "call":
                return None
            top.setdefault("step", frame)
            caller = frame.f_back
            above, below = (
                layer(frame.f_code.co_filename),
                caller and layer(caller.f_code.co_filename),
            )
            if above and below and above > below:
                key = f"{name(caller)} -> {name(frame)}"
                stats["up"][key] = stats["up"].get(key, 0) + 1
            return local if above is not None else None

        sys.settrace(tracer)
        try:
            return step(self)
        finally:
            sys.settrace(None)
            rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "x"))
            with open(f"{OUT}.{rank}.jsonl", "a") as out:
                out.write(json.dumps(stats) + "\n")

    return wrapped


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "ranks.core.decode_die":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            module.DecodeDieLoop.step = measured(module.DecodeDieLoop.step)

        spec.loader.exec_module = exec_and_patch
        return spec


if OUT:
    sys.meta_path.insert(0, _Patch())
