import gzip
import io
import json
import os
import stat

import h5py
import numpy as np
import pytest
import torch
import zstandard

from elmo_pipeline.cli.main import main


def _run(elmo_fixture_dir, *args):
    return main(["embed-file", *args, "--quiet", "--options", str(elmo_fixture_dir / "options.json"),
                 "--weights", str(elmo_fixture_dir / "lm_weights.hdf5")])


def test_empty_lines_keep_line_numbers_as_keys(elmo_fixture_dir, reference_model, tmp_path):
    text = "The cat sat .\n\nA dog barked loudly .\n"
    (tmp_path / "in.txt.gz").write_bytes(gzip.compress(text.encode()))
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt.gz"), str(tmp_path / "out.h5"), "--batch-size", "2") == 0
    out = h5py.File(tmp_path / "out.h5", "r")
    assert out["0"].shape == (3, 4, 32)
    assert out["1"].shape == (3, 0, 32)
    assert out["2"].shape == (3, 5, 32)
    index = json.loads(out["sentence_to_index"][0])
    assert index == {"The cat sat .": "0", "": "1", "A dog barked loudly .": "2"}
    with torch.no_grad():
        direct = reference_model.embed([["A", "dog", "barked", "loudly", "."]]).layers[:, 0].numpy()
    np.testing.assert_allclose(out["2"][...], direct, atol=1e-6)


def test_a_repeated_line_maps_to_its_last_key_as_allennlp_wrote_it(elmo_fixture_dir, tmp_path):
    """AllenNLP's embed_file sets sentence_to_index[sentence] = key line by line: the last wins."""
    (tmp_path / "in.txt").write_text("The cat sat .\nA dog .\nThe cat sat .\n", encoding="utf-8")
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "out.h5")) == 0
    with h5py.File(tmp_path / "out.h5", "r") as out:
        assert json.loads(out["sentence_to_index"][0]) == {"The cat sat .": "2", "A dog .": "1"}
        assert sorted(out) == ["0", "1", "2", "sentence_to_index"]
        np.testing.assert_array_equal(out["0"][...], out["2"][...])


def test_average_and_top_shapes(elmo_fixture_dir, tmp_path):
    (tmp_path / "in.txt").write_text("one two three\nfour\n")
    _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "all.h5"))
    _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "avg.h5"), "--average")
    _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "top.h5"), "--top")
    full = h5py.File(tmp_path / "all.h5", "r")["0"][...]
    np.testing.assert_allclose(h5py.File(tmp_path / "avg.h5", "r")["0"][...], full.mean(0), atol=1e-6)
    np.testing.assert_array_equal(h5py.File(tmp_path / "top.h5", "r")["0"][...], full[-1])


def test_missing_input_is_a_clear_error(elmo_fixture_dir, tmp_path, capsys):
    assert _run(elmo_fixture_dir, str(tmp_path / "nope.txt"), str(tmp_path / "o.h5")) == 2
    assert "nope.txt" in capsys.readouterr().err
    assert not (tmp_path / "o.h5").exists()


def test_every_frame_of_a_multi_frame_zst_input_is_embedded(elmo_fixture_dir, reference_model, tmp_path):
    # zstd tools (pzstd, zstd --long in chunks, concatenated files) write several frames; fsspec's
    # inferred decompression stopped silently after the first, so the second half was never embedded.
    lines = [f"Sentence number {i} of the file ." for i in range(40)]
    data = ("\n".join(lines) + "\n").encode()
    half = len(data) // 2
    (tmp_path / "in.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(data[:half])
                                         + zstandard.ZstdCompressor().compress(data[half:]))
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt.zst"), str(tmp_path / "out.h5"), "--top") == 0
    out = h5py.File(tmp_path / "out.h5", "r")
    assert json.loads(out["sentence_to_index"][0]) == {line: str(i) for i, line in enumerate(lines)}
    assert sorted(int(k) for k in out if k != "sentence_to_index") == list(range(40))
    with torch.no_grad():
        last = reference_model.embed([lines[-1].split()]).layers[-1, 0].numpy()
    np.testing.assert_allclose(out["39"][...], last, atol=1e-6)


