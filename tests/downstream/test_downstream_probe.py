"""The probe: it learns a synthetic task where one layer carries the label, and its mix spec goes
from `probe` to `extract --mix NAME=FILE` (the CLI end to end, with the reference model)."""

import dataclasses
import json
import shutil
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.cli.main import main
from elmo_pipeline.downstream.conll import LabelledSentence, read_conllu
from elmo_pipeline.downstream.dataset import ParquetFeatureDataset
from elmo_pipeline.downstream.probe import LabelTable, ProbeConfig, baselines, chart_fonts, plot_report, train_probes
from elmo_pipeline.corpus.records import EmbeddedSentence, Sentence
from elmo_pipeline.model.layers_digest import layers_sha256
from elmo_pipeline.model.scalar_mix import ScalarMix, load_mix_specs
from elmo_pipeline.corpus.schema import OutputSpec, build_table
from support import data_path, strict_json


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one thread is faster, and the CPU is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def synthetic_split(root, doc_id, n_sentences, means, rng, informative=1):
    """Sentence-layout features: layer `informative` = class mean + noise, the other layers noise."""
    n_labels, dim = means.shape
    spec = OutputSpec(n_layers=3, width=dim, layout="sentence", dtype="float16")
    items, labelled = [], []
    for i in range(n_sentences):
        n = int(rng.integers(3, 12))
        labels = rng.integers(0, n_labels, n)
        layers = rng.standard_normal((3, n, dim)).astype(np.float32)
        layers[informative] += means[labels]
        starts = np.arange(n, dtype=np.int64)
        tokens = tuple(f"t{k}" for k in range(n))
        items.append(EmbeddedSentence(Sentence(doc_id, i, 0, tokens, starts, starts + 1), layers, {}))
        labelled.append(LabelledSentence(tokens, tuple(f"L{c}" for c in labels)))
    root.mkdir()
    for part in range(2):  # two shards
        chunk = items[part::2]
        pq.write_table(build_table(chunk, spec), root / f"sentences-{part:05d}-of-00002.parquet")
    return labelled


@pytest.mark.parametrize("informative", [0, 1, 2])
def test_probe_finds_the_layer_that_carries_the_label(tmp_path, informative):
    rng = np.random.default_rng(informative)
    means = 2.0 * rng.standard_normal((4, 16)).astype(np.float32) / 4 ** 0.5
    train = synthetic_split(tmp_path / "train", "train", 400, means, rng, informative)
    dev = synthetic_split(tmp_path / "dev", "dev", 100, means, rng, informative)
    names = [f"L{c}" for c in range(4)]
    config = ProbeConfig(epochs=3, batch_sentences=16, shuffle_buffer=64, seed=0)
    result = train_probes(
        ParquetFeatureDataset(str(tmp_path / "train"), batch_sentences=16, shuffle_buffer=64),
        ParquetFeatureDataset(str(tmp_path / "dev"), batch_sentences=64),
        LabelTable("train", train, names), LabelTable("dev", dev, names), 4, config)
    acc, w = result.accuracy, result.mix_weights
    others = [j for j in range(3) if j != informative]
    assert acc[f"layer_{informative}"] > 0.85 and acc["mix"] > 0.85
    assert all(acc[f"layer_{j}"] < 0.45 for j in others)  # chance is 0.25
    assert w[informative] > 0.75 and all(w[j] < 0.15 for j in others), w  # measured over 5 seeds: > 0.85 and < 0.08
    assert result.best_layer == f"layer_{informative}"
    assert abs(sum(w) - 1) < 1e-6 and result.gamma > 0
    spec = result.mix_spec()
    assert torch.allclose(torch.softmax(torch.tensor(spec.weights), 0), torch.tensor(w))


