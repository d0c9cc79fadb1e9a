"""`xds-mpi generate` end to end (subprocess), against the in-process reference generator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness import REPO_ROOT

XDS_MPI = Path(sys.executable).parent / "xds-mpi"


def xds_mpi(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(XDS_MPI), *args], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )


def reference_continuation(prompt: str, *, max_new_tokens: int) -> str:
    """The in-process reference generator's continuation (greedy, no EOS stop, the tiny
    compute shape's weights), escaped as the CLI prints it."""
    from xds_mpi.model.reference import GenerateOptions, ReferenceGenerator
    from xds_mpi.model.shapes import compute_shape
    from xds_mpi.model.tokenizer import ByteTokenizer
    from xds_mpi.model.weights import build_model

    tok = ByteTokenizer()
    [ref] = ReferenceGenerator(
        build_model(compute_shape()),
        GenerateOptions(max_new_tokens=max_new_tokens, ignore_eos=True),
    ).generate([tok.encode(prompt)])
    expected = tok.decode(list(ref.tokens))
    return "".join(c if c.isprintable() or c in "\n\t" else ascii(c)[1:-1] for c in expected)


def test_generate_prints_the_reference_continuation_and_tokens_per_second(tmp_path):
    weights = tmp_path / "tiny.h5"
    first = xds_mpi(
        "generate",
        "--prompt",
        "Hello",
        "--max-new-tokens",
        "6",
        "--mtp",
        "1",
        "--ignore-eos",
        "--save-weights",
        str(weights),
    )
    assert first.returncode == 0, first.stderr
    text, stats = first.stdout.rstrip("\n").rsplit("\n", 1)
    assert "6 tokens in" in stats and "tokens/s" in stats and "MTP accepted" in stats

    assert text == reference_continuation("Hello", max_new_tokens=6)

    again = xds_mpi(
        "generate",
        "--prompt",
        "Hello",
        "--max-new-tokens",
        "6",
        "--ignore-eos",
        "--weights",
        str(weights),
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.rsplit("\n", 2)[0] == text


def test_generate_refuses_a_bad_mtp_depth():
    result = xds_mpi("generate", "--prompt", "x", "--mtp", "3")
    assert result.returncode == 2
    assert "--mtp must be 0, 1 or 2, got 3" in result.stderr