def test_a_truncated_zst_input_is_a_clear_error_not_an_empty_file(elmo_fixture_dir, tmp_path, capsys):
    # fsspec's inferred zstd reader returned no line at all for a truncated file: exit 0, nothing embedded
    blob = zstandard.ZstdCompressor().compress(("\n".join(f"Line {i} ." for i in range(500)) + "\n").encode())
    (tmp_path / "cut.txt.zst").write_bytes(blob[: len(blob) * 3 // 4])
    assert _run(elmo_fixture_dir, str(tmp_path / "cut.txt.zst"), str(tmp_path / "out.h5")) == 2
    err = capsys.readouterr().err
    assert f"cannot read {tmp_path / 'cut.txt.zst'}: EOFError: zstd file ended before the end of its last frame" in err
    assert not (tmp_path / "out.h5").exists()


def test_an_output_that_is_a_folder_or_under_a_file_is_refused(elmo_fixture_dir, tmp_path, capsys):
    # the rename moved the file into the folder, as "outdir.partial", and the command reported success
    (tmp_path / "in.txt").write_text("hello world\n")
    folder = tmp_path / "outdir"
    folder.mkdir()
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(folder)) == 2
    assert f"error: output {folder} is an existing folder; it must name a file" in capsys.readouterr().err
    assert list(folder.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "outdir"]

    # a name ending in "/" wrote the file under the name without it
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), f"{tmp_path / 'new'}/") == 2
    assert f"error: output {tmp_path / 'new'}/ ends in '/', as a folder's name does; it must name a file" in \
        capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "outdir"]

    under = tmp_path / "in.txt" / "sub" / "out.h5"
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(under)) == 2
    err = capsys.readouterr().err
    assert f"error: output {under} cannot be created: {tmp_path / 'in.txt'} is an existing file, not a folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "outdir"]


def test_a_special_file_as_the_output_is_refused_and_a_link_written_through(elmo_fixture_dir, tmp_path, capsys):
    # the HDF5 was renamed over a FIFO or a device (as root, over /dev/null itself), exit 0
    (tmp_path / "in.txt").write_text("hello world\n")
    fifo, link_to_fifo = tmp_path / "fifo", tmp_path / "to_fifo"
    os.mkfifo(fifo)
    link_to_fifo.symlink_to(fifo)
    for output in (fifo, link_to_fifo):
        assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(output)) == 2
        assert (f"error: output {output} is not a regular file (a device, FIFO or socket); a file written there would "
                "replace it, so it is refused") in capsys.readouterr().err
    assert stat.S_ISFIFO(fifo.stat().st_mode) and link_to_fifo.is_symlink()
    link = tmp_path / "link.h5"
    link.symlink_to(tmp_path / "target.h5")  # dangling until written, as with a shell's `>`
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(link)) == 0
    assert link.is_symlink() and h5py.File(tmp_path / "target.h5", "r")["0"].shape == (3, 2, 32)


def test_an_input_whose_name_holds_a_chain_separator_is_named(elmo_fixture_dir, tmp_path, capsys):
    (tmp_path / "x::y.txt").write_text("hello world\n")
    assert _run(elmo_fixture_dir, str(tmp_path / "x::y.txt"), str(tmp_path / "out.h5")) == 2
    assert (f"cannot read {tmp_path / 'x::y.txt'}: FileNotFoundError: [Errno 2] its name holds '::', which fsspec "
            "reads as a chain of file systems") in capsys.readouterr().err


def test_the_input_file_is_never_the_output(elmo_fixture_dir, tmp_path, capsys):
    # "embed-file IN IN" replaced the text with the HDF5, exit 0
    text = "hello world\n"
    (tmp_path / "in.txt").write_text(text)
    (tmp_path / "link.txt").symlink_to(tmp_path / "in.txt")
    for output in (tmp_path / "in.txt", tmp_path / "link.txt"):
        assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(output)) == 2
        assert (f"error: output {output} is the input file, which this command reads: it would be replaced by the "
                "output") in capsys.readouterr().err
    assert (tmp_path / "in.txt").read_text() == text