def test_features_with_a_shard_lost_or_repeated_are_refused_not_scored(tmp_path):
    """Train and dev must each cover every token of their labelled file once: a lost shard would
    score dev on part of it (next to baselines over all of it), a repeated one count it twice."""
    rng = np.random.default_rng(0)
    means = rng.standard_normal((2, 8)).astype(np.float32)
    train = synthetic_split(tmp_path / "train", "train", 40, means, rng)
    dev = synthetic_split(tmp_path / "dev", "dev", 20, means, rng)
    names = ["L0", "L1"]
    shards = {split: sorted(str(p) for p in (tmp_path / split).glob("*.parquet")) for split in ("train", "dev")}
    config = ProbeConfig(epochs=1, shuffle_buffer=0)
    dev_tokens = sum(len(s.tokens) for s in dev)
    result = train_probes(ParquetFeatureDataset(shards["train"]), ParquetFeatureDataset(shards["dev"]),
                          LabelTable("train", train, names), LabelTable("dev", dev, names), 2, config,
                          show_progress=False)
    assert result.dev_tokens == dev_tokens and result.train_tokens == sum(len(s.tokens) for s in train)
    half = sum(len(s.tokens) for s in dev[::2])
    copy = shutil.copy(shards["dev"][0], tmp_path / "copy.parquet")
    for files, held, short, over in (([shards["dev"][0]], half, 10, 0),
                                     ([shards["dev"][0], str(copy), shards["dev"][1]], dev_tokens + half, 0, 10)):
        with pytest.raises(ValueError, match=rf"^the dev features hold {held} token rows for the {dev_tokens} tokens "
                                             rf"of dev's labelled file \({short} sentences short, {over} read more than "
                                             r"once\): shards of the features are missing or repeated"):
            train_probes(ParquetFeatureDataset(shards["train"]), ParquetFeatureDataset(files),
                         LabelTable("train", train, names), LabelTable("dev", dev, names), 2, config,
                         show_progress=False)
    with pytest.raises(ValueError, match=r"^the train features hold .* \(20 sentences short, 0 read more than once\)"):
        train_probes(ParquetFeatureDataset(shards["train"][1:]), ParquetFeatureDataset(shards["dev"]),
                     LabelTable("train", train, names), LabelTable("dev", dev, names), 2, config, show_progress=False)


def test_baselines():
    train = [LabelledSentence(("a", "b", "a"), ("X", "Y", "X")), LabelledSentence(("b",), ("Z",))]
    dev = [LabelledSentence(("a", "b", "c"), ("X", "Z", "X"))]
    got = baselines(train, dev)
    assert got["majority_label"] == pytest.approx(2 / 3)
    assert got["word_majority_label"] == pytest.approx(2 / 3)  # b -> Y (tie broken by first seen), c -> X


def cut_conllu(src, dst, n):
    lines, k = [], 0
    with open(src, encoding="utf-8") as f:
        for line in f:
            lines.append(line)
            if not line.strip():
                k += 1
                if k == n:
                    break
    dst.write_text("".join(lines), encoding="utf-8")


def mini_ewt(root, n_train: int, n_dev: int) -> tuple:
    """`root/data` with the first sentences of UD EWT train and dev, and the reference model's
    OPTIONS,WEIGHTS."""
    ewt = data_path("ud_english_ewt")
    elmo = data_path("allennlp_elmo")
    data = root / "data"
    data.mkdir()
    cut_conllu(ewt / "en_ewt-ud-train.conllu", data / "mini-train.conllu", n_train)
    cut_conllu(ewt / "en_ewt-ud-dev.conllu", data / "mini-dev.conllu", n_dev)
    return data, f"{elmo / 'options.json'},{elmo / 'lm_weights.hdf5'}"


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    """`elmo-pipeline probe` on 60 train / 20 dev sentences of UD EWT with the reference model."""
    root = tmp_path_factory.mktemp("probe")
    data, model = mini_ewt(root, 60, 20)
    out = root / "out"
    rc = main(["probe", str(data), "--output", str(out), "--model", model, "--epochs", "2", "--layout", "token",
               "--dtype", "float32", "--mix-name", "upos", "--threads", "1"])
    assert rc == 0
    return data, out, model


