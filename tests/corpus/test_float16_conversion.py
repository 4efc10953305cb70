"""The float32 -> float16 conversion of the output vectors (torch's, for speed) gives numpy's
bits on every kind of value: halfway cases, subnormals, overflow, signed zeros, inf and NaN; and
the values that are not finite after it are counted."""
import numpy as np

from elmo_pipeline.corpus.records import Sentence
from elmo_pipeline.corpus.schema import OutputRows, OutputSpec, _converted, nonfinite_values, table_of_rows


def _all_kinds() -> np.ndarray:
    rng = np.random.default_rng(0)
    # random float32 bit patterns (every exponent), the 2^13 float32 values around a few float16
    # values (a float16 step is 2^13 float32 steps: the halfway points are among them), specials
    bits = rng.integers(0, 2**32, size=400_000, dtype=np.uint64).astype(np.uint32)
    near = np.arange(-4096, 4096, dtype=np.int64)
    halfway = np.float16([1.0, 1.5, 65504.0, 6.1e-5, 5.96e-8, -2.0]).astype(np.float32).view(np.uint32)
    around = (halfway[:, None].astype(np.int64) + near[None, :]).clip(0, 2**32 - 1).astype(np.uint32)
    special = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 65519.99, 65520.0, -65520.0, 1e-8, 2.98e-8,
                          2.99e-8, 3e38, -3e38]).view(np.uint32)
    return np.concatenate([bits, around.ravel(), special]).view(np.float32)


def test_float16_conversion_gives_numpys_bits():
    values = _all_kinds()
    got = _converted(values, "float16")
    want = values.astype(np.float16)
    assert got.dtype == np.float16 and got.shape == want.shape
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))
    assert (np.abs(values[~nan]) > 65520).any() and np.isinf(got[np.abs(values) >= 65520]).all()


def test_float32_is_passed_through_unchanged():
    values = np.float32([1.5, -0.0, np.nan])
    assert _converted(values, "float32") is values


def _rows(vectors: list[np.ndarray]) -> list[OutputRows]:
    rows = []
    for i, v in enumerate(vectors):
        n = len(v)
        sentence = Sentence(f"d{i}", 0, 0, tuple("t" * n), np.arange(n, dtype=np.int64), np.arange(1, n + 1))
        rows.append(OutputRows(sentence, {"layer_0": np.zeros((n, 4), np.float32), "mix_m": v}))
    return rows


def test_values_not_finite_in_the_stored_dtype_are_counted_per_column():
    # 70000 is a fine float32 and inf as float16; 65519 rounds to 65504, 65520 to inf
    vectors = [np.float32([[1, 70000, -65520, 65519]]), np.float32([[np.nan, 0, 0, 0], [1, 2, 3, 4]])]
    for layout in ("token", "sentence"):
        for dtype, want in (("float16", {"mix_m": 3}), ("float32", {"mix_m": 1})):
            spec = OutputSpec(n_layers=1, width=4, layout=layout, dtype=dtype, mix_names=("m",))
            assert nonfinite_values(table_of_rows(_rows(vectors), spec), spec) == want, (layout, dtype)
    finite = OutputSpec(n_layers=1, width=4, mix_names=("m",))
    assert nonfinite_values(table_of_rows(_rows([np.ones((2, 4), np.float32)]), finite), finite) == {}