def _keys_and_tokens(path) -> tuple[dict, dict]:
    with h5py.File(path, "r") as out:
        index = json.loads(out["sentence_to_index"][0])
        shapes = {k: out[k].shape[-2] for k in out if k != "sentence_to_index"}
    return index, shapes


def test_lines_are_read_as_extract_reads_text(elmo_fixture_dir, tmp_path):
    # a lone CR stays in its line (keys are the numbers of "\n" lines), CRLF loses its CR, a BOM is dropped
    (tmp_path / "in.txt").write_bytes(b"\xef\xbb\xbfone\rtwo three\r\nfour\n\n")
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "out.h5")) == 0
    index, tokens = _keys_and_tokens(tmp_path / "out.h5")
    assert index == {"one\rtwo three": "0", "four": "1", "": "2"}
    assert tokens == {"0": 3, "1": 1, "2": 0}


@pytest.mark.parametrize("data, message", [
    (b"fine\nbad \xff byte\n", "in.txt, line 2: invalid UTF-8 at byte 4: invalid start byte"),
    (b"fine\n\nnul \x00 here\n", "in.txt, line 3: text contains NUL characters"),
])
def test_a_line_extract_would_reject_stops_the_command_naming_it(elmo_fixture_dir, tmp_path, capsys, data, message):
    (tmp_path / "in.txt").write_bytes(data)
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "out.h5")) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]  # no output, no .partial


def test_tab_separated_fields_are_the_tokens_and_none_may_be_empty(elmo_fixture_dir, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("New York\tis\tbig\n\t\n \n\nx\n", encoding="utf-8")
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "out.h5"), "--tab-separated") == 0
    index, tokens = _keys_and_tokens(tmp_path / "out.h5")
    assert tokens == {"0": 3, "1": 0, "2": 0, "3": 0, "4": 1}  # blank lines (a lone tab too) have no tokens
    assert index["New York\tis\tbig"] == "0"

    for line, field in (("a\t\tb", "field 2 of 3"), ("a\tb\t", "field 3 of 3"), ("a\t \tb", "field 2 of 3")):
        (tmp_path / "bad.txt").write_text(f"fine\n{line}\n", encoding="utf-8")
        assert _run(elmo_fixture_dir, str(tmp_path / "bad.txt"), str(tmp_path / "bad.h5"), "--tab-separated") == 2
        assert f"bad.txt, line 2: {field} is empty or blank" in capsys.readouterr().err
        assert not (tmp_path / "bad.h5").exists()


def _save_overflowing_model(reference_model, folder) -> None:
    from elmo_pipeline import BiLM

    model = BiLM(reference_model.config, reference_model.vocab, chars=reference_model.chars)
    model.load_state_dict(reference_model.state_dict())
    with torch.no_grad():
        convolutions = [p for name, p in model.named_parameters() if "token_encoder" in name and p.dim() == 3]
        assert convolutions
        for p in convolutions:
            p.fill_(3e38)  # finite, so the model loads; its products overflow
    model.save_pretrained(str(folder))


def test_a_model_that_gives_non_finite_vectors_writes_nothing(reference_model, tmp_path, capsys):
    _save_overflowing_model(reference_model, tmp_path / "overflowing")
    (tmp_path / "in.txt").write_text("\nThe cat sat .\n", encoding="utf-8")
    out = tmp_path / "out.h5"
    assert main(["embed-file", str(tmp_path / "in.txt"), str(out), "--quiet", "--model",
                 str(tmp_path / "overflowing")]) == 2
    assert "line 2: the model gives NaN or infinite vectors for it; nothing was written" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "overflowing"]


def test_the_original_format_is_taken_as_model_options_weights_too(elmo_fixture_dir, tmp_path):
    # the README's form for every command; embed-file read "OPTIONS,WEIGHTS/config.json: file not found"
    (tmp_path / "in.txt").write_text("The cat sat .\n")
    pair = f"{elmo_fixture_dir / 'options.json'},{elmo_fixture_dir / 'lm_weights.hdf5'}"
    assert main(["embed-file", str(tmp_path / "in.txt"), str(tmp_path / "a.h5"), "--quiet", "--model", pair]) == 0
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "b.h5")) == 0
    with h5py.File(tmp_path / "a.h5", "r") as a, h5py.File(tmp_path / "b.h5", "r") as b:
        np.testing.assert_array_equal(a["0"][...], b["0"][...])