def test_probe_outputs(probe_run):
    data, out, _ = probe_run
    report = strict_json((out / "report.json").read_text())
    assert list(strict_json((out / "mix.json").read_text())) == ["upos"]
    for split in ("train", "dev"):
        shard = next((out / "features" / split).glob("*.parquet"))
        assert strict_json(pq.read_schema(shard).metadata[b"elmo_pipeline"])["dtype"] == "float32"
    assert set(report["accuracy"]) == {"layer_0", "layer_1", "layer_2", "mix"}
    assert all(0 <= v <= 1 for v in report["accuracy"].values())
    assert len(report["mix"]["weights"]) == 3 and sum(report["mix"]["weights"]) == pytest.approx(1, abs=1e-6)
    assert report["extraction"]["tokens_reconcile"] and report["task"]["train_sentences"] == 60
    assert report["dev_tokens"] == sum(len(s.tokens) for s in read_conllu(str(data / "mini-dev.conllu")))
    assert (out / "probe.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_probe_features_are_the_files_own_tokens(probe_run):
    data, out, model_location = probe_run
    sentences = list(read_conllu(str(data / "mini-dev.conllu")))
    table = pq.read_table(out / "features" / "dev").sort_by([("sentence_index", "ascending"),
                                                             ("token_index", "ascending")])
    assert table.column("token").to_pylist() == [t for s in sentences for t in s.tokens]
    model = BiLM.load(model_location).eval()
    with torch.no_grad():
        emb = model.embed([list(s.tokens) for s in sentences[:5]])
    first = sum(len(s.tokens) for s in sentences[:5])
    for j in range(3):
        stored = np.stack(table.column(f"layer_{j}").to_numpy(zero_copy_only=False)[:first])
        np.testing.assert_allclose(stored, emb.layers[j][emb.mask].numpy(), atol=1e-5)


def test_learned_mix_goes_from_probe_to_extract(probe_run, tmp_path):
    _, out, model = probe_run
    specs = load_mix_specs((out / "mix.json").read_text(), "mix.json")
    assert list(specs) == ["upos"]
    report = json.loads((out / "report.json").read_text())
    assert list(specs["upos"].weights) == pytest.approx(report["mix"]["raw_weights"])
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The probe learned a mix.\nExtract applies it to the whole corpus today.\n")
    rc = main(["extract", "--input", str(corpus), "--output", str(tmp_path / "features"), "--model", model,
               "--mix", f"upos={out / 'mix.json'}", "--dtype", "float32", "--batch-tokens", "64"])
    assert rc == 0
    table = pq.ParquetDataset(sorted((tmp_path / "features").glob("tokens-*.parquet"))).read()
    assert table.num_rows > 10
    layers = torch.stack([torch.tensor(np.stack(table.column(f"layer_{j}").to_numpy(zero_copy_only=False)))
                          for j in range(3)])
    expected = ScalarMix.from_spec(specs["upos"])(layers).detach().numpy()
    mixed = np.stack(table.column("mix_upos").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(mixed, expected, rtol=1e-5, atol=1e-5)
    meta = json.loads(pq.read_schema(next((tmp_path / "features").glob("tokens-*.parquet"))).metadata[b"elmo_pipeline"])
    assert meta["mixes"]["upos"]["weights"] == pytest.approx(report["mix"]["raw_weights"])


def test_probe_options_out_of_range_and_fp16_on_cpu_stop_before_the_extraction(probe_run, tmp_path, capsys):
    data, _, model = probe_run
    for extra, says in ((["--epochs", "0"], "--epochs must be >= 1, got 0"),
                        (["--batch-sentences", "0"], "--batch-sentences must be >= 1, got 0"),
                        (["--dropout", "1.5"], "--dropout must be in [0, 1), got 1.5"),
                        (["--lr", "nan"], "--lr must be > 0 and at most 3.403e+38, got nan"),
                        # finite, but not in the optimizer's float32: torch's error named no option
                        (["--mix-lr", "1e39"], "--mix-lr must be > 0 and at most 3.403e+38, got 1e+39"),
                        (["--l2", "inf"], "--l2 must be >= 0 and at most 3.403e+38, got inf"),
                        (["--precision", "fp16", "--device", "cpu"], "fp16")):
        out = tmp_path / "out"
        assert main(["probe", str(data), "--output", str(out), "--model", model, *extra]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err
        assert not (out / "features").exists()  # nothing was extracted


def test_reused_features_with_a_shard_cut_short_are_refused(probe_run, tmp_path, capsys):
    """--reuse-features re-checks the files' digests and the model, not the rows: half a dev shard
    (its metadata kept) was scored as if it were the whole dev file."""
    data, out, model = probe_run
    reused = tmp_path / "reused"
    shutil.copytree(out, reused)
    shard = next((reused / "features" / "dev").glob("tokens-*.parquet"))
    table = pq.read_table(shard)
    pq.write_table(table.slice(0, table.num_rows // 2), shard)
    assert main(["probe", str(data), "--output", str(reused), "--model", model, "--reuse-features",
                 "--epochs", "1", "--mix-name", "upos"]) == 2
    dev_tokens = sum(len(s.tokens) for s in read_conllu(str(data / "mini-dev.conllu")))
    assert (f"the dev features hold {table.num_rows // 2} token rows for the {dev_tokens} tokens of dev's labelled "
            "file") in capsys.readouterr().err
    assert (reused / "report.json").read_bytes() == (out / "report.json").read_bytes()  # not rewritten


def test_a_learned_gamma_past_a_mix_specs_range_names_mix_lr_and_leaves_the_earlier_run_whole(probe_run, tmp_path,
                                                                                              capsys):
    """It failed inside pydantic after report.json was replaced: one run's report beside another
    run's mix.json and probe.png."""
    data, out, model = probe_run
    reused = tmp_path / "reused"
    shutil.copytree(out, reused)
    assert main(["probe", str(data), "--output", str(reused), "--model", model, "--reuse-features", "--epochs", "2",
                 "--mix-lr", "1e6", "--mix-name", "upos"]) == 2
    err = capsys.readouterr().err
    assert "error: the learned mix is not a valid mix spec (gamma " in err and "train it with a smaller --mix-lr" in err
    for name in ("report.json", "mix.json", "probe.png"):
        assert (reused / name).read_bytes() == (out / name).read_bytes(), name


def test_reused_features_must_be_those_of_the_files(probe_run, tmp_path, capsys):
    data, out, model = probe_run
    reused = tmp_path / "reused"
    shutil.copytree(out, reused)
    other = tmp_path / "other.conllu"
    cut_conllu(data / "mini-train.conllu", other, 5)
    assert main(["probe", "--train", str(other), "--dev", str(data / "mini-dev.conllu"), "--output", str(reused),
                 "--model", model, "--reuse-features", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{reused / 'features' / 'train'} holds the features of" in err and str(other) in err
    assert (reused / "report.json").read_bytes() == (out / "report.json").read_bytes()  # not rewritten
    # the same content under another path is the same file; another content under that path is not
    shutil.copy(data / "mini-train.conllu", other)
    assert main(["probe", "--train", str(other), "--dev", str(data / "mini-dev.conllu"), "--output", str(reused),
                 "--model", model, "--reuse-features", "--epochs", "1"]) == 0
    capsys.readouterr()
    cut_conllu(data / "mini-train.conllu", other, 5)
    assert main(["probe", "--train", str(other), "--dev", str(data / "mini-dev.conllu"), "--output", str(reused),
                 "--model", model, "--reuse-features", "--epochs", "1"]) == 2
    assert "as they are now: run probe without --reuse-features" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["task", "model"])
def test_the_chart_takes_dollars_in_the_task_and_model_names_as_text(field):
    """Matplotlib read the text between two `$` of the task name (--name, or the file names) or
    the model's name as TeX: an unknown command failed the run after its training."""
    names = {"task": "UPOS", "model": "small"}
    names[field] = "costs in $\\foo$"
    png = plot_report(_report_named(names["task"], names["model"]))
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_a_learned_mix_is_applied_only_to_the_model_it_was_learned_on(probe_run, tmp_path, capsys):
    # mix.json recorded no model: a mix of the reference model's three layers was applied to
    # the default model's three layers without a word
    _, out, model = probe_run
    spec = load_mix_specs((out / "mix.json").read_text(), "mix.json")["upos"]
    digest = layers_sha256(BiLM.load(model))
    assert spec.layers_sha256 == digest == json.loads((out / "report.json").read_text())["model"]["layers_sha256"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("A mix weighs one model's layers.\n")
    mix = f"upos={out / 'mix.json'}"
    capsys.readouterr()
    assert main(["extract", "--input", str(corpus), "--output", str(tmp_path / "other"), "--mix", mix]) == 2
    err = capsys.readouterr().err
    assert f"layers of another model (its layers_sha256 {digest[:12]}" in err and "--model" in err
    assert not (tmp_path / "other").exists()
    # the same model in another format (the folder import-allennlp makes of its two files): other
    # files, so another checksum, and the same layers, so the mix applies
    options, weights = model.split(",")
    imported = tmp_path / "imported"
    assert main(["import-allennlp", "--options", options, "--weights", weights, "--output", str(imported)]) == 0
    assert BiLM.load(str(imported)).checksum != BiLM.load(model).checksum
    assert main(["extract", "--input", str(corpus), "--output", str(tmp_path / "same"), "--model", str(imported),
                 "--mix", mix, "--layers", "none"]) == 0
    meta = json.loads(pq.read_schema(next((tmp_path / "same").glob("tokens-*.parquet"))).metadata[b"elmo_pipeline"])
    assert meta["model"]["layers_sha256"] == digest and meta["mixes"]["upos"]["layers_sha256"] == digest
    # without the record (a hand-written file, or the record removed on purpose) it applies anywhere
    (tmp_path / "mix.json").write_text(json.dumps({"upos": {"weights": list(spec.weights), "gamma": spec.gamma}}))
    assert main(["extract", "--input", str(corpus), "--output", str(tmp_path / "any"), "--mix",
                 f"upos={tmp_path / 'mix.json'}", "--layers", "none"]) == 0
    meta = json.loads(pq.read_schema(next((tmp_path / "any").glob("tokens-*.parquet"))).metadata[b"elmo_pipeline"])
    assert meta["mixes"] == {"upos": {"weights": list(spec.weights), "gamma": spec.gamma, "layer_norm": False}}


def test_probe_threads_reach_the_extraction_workers(tmp_path, monkeypatch):
    # --threads set torch's count in the launching process only: a multi_processing worker
    # embedded with its share of the cores instead, whatever --threads said
    from elmo_pipeline.pipelines import probe as probe_job

    asked = []

    class Recorded(probe_job.EmbedSentences):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            asked.append(self.handler.torch_threads)

    monkeypatch.setattr(probe_job, "EmbedSentences", Recorded)
    data, model = mini_ewt(tmp_path, 8, 4)
    before = torch.get_num_threads()
    try:
        assert main(["probe", str(data), "--output", str(tmp_path / "out"), "--model", model, "--epochs", "1",
                     "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(before)
    assert asked == [1, 1]  # the train and dev extractions' handlers, as each worker sets it
    report = strict_json((tmp_path / "out" / "report.json").read_text())
    assert report["extraction"]["tokens_reconcile"] and report["task"]["train_sentences"] == 8


def _report_named(task: str, model: str = "small") -> dict:
    """A report of two layers and a mix, with this task and model name, for plot_report."""
    return {"task": {"name": task, "label": "upos"}, "model": {"name": model, "sha256": "ab" * 32},
            "accuracy": {"layer_0": 0.5, "layer_1": 0.75, "mix": 0.8}, "mix": {"weights": [0.4, 0.6], "gamma": 1.0},
            "baselines": {"majority_label": 0.2}}


def test_a_name_in_another_script_is_drawn_with_an_installed_font_that_has_it(caplog):
    """matplotlib looks for glyphs only in DejaVu Sans: a task name (the file names by default) or
    model name in a script it lacks was drawn as boxes, a box per block (Ⓐ and Ⓑ alike), with a
    UserWarning per glyph on stderr ('Glyph 9398 ... missing from font(s) DejaVu Sans'). A font
    installed here that has them draws them (STIXGeneral, shipped with matplotlib, has Ⓐ and Ⓑ);
    characters no font here has are named once, in one log line."""
    from matplotlib import font_manager

    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        circled_a, circled_b = plot_report(_report_named("UPOS Ⓐ")), plot_report(_report_named("UPOS Ⓑ"))
    assert [str(w.message) for w in warned] == []
    assert circled_a != circled_b  # two glyphs drawn, not one block's box twice
    assert "no font installed here" not in caplog.text

    fonts_with_han = [entry.name for entry in font_manager.fontManager.ttflist if not entry.name.startswith("Last Resort")
                      and 0x4E2D in font_manager.get_font(entry.fname).get_charmap()]
    if fonts_with_han:
        pytest.skip(f"{fonts_with_han[0]} draws Chinese here")
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        png = plot_report(_report_named("中文-train.conllu -> 中文-dev.conllu"))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert [str(w.message) for w in warned] == []
    assert [r.getMessage() for r in caplog.records] == [
        "probe.png: no font installed here has 中 文 (of the task or model name), drawn as boxes; report.json holds "
        "the name (a font with them, such as Noto Sans CJK for Chinese, draws them)"]


def test_the_fonts_a_name_falls_back_on_are_the_same_in_any_font_cache_and_draw_what_they_are_taken_for(monkeypatch):
    """chart_fonts took the first face in matplotlib's font cache that held a character DejaVu Sans
    lacks, and the cache lists faces in the order of a set of paths where it was built: 'UPOS ⌒'
    fell back on DejaVu Sans Mono under one order and STIXGeneral under another (two PNGs of one
    report, as between two machines); and a family was taken on the strength of any of its faces,
    though matplotlib draws it with its regular one: with bold faces listed first, '𝗔' (of the
    DejaVu Sans faces, the bold one's alone) was a box, named by no line, its warning silenced."""
    from matplotlib import font_manager

    name = "UPOS ⌒ Ϳ 𝗔 Ⓐ ꚙ"
    faces = list(font_manager.fontManager.ttflist)
    by_name = sorted(faces, key=lambda face: (face.name, face.fname))
    bold_first = sorted(by_name, key=lambda face: font_manager.weight_dict.get(face.weight, face.weight) != 700)
    charts = []
    # the same fonts as four caches could list them; the cache's own order first, for matplotlib's
    # lookups (which it keeps) to be made in it
    for order in (faces, by_name, by_name[::-1], bold_first):
        monkeypatch.setattr(font_manager.fontManager, "ttflist", order)
        for text in (name, "UPOS 𝗔"):
            families, missing = chart_fonts([text])
            drawn = {chr(c) for family in families for c in _glyphs_drawn(font_manager, family)}
            assert {c for c in text if not c.isspace()} - set(missing) <= drawn, (text, families)
        charts.append((chart_fonts([name]), plot_report(_report_named(name))))
    assert charts[0] == charts[1] == charts[2] == charts[3]
    assert "STIXGeneral" in charts[0][0][0]  # Ⓐ: the one font here that has it
    # a family without a face of weight 400 (CJK fonts may have a medium one alone) is drawn with
    # the face it has
    medium_only = [dataclasses.replace(face, weight=500) for face in faces
                   if (face.name, face.style, face.weight) == ("STIXGeneral", "normal", 400)][:1]
    monkeypatch.setattr(font_manager.fontManager, "ttflist",
                        [face for face in faces if face.name != "STIXGeneral"] + medium_only)
    assert chart_fonts(["UPOS Ⓐ"]) == (["sans-serif", "STIXGeneral"], "")


def _glyphs_drawn(font_manager, family: str) -> set[int]:
    """The code points of the face matplotlib draws `family` with."""
    return set(font_manager.get_font(font_manager.findfont(font_manager.FontProperties(family=[family]))).get_charmap())


def test_labelled_file_urls_are_recorded_without_their_password(probe_run, tmp_path, capsys):
    """report.json and every feature file's metadata held --train and --dev as given:
    http://user:pw@host/train.conllu wrote the password into both. They hold the URL without it
    (its query kept, as extract's ids keep it), and --reuse-features with another password reuses."""
    from support import HttpServer

    data, _, model = probe_run
    cut_conllu(data / "mini-train.conllu", tmp_path / "train.conllu", 8)
    cut_conllu(data / "mini-dev.conllu", tmp_path / "dev.conllu", 4)
    server = HttpServer(tmp_path)
    try:
        given, shown = server.url.replace("://", "://user:pw-7Hq@", 1) + "/ok/", f"{server.url}/ok/"
        out = tmp_path / "out"
        command = ["probe", "--output", str(out), "--model", model, "--epochs", "1", "--threads", "1"]
        assert main([*command, "--train", given + "train.conllu?v=1", "--dev", given + "dev.conllu"]) == 0
        expected = {"train": shown + "train.conllu?v=1", "dev": shown + "dev.conllu"}
        assert strict_json((out / "report.json").read_text())["task"]["files"] == expected
        for split in ("train", "dev"):
            [shard] = (out / "features" / split).glob("*.parquet")
            assert strict_json(pq.read_schema(shard).metadata[b"elmo_pipeline"])["tokenizer"]["files"] == expected
        written = b"".join(p.read_bytes() for p in out.rglob("*") if p.is_file())
        assert [secret for secret in (b"user:", b"pw-7Hq") if secret in written] == []
        renewed = server.url.replace("://", "://user:pw-renewed@", 1) + "/ok/"
        assert main([*command, "--train", renewed + "train.conllu?v=1", "--dev", renewed + "dev.conllu",
                     "--reuse-features"]) == 0
    finally:
        server.close()
