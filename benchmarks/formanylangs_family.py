"""ELMoForManyLangs models for tests and benchmarks: a writer of random models in that family's
released layout, and an independent reference of what its `Embedder` computes, written from the family's
architecture (not from our model's code): the ids as its batcher builds them, the CNN token
embedder with its own highway parametrisation and [word ; char] concatenation, and the
projected LSTM cell stepped one time step at a time in float64.

`reference_layers` reproduces the real fixture (`fixture_small`, made by the family's own code)
to 1e-6 (tests/formats/test_formanylangs.py checks it), which is what makes it a trustworthy
reference for the random models of other shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

CHAR_SPECIALS_IN_TRAINER_ORDER = ["<bos>", "<eos>", "<oov>", "<pad>", "<bow>", "<eow>"]
WORD_SPECIALS_IN_TRAINER_ORDER = ["<oov>", "<bos>", "<eos>", "<pad>"]


def network(word_dim=8, char_dim=6, filters=((1, 4), (2, 6), (3, 5)), n_highway=1, activation="relu",
            max_chars=12, dim=10, projection_dim=6, n_layers=2, cell_clip=3, proj_clip=3, **extra) -> dict:
    return {"encoder": {"name": "elmo", "projection_dim": projection_dim, "cell_clip": cell_clip,
                        "proj_clip": proj_clip, "dim": dim, "n_layers": n_layers},
            "token_embedder": {"name": "cnn", "activation": activation, "filters": [list(f) for f in filters],
                               "n_highway": n_highway, "word_dim": word_dim, "char_dim": char_dim,
                               "max_characters_per_token": max_chars},
            "classifier": {"name": "sampled_softmax", "n_samples": 8192}, "dropout": 0.1, **extra}


def random_state(net: dict, n_chars: int, n_words: int, seed: int = 0, scale: float = 0.3) -> tuple[dict, dict]:
    """(token_embedder state dict, encoder state dict) under the family's names, values N(0, scale)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * scale

    te_cfg, enc_cfg = net["token_embedder"], net["encoder"]
    n_filters = sum(n for _, n in te_cfg["filters"])
    te = {}
    if te_cfg["word_dim"]:
        te["word_emb_layer.embedding.weight"] = r(n_words, te_cfg["word_dim"])
    te["char_emb_layer.embedding.weight"] = r(n_chars, te_cfg["char_dim"])
    for k, (width, n) in enumerate(te_cfg["filters"]):
        te[f"convolutions.{k}.weight"] = r(n, te_cfg["char_dim"], width)
        te[f"convolutions.{k}.bias"] = r(n)
    for k in range(te_cfg["n_highway"]):
        te[f"highways._layers.{k}.weight"] = r(2 * n_filters, n_filters)
        te[f"highways._layers.{k}.bias"] = r(2 * n_filters)
    p, h = enc_cfg["projection_dim"], enc_cfg["dim"]
    te["projection.weight"] = r(p, te_cfg["word_dim"] + n_filters)
    te["projection.bias"] = r(p)
    enc = {}
    for layer in range(enc_cfg["n_layers"]):
        for direction in ("forward", "backward"):
            base = f"{direction}_layer_{layer}"
            enc[f"{base}.input_linearity.weight"] = r(4 * h, p)
            enc[f"{base}.state_linearity.weight"] = r(4 * h, p)
            enc[f"{base}.state_linearity.bias"] = r(4 * h)
            enc[f"{base}.state_projection.weight"] = r(p, h)
    return te, enc


def write_dic(path: Path, entries: list[str]) -> None:
    """`token<TAB>id` lines as the family's trainer writes them."""
    path.write_text("".join(f"{token}\t{i}\n" for i, token in enumerate(entries)), encoding="utf-8")


def write_model(folder: Path, net: dict, chars: list[str], words: list[str], seed: int = 0, scale: float = 0.3,
                config_name: str = "net.json", config_path: str | None = None, legacy: bool = True) -> Path:
    """A random model in the released layout; `chars` and `words` without their specials."""
    folder.mkdir(parents=True, exist_ok=True)
    char_entries = [*chars, *CHAR_SPECIALS_IN_TRAINER_ORDER]
    word_entries = [*WORD_SPECIALS_IN_TRAINER_ORDER, *words]
    te, enc = random_state(net, len(char_entries), len(word_entries), seed, scale)
    (folder / config_name).write_text(json.dumps(net, indent=2, allow_nan=False))
    (folder / "config.json").write_text(json.dumps({"seed": seed, "config_path": config_path or config_name,
                                                    "model": "output", "batch_size": 32}))
    write_dic(folder / "char.dic", char_entries)
    write_dic(folder / "word.dic", word_entries)
    options = {} if not legacy else {"_use_new_zipfile_serialization": False}
    torch.save(te, folder / "token_embedder.pkl", **options)
    torch.save(enc, folder / "encoder.pkl", **options)
    return folder