def test_sigterm_ends_embed_file_with_one_line_and_no_temporary_file(tmp_path):
    """Python's default SIGTERM (what `timeout` sends) ended the process at once: no message, and
    its `.partial` file stayed beside the output."""
    import signal
    import subprocess
    import sys
    import time

    src = tmp_path / "in.txt"
    src.write_text("".join(f"sentence {i} of a file that takes a while to embed .\n" for i in range(20_000)))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "elmo_pipeline.cli.main", "embed-file", str(src),
                             str(out / "vectors.hdf5"), "--quiet"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(p.name.endswith(".partial") for p in out.iterdir()):  # writing has begun
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] == "elmo-pipeline embed-file: terminated (SIGTERM)"
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("blank", ["options", "weights"])
def test_an_empty_options_or_weights_is_refused_by_name(elmo_fixture_dir, tmp_path, capsys, blank):
    # `--options "$OPTS"` with the variable unset: an empty --options was taken for none given, so
    # --weights was dropped and the embedded model wrote the file, with exit status 0
    (tmp_path / "in.txt").write_text("one two three\n")
    files = {"options": str(elmo_fixture_dir / "options.json"), "weights": str(elmo_fixture_dir / "lm_weights.hdf5")}
    files[blank] = ""
    assert main(["embed-file", str(tmp_path / "in.txt"), str(tmp_path / "out.h5"), "--quiet",
                 "--options", files["options"], "--weights", files["weights"]]) == 2
    assert capsys.readouterr().err == (f"elmo-pipeline embed-file: error: --{blank} '' names no file; give the "
                                       f"original {blank} file (path or URL)\n")
    assert not (tmp_path / "out.h5").exists()
    assert main(["import-allennlp", "--options", files["options"], "--weights", files["weights"],
                 "--output", str(tmp_path / "model")]) == 2
    assert f"error: --{blank} '' names no file" in capsys.readouterr().err
    assert not (tmp_path / "model").exists()


