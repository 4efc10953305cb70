"""benchmarks/bench_memory.py: a case whose document extract did not read says so, not a peak."""

import json

from benchmarks import bench_memory


def test_a_document_extract_rejected_is_named_not_measured(tmp_path, capsys):
    """A --doc-mb past extract's --max-document-mb was one error record, never read: the case printed
    0 tokens and a peak RSS as if measured (706 MiB for --doc-mb 65) and the command exited 0. A bound
    given through --extract-arg still wins over the one the benchmark raises, so it shows the case."""
    out = tmp_path / "memory.json"
    code = bench_memory.main(["--cases", "one-doc", "--doc-mb", "0.02", "--extract-arg=--max-document-mb=0.01",
                              "--work", str(tmp_path / "work"), "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 1
    assert ("one-doc 0.02MB: 1 of 1 documents rejected, not measured: "
            "line of more than 0.01 MiB (--max-document-mb 0.01): not read") in printed
    run, = json.loads(out.read_text())["cases"]["one-doc 0.02MB"]["runs"]
    assert (run["tokens"], run["documents_read"], run["documents_rejected"]) == (0, 1, 1)
