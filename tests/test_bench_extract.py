"""benchmarks/bench_extract.py: its Parquet size runs, every --dtype and --layers choice."""

import json

from benchmarks import bench_extract


def test_the_size_runs_write_layers_none_with_the_average_mix(tmp_path, model_arg, capsys):
    """The size runs gave extract --layers none without a --mix, which it has refused since 7f154d8:
    bench_extract without --skip-sizes ended in 'ValueError: --layers none writes no layer, so it
    needs at least one --mix' after its throughput run, printing no size. --layers none runs with
    the layers' average (the reference model: 2P = 32 values a token, as the top layer)."""
    out = tmp_path / "figures.json"
    assert bench_extract.main(["--model", model_arg, "--max-lines", "2", "--size-lines", "3", "--skip-stages",
                               "--json", str(out)]) == 0
    sizes = {(row["dtype"], row["layers"]): row for row in json.loads(out.read_text())["sizes"]}
    assert sorted(sizes) == sorted((d, l) for d in ("float16", "float32") for l in ("all", "top", "none"))
    assert {key: row["mixes"] for key, row in sizes.items()} == {
        key: ["avg=average"] if key[1] == "none" else [] for key in sizes}
    tokens = {row["tokens"] for row in sizes.values()}
    assert len(tokens) == 1 and tokens.pop() > 0
    for dtype in ("float16", "float32"):  # one mix column is as wide as the top layer, a third of all
        size = {layers: sizes[dtype, layers]["bytes"] for layers in ("all", "top", "none")}
        assert size["none"] < size["all"] and abs(size["none"] - size["top"]) < 0.2 * size["top"]
    printed = capsys.readouterr().out
    assert printed.count("avg=average") == 2  # the two --layers none rows name their mix
