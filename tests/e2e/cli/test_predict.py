"""`xds-mpi predict` on a slice of the real conversation trace (skipped when the trace is not
beside the repository): the training and evaluation parts are disjoint and in time order, the
held-out accuracy beats the majority class, and the model file it writes loads."""

from __future__ import annotations

import re

import pytest
from harness import REPO_ROOT

from launch.cli.main import main
from xds_mpi.cluster.length_model import load_length_model

TRACE = REPO_ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
NUM_LINES = 4000  # about 20 minutes of the trace


@pytest.mark.skipif(not TRACE.exists(), reason=f"the conversation trace is not at {TRACE}")
def test_predict_trains_on_the_first_half_and_beats_the_majority_class(tmp_path, capsys):
    trace = tmp_path / "slice.jsonl"
    with TRACE.open() as source:
        trace.write_text("".join(next(source) for _ in range(NUM_LINES)))
    out = tmp_path / "model.json"
    assert main(["predict", "--trace", str(trace), "--out", str(out)]) == 0
    text = capsys.readouterr().out

    parts = {
        name: (int(num), int(first), int(last))
        for name, num, first, last in re.findall(
            r"(train|evaluate): (\d+) requests, trace lines (\d+)\.\.(\d+)", text
        )
    }
    num_train, train_first, train_last = parts["train"]
    num_eval, eval_first, eval_last = parts["evaluate"]
    assert (train_first, train_last, eval_first, eval_last) == (1, 2000, 2001, NUM_LINES)
    assert num_train + num_eval == NUM_LINES and num_train == train_last - train_first + 1

    accuracy = float(re.search(r"accuracy on the 2000 held-out requests: ([\d.]+)%", text)[1])
    baseline = float(re.search(r"majority-class baseline .*: ([\d.]+)%", text)[1])
    assert accuracy > baseline + 2.0, text
    assert "DeepServe §5.3.3: 84.9%" in text

    model = load_length_model(out)
    assert model.meta["train_lines"] == [1, 2000] and model.meta["num_train"] == 2000
    assert model.meta["eval_accuracy"] == pytest.approx(accuracy / 100, abs=6e-4)