# -- the reference -------------------------------------------------------------------------------
def _dictionary(path: Path) -> dict[str, int]:
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f.read().splitlines():
            fields = line.strip().split("\t")
            if len(fields) == 1:
                fields = ["\u3000", fields[0]]
            out[fields[0]] = int(fields[1])
    return out


def _cell(x, h, c, w_in, w_state, b_state, w_proj, cell_clip, proj_clip):
    gates = x @ w_in.T + h @ w_state.T + b_state
    i, f, g, o = np.split(gates, 4)
    sig = lambda v: 1.0 / (1.0 + np.exp(-v))  # noqa: E731
    c = sig(i) * np.tanh(g) + sig(f) * c
    if cell_clip:
        c = np.clip(c, -cell_clip, cell_clip)
    h = (sig(o) * np.tanh(c)) @ w_proj.T
    if proj_clip:
        h = np.clip(h, -proj_clip, proj_clip)
    return h, c


def _token_vector(token: str, chars: dict, words: dict | None, te: dict, spec: dict) -> np.ndarray:
    max_chars = spec["max_characters_per_token"]
    row = [chars["<pad>"]] * max_chars
    row[0] = chars["<eow>"]
    inner = [chars[token]] if token in ("<bos>", "<eos>") else [chars.get(ch, chars["<oov>"]) for ch in token]
    row[1 : 1 + len(inner)] = inner
    row[1 + len(inner)] = chars["<bow>"]
    emb = te["char_emb_layer.embedding.weight"][row]  # (C, d)
    act = np.tanh if spec["activation"] == "tanh" else (lambda v: np.maximum(v, 0.0))
    pooled = []
    for k, (width, n) in enumerate(spec["filters"]):
        w, b = te[f"convolutions.{k}.weight"], te[f"convolutions.{k}.bias"]  # (n, d, width)
        windows = np.stack([emb[s : s + width] for s in range(max_chars - width + 1)])  # (P, width, d)
        conv = np.einsum("pwd,ndw->pn", windows, w) + b
        pooled.append(act(conv.max(axis=0)))
    x = np.concatenate(pooled)
    n_filters = x.shape[0]
    for k in range(spec["n_highway"]):
        proj = te[f"highways._layers.{k}.weight"] @ x + te[f"highways._layers.{k}.bias"]
        gate = 1.0 / (1.0 + np.exp(-proj[n_filters:]))
        x = gate * x + (1.0 - gate) * np.maximum(proj[:n_filters], 0.0)
    if spec["word_dim"]:
        word = te["word_emb_layer.embedding.weight"][words.get(token, words["<oov>"])]
        x = np.concatenate([word, x])
    return te["projection.weight"] @ x + te["projection.bias"]


def reference_layers(folder: Path, sentence: list[str], network_config: dict | None = None) -> np.ndarray:
    """(n_layers + 1, len(sentence), 2P) float64: what the family's Embedder gives, zero state."""
    folder = Path(folder)
    if network_config is None:
        network_config = json.loads((folder / json.loads((folder / "config.json").read_text())["config_path"]).read_text())
    spec, enc_spec = network_config["token_embedder"], network_config["encoder"]
    te = {k: v.double().numpy() for k, v in torch.load(folder / "token_embedder.pkl", weights_only=True).items()}
    enc = {k: v.double().numpy() for k, v in torch.load(folder / "encoder.pkl", weights_only=True).items()}
    chars = _dictionary(folder / "char.dic")
    words = _dictionary(folder / "word.dic") if spec["word_dim"] else None
    cut = spec["max_characters_per_token"] - 2
    tokens = ["<bos>", *(t[:cut] for t in sentence), "<eos>"]
    xs = np.stack([_token_vector(t, chars, words, te, spec) for t in tokens])
    layers = [np.concatenate([xs, xs], axis=1)]
    inputs = {"forward": xs, "backward": xs}
    p, h = enc_spec["projection_dim"], enc_spec["dim"]
    for layer in range(enc_spec["n_layers"]):
        outputs = {}
        for direction, steps in (("forward", range(len(tokens))), ("backward", reversed(range(len(tokens))))):
            base = f"{direction}_layer_{layer}"
            hs, cs = np.zeros(p), np.zeros(h)
            out = np.zeros((len(tokens), p))
            for t in steps:
                hs, cs = _cell(inputs[direction][t], hs, cs, enc[f"{base}.input_linearity.weight"],
                               enc[f"{base}.state_linearity.weight"], enc[f"{base}.state_linearity.bias"],
                               enc[f"{base}.state_projection.weight"], enc_spec["cell_clip"], enc_spec["proj_clip"])
                out[t] = hs
            outputs[direction] = out + (inputs[direction] if layer > 0 else 0.0)
        layers.append(np.concatenate([outputs["forward"], outputs["backward"]], axis=1))
        inputs = outputs
    return np.stack(layers)[:, 1:-1]