def test_an_empty_input_or_output_file_is_refused_by_name(tmp_path, capsys, monkeypatch):
    """`embed-file "$IN" "$OUT"` with a variable unset named the current folder instead: "cannot
    read : IsADirectoryError: [Errno 21] Is a directory: '/...'", "output  is an existing folder"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.txt").write_text("one two three\n")
    for argv, says in ((["", "out.h5"], "input_file '' names no file; give a path or URL (or - for standard input)"),
                       (["in.txt", ""], "output_file '' names no file; give a path or URL")):
        assert main(["embed-file", *argv, "--quiet"]) == 2
        assert capsys.readouterr().err == f"elmo-pipeline embed-file: error: {says}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_the_output_is_never_a_file_of_the_model(elmo_fixture_dir, tmp_path, capsys):
    # "embed-file in.txt lm_weights.hdf5 --options ... --weights lm_weights.hdf5" replaced the weights
    # with the HDF5 of the vectors, exit 0; so did an output naming a file of a --model folder
    for name in ("options.json", "lm_weights.hdf5"):
        (tmp_path / name).write_bytes((elmo_fixture_dir / name).read_bytes())
    options, weights = tmp_path / "options.json", tmp_path / "lm_weights.hdf5"
    assert main(["import-allennlp", "--options", str(options), "--weights", str(weights),
                 "--output", str(tmp_path / "model")]) == 0
    (tmp_path / "in.txt").write_text("hello world\n")
    (tmp_path / "link.h5").symlink_to(tmp_path / "model" / "model.safetensors")
    files = [options, weights, *(tmp_path / "model").iterdir()]
    before = {p: p.read_bytes() for p in files}
    cases = [(weights, ["--options", str(options), "--weights", str(weights)], weights),
             (options, ["--model", f"{options},{weights}"], options),
             (tmp_path / "model" / "config.json", ["--model", str(tmp_path / "model")],
              tmp_path / "model" / "config.json"),
             (tmp_path / "link.h5", ["--model", str(tmp_path / "model")], tmp_path / "model" / "model.safetensors")]
    capsys.readouterr()
    for output, model, named in cases:
        assert main(["embed-file", str(tmp_path / "in.txt"), str(output), "--quiet", *model]) == 2
        assert (f"error: output {output} is the model's file {named}, which this command reads: it would be "
                "replaced by the output") in capsys.readouterr().err
    assert {p: p.read_bytes() for p in files} == before
    # a new file in the model's folder is no file of the model
    assert main(["embed-file", str(tmp_path / "in.txt"), str(tmp_path / "model" / "out.h5"), "--quiet",
                 "--model", str(tmp_path / "model")]) == 0
    assert h5py.File(tmp_path / "model" / "out.h5", "r")["0"].shape == (3, 2, 32)


def test_a_failed_run_into_new_folders_leaves_none_of_them(reference_model, elmo_fixture_dir, tmp_path, capsys):
    # "nothing was written", and new/sub/ stayed behind, empty, where OUTPUT was new/sub/out.h5
    _save_overflowing_model(reference_model, tmp_path / "overflowing")
    (tmp_path / "in.txt").write_text("The cat sat .\n", encoding="utf-8")
    (tmp_path / "kept").mkdir()  # a folder that was there stays
    for output in (tmp_path / "new" / "sub" / "out.h5", tmp_path / "kept" / "new" / "out.h5"):
        assert main(["embed-file", str(tmp_path / "in.txt"), str(output), "--quiet",
                     "--model", str(tmp_path / "overflowing")]) == 2
        assert "line 1: the model gives NaN or infinite vectors for it; nothing was written" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "kept", "overflowing"]
    assert list((tmp_path / "kept").iterdir()) == []
    # a run that succeeds makes the folders its file goes in
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "new" / "sub" / "out.h5")) == 0
    assert h5py.File(tmp_path / "new" / "sub" / "out.h5", "r")["0"].shape == (3, 4, 32)


def test_an_output_replaced_keeps_its_mode(elmo_fixture_dir, tmp_path):
    # the file was replaced by one of the umask's mode: a private 0600 output came back 0644,
    # readable by every user, where writing into it (a shell's >, the original's h5py) keeps its mode
    (tmp_path / "in.txt").write_text("hello world\n")
    out = tmp_path / "out.h5"
    out.write_bytes(b"an earlier file")
    out.chmod(0o600)
    umask = os.umask(0o022)
    try:
        assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(out)) == 0
        assert stat.S_IMODE(out.stat().st_mode) == 0o600
        assert h5py.File(out, "r")["0"].shape == (3, 2, 32)
        assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "new.h5")) == 0
        assert stat.S_IMODE((tmp_path / "new.h5").stat().st_mode) == 0o644  # a new file: the umask's
    finally:
        os.umask(umask)


def test_a_batch_size_below_one_is_refused_before_the_model_loads(tmp_path, capsys):
    # "batch size must be >= 1" came only after the model had loaded (here: its absence was reported)
    (tmp_path / "in.txt").write_text("hello world\n")
    for size in ("0", "-3"):
        with pytest.raises(SystemExit) as exited:  # argparse's error
            main(["embed-file", str(tmp_path / "in.txt"), str(tmp_path / "o.h5"), "--batch-size", size,
                  "--model", str(tmp_path / "no-such-model")])
        assert exited.value.code == 2
        assert f"argument --batch-size: must be an integer >= 1, got {size}" in capsys.readouterr().err
    assert not (tmp_path / "o.h5").exists()


# -- the removed `allennlp elmo` command's input and flags ------------------------------------------
def test_standard_input_is_read_as_a_file_of_the_same_lines_would_be(elmo_fixture_dir, tmp_path, monkeypatch,
                                                                      capsys):
    # the original took `-` (argparse's FileType): `cat x | allennlp elmo - out.hdf5` was refused
    # here as "-: no such file"
    text = "\ufeffThe cat sat .\r\n\nA dog barked loudly .\n"
    (tmp_path / "in.txt").write_text(text, encoding="utf-8", newline="")
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "file.h5")) == 0
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(gzip.compress(text.encode()))))
    assert _run(elmo_fixture_dir, "-", str(tmp_path / "stdin.h5")) == 0
    with h5py.File(tmp_path / "file.h5", "r") as a, h5py.File(tmp_path / "stdin.h5", "r") as b:
        assert sorted(a) == sorted(b) == ["0", "1", "2", "sentence_to_index"]
        for key in a:
            np.testing.assert_array_equal(a[key][...], b[key][...])
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"fine\nbad \xff\n")))
    assert _run(elmo_fixture_dir, "-", str(tmp_path / "bad.h5")) == 2
    assert "memory://stdin, line 2: invalid UTF-8" in capsys.readouterr().err
    assert not (tmp_path / "bad.h5").exists()


def test_the_original_flags_run_as_they_did(elmo_fixture_dir, tmp_path):
    # --options-file, --weight-file, --cuda-device, --use-sentence-keys and --forget-sentences
    # were unknown arguments: a script written for `allennlp elmo` failed
    (tmp_path / "in.txt").write_text("The cat sat .\nA dog barked loudly .\n")
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "lines.h5"), "--top") == 0
    original = ["embed-file", str(tmp_path / "in.txt"), str(tmp_path / "keys.h5"), "--top", "--quiet",
                "--options-file", str(elmo_fixture_dir / "options.json"),
                "--weight-file", str(elmo_fixture_dir / "lm_weights.hdf5"), "--cuda-device", "-1"]
    assert main([*original, "--use-sentence-keys"]) == 0
    with h5py.File(tmp_path / "lines.h5", "r") as by_line, h5py.File(tmp_path / "keys.h5", "r") as by_text:
        assert sorted(by_text) == ["A dog barked loudly .", "The cat sat ."]  # no sentence_to_index
        np.testing.assert_array_equal(by_text["The cat sat ."][...], by_line["0"][...])
        np.testing.assert_array_equal(by_text["A dog barked loudly ."][...], by_line["1"][...])
    original[2] = str(tmp_path / "forget.h5")
    assert main([*original, "--forget-sentences"]) == 0
    with h5py.File(tmp_path / "forget.h5", "r") as forgot:
        assert sorted(forgot) == ["0", "1"]


@pytest.mark.parametrize("text, line, why", [
    ("one\ntwo\none\n", 3, "repeats line 1"),
    ("one\n\ntwo\n", 2, "is blank"),
    ("one\nand/or\n", 2, "holds '/', which HDF5 reads as groups"),
    (".\n", 1, "is '.', the file's own root"),
])
def test_sentence_keys_that_cannot_name_one_dataset_each_are_refused_naming_the_line(elmo_fixture_dir, tmp_path,
                                                                                     capsys, text, line, why):
    (tmp_path / "in.txt").write_text(text)
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "o.h5"), "--use-sentence-keys") == 2
    assert f"in.txt, line {line}: with sentence keys every sentence names its dataset, and this one {why}" in \
        capsys.readouterr().err
    assert not (tmp_path / "o.h5").exists()


@pytest.mark.parametrize("extra, message", [
    (["--options-file", "o.json"], "--options-file and --options name the same file: give one"),
    (["--weight-file", "w.hdf5"], "--weight-file and --weights name the same file: give one"),
    (["--cuda-device", "0", "--device", "cpu"], "--cuda-device 0 and --device cpu both name the device: give one"),
])
def test_an_original_flag_beside_ours_for_the_same_option_is_refused(elmo_fixture_dir, tmp_path, capsys, extra,
                                                                      message):
    (tmp_path / "in.txt").write_text("one\n")
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "o.h5"), *extra) == 2
    assert message in capsys.readouterr().err


def test_an_original_model_flag_alone_is_named_as_given(elmo_fixture_dir, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("one\n")
    options = str(elmo_fixture_dir / "options.json")
    assert main(["embed-file", str(tmp_path / "in.txt"), str(tmp_path / "o.h5"), "--options-file", options]) == 2
    assert "--options-file and --weights go together" in capsys.readouterr().err


def test_a_line_longer_than_max_sentence_tokens_is_refused_naming_it(elmo_fixture_dir, tmp_path, capsys):
    # a line is one sentence: a 100,251-token line took 11.8 GB with the default model, and a
    # longer one failed in torch's allocator naming no line
    (tmp_path / "in.txt").write_text("a b c d e\n\nf g h i j k l\n")
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "out.h5"),
                "--max-sentence-tokens", "6") == 2
    assert "in.txt, line 3: 7 tokens, more than --max-sentence-tokens 6" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]
    assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / "out.h5"),
                "--max-sentence-tokens", "7") == 0
    assert _keys_and_tokens(tmp_path / "out.h5")[1] == {"0": 5, "1": 0, "2": 7}


def test_a_batch_holds_at_most_batch_tokens_padded_tokens(elmo_fixture_dir, tmp_path):
    from elmo_pipeline.embedding.hdf5_file import _batches

    lengths = [1, 9, 2, 2, 0, 30, 3, 2]
    batches = list(_batches(lengths, 64, stateful=False, batch_tokens=12))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    # padded tokens: rows x (longest + <S> + </S>); a line over the budget is a batch alone
    assert [len(b) * (max(lengths[i] for i in b) + 2) for b in batches] == [12, 8, 5, 11, 32]
    assert list(_batches(lengths, 3, stateful=True, batch_tokens=12)) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    text = "".join(" ".join(f"w{n}x{k}" for k in range(n)) + "\n" for n in lengths)
    (tmp_path / "in.txt").write_text(text)
    for name, budget in (("small.h5", "12"), ("large.h5", "8192")):
        assert _run(elmo_fixture_dir, str(tmp_path / "in.txt"), str(tmp_path / name), "--batch-tokens", budget) == 0
    with h5py.File(tmp_path / "small.h5", "r") as small, h5py.File(tmp_path / "large.h5", "r") as large:
        for key in map(str, range(len(lengths))):
            assert small[key].shape == (3, lengths[int(key)], 32)
            np.testing.assert_array_equal(small[key][...], large[key][...])  # batch-invariant: the same bits


def test_the_lines_are_held_as_their_text_not_as_lists_of_tokens(reference_model, tmp_path, monkeypatch):
    """What embed-file holds while it embeds grows with the file's text (sentence_to_index needs every
    line), not with a str object per token: measured by tracemalloc as the first batch reaches the model
    (the lines read, counted and checked, the first batch's tokens cut), after 200 lines of 50 tokens of
    2 or 3 characters. Lists of str per line held some 60 bytes a token: some 600 KB here."""
    import tracemalloc

    from elmo_pipeline.embedding.hdf5_file import embed_file

    (tmp_path / "warm.txt").write_text("a b\n")  # what the first run of a process imports is not held per line
    embed_file(reference_model, str(tmp_path / "warm.txt"), str(tmp_path / "warm.h5"), show_progress=False)
    text = "".join(" ".join(f"w{(n + k) % 90}" for k in range(50)) + "\n" for n in range(200))
    (tmp_path / "in.txt").write_text(text)
    held: list[int] = []
    real_embed = reference_model.embed

    def embed_noting_memory(sentences):
        if not held:
            held.append(tracemalloc.get_traced_memory()[0] - before)
        return real_embed(sentences)

    monkeypatch.setattr(reference_model, "embed", embed_noting_memory)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        assert embed_file(reference_model, str(tmp_path / "in.txt"), str(tmp_path / "out.h5"), mode="top",
                          show_progress=False, batch_tokens=52 * 20) == 200
    finally:
        tracemalloc.stop()
    # the text once (the lines), each line's str header, list slot and count, and a batch of 20 lines'
    # tokens, with 32 KB to spare
    assert 0 < held[0] <= len(text) + 200 * (64 + 8 + 8) + 20 * 50 * 64 + 32 * 1024, held
    with h5py.File(tmp_path / "out.h5", "r") as out:
        assert len(out) == 201 and {out[str(i)].shape for i in range(200)} == {(50, 32)}
        assert json.loads(out["sentence_to_index"][0]) == {line: str(i) for i, line in enumerate(text.splitlines())}
