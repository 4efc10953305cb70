"""The bidirectional language model: token encoder + forward/backward LSTM stacks.

`BiLM.embed` is the entry point for feature extraction: it takes tokenized sentences and
returns the L + 1 ELMo layers, boundaries removed:
    layer 0:      [x_k ; x_k]                  the context-free token representation, twice
    layer j >= 1: [forward_j(k) ; backward_j(k)]
Every sentence starts from a zero state, so its vectors never depend on its batch. The
original's stateful behaviour is `CarriedState`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn

from elmo_pipeline.formats.pretrained import Pretrained
from elmo_pipeline.model.characters import SENTENCE_END, SENTENCE_START, tokens_char_ids
from elmo_pipeline.model.config import ElmoConfig
from elmo_pipeline.model.lstm import AUTO, BiLstmStack, LstmState, check_kernel, forget_casts
from elmo_pipeline.model.softmax import LmOutputLayer
from elmo_pipeline.model.token_encoder import TokenEncoder
from elmo_pipeline.model.vocabulary import FORMANYLANGS_SPECIALS, SPECIALS, CharVocabulary, Vocabulary
from elmo_pipeline.model.word_cache import WordCache
from elmo_pipeline.strict import check_ints

DEFAULT_CACHE_SIZE = 100_000
_ENCODE_CHUNK_CPU = 256  # words per char-CNN call, see encode_words
_ENCODE_CHUNK_CUDA = 16384


@dataclass
class Embeddings:
    """What `embed` returns for B sentences of at most T tokens: `layers` (L+1, B, T, 2P), layer
    0 the context-free token vector twice ([x; x]), layer j [forward_j; backward_j]; `mask`
    (B, T) True where a token is; `lengths` the B token counts."""

    layers: torch.Tensor  # (L+1, B, T, 2P), zero past each sentence's end
    mask: torch.Tensor  # (B, T) bool, on the layers' device
    lengths: list[int]  # tokens per sentence, boundaries excluded


class BiLM(Pretrained, nn.Module):
    """The biLM: a token encoder (a char CNN, a word embedding or both) under a forward and a
    backward LSTM stack. Load one with `from_pretrained` (ours; None: the embedded default model),
    `from_allennlp` (the original's options.json and weights.hdf5), `from_formanylangs`, or `load`
    (ours or the original's pair, by one location); `embed` gives the ELMo layers of tokenized
    sentences, and `save_pretrained` writes the model in our format. The loaders (from `Pretrained`,
    whose format readers build this class through `cls`) read `config`, `vocab` (the words of a word
    encoder or softmax) and `chars` (the character dictionary of a model whose config has
    `char_dictionary`, an ELMoForManyLangs model), and pass on `cache_size`, the words the word cache
    holds (`token_representations`), and `kernel`, the LSTM kernel: "auto", "exact" or "fused"
    (`resolved_kernel`)."""

    def __init__(
        self, config: ElmoConfig, vocab: Vocabulary | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE, kernel: str = AUTO, chars: CharVocabulary | None = None,
    ) -> None:
        super().__init__()
        check_cache_size(cache_size)
        if config.vocab_size is not None and (vocab is None or len(vocab) != config.vocab_size):
            got = None if vocab is None else len(vocab)
            raise ValueError(f"config says vocab_size={config.vocab_size}, vocabulary has {got} tokens")
        _check_family(config, vocab, chars)
        self.config = config
        self.vocab = vocab
        self.chars = chars
        self.token_encoder = TokenEncoder(config)
        self.lstm = BiLstmStack(config.lstm)
        self.softmax: LmOutputLayer | None = None
        if config.softmax.kind != "none":
            self.softmax = LmOutputLayer(config.softmax, config.lstm.projection_dim, vocab)
        self.kernel = check_kernel(kernel, config.lstm)  # as asked; `auto` is resolved per call, see resolved_kernel
        self.word_cache = WordCache(cache_size)
        self.checksum: str | None = None  # sha256 of the files it was loaded from
        # weights loaded in place into inference tensors (a model built under inference_mode)
        # move no version counter: the load itself empties the caches
        self.register_load_state_dict_post_hook(_weights_loaded)

    def train(self, mode: bool = True) -> "BiLM":
        """nn.Module's `train` (`mode` False: eval mode), the word cache emptied first."""
        self.word_cache.clear()  # weights are about to change; cached words would go stale
        return super().train(mode)

    def clear_cache(self) -> None:
        """Empties the word cache and the LSTM weights' bf16 copies: needed after an edit through
        `.data` (or an in-place edit of an inference tensor), which nothing can see."""
        self.word_cache.clear()
        forget_casts(self.lstm.layers)

    @property
    def device(self) -> torch.device:
        """The device the weights are on."""
        return self.token_encoder.projection.weight.device

    def resolved_kernel(self) -> str:
        """The LSTM kernel ("exact" or "fused") that a call computes with now: `self.kernel` with
        `auto` resolved for the device the model is on (it follows a later `.to(device)`)."""
        return self.lstm.resolve_kernel(self.kernel, self.device)

    # -- words -> ids ------------------------------------------------------------------------
    @property
    def boundary_tokens(self) -> tuple[str, str]:
        """The tokens a sentence is wrapped in; the same text inside a sentence is the same token."""
        return ("<bos>", "<eos>") if self.chars is not None else (SENTENCE_START, SENTENCE_END)

    def token_keys(self, words: Sequence[str]) -> list[str]:
        """The strings the model looks `words` up by: themselves, or for a character dictionary
        their first max_characters_per_token - 2 characters (that family cuts them before both lookups)."""
        if self.chars is None:
            return list(words)
        assert self.config.char_cnn is not None
        keep = self.config.char_cnn.max_characters_per_token - 2
        return [w[:keep] for w in words]

    def char_ids(self, keys: Sequence[str]) -> np.ndarray:
        """(N, max_characters_per_token) char ids of `keys` (from `token_keys`), boundaries included."""
        assert self.config.char_cnn is not None
        max_chars = self.config.char_cnn.max_characters_per_token
        if self.chars is not None:
            return self.chars.char_ids(keys, max_chars)
        return tokens_char_ids(keys, max_chars)

    # -- tensors ----------------------------------------------------------------------------
    def encode_words(self, words: Sequence[str]) -> torch.Tensor:
        """(N, P) context-free representations of `words`, computed without the cache."""
        # Chunked on CPU so each conv width's activation stays cache-sized (docs/design-measurements.md);
        # rows are independent and padded (batch_invariance), so the result is the same bits as one call.
        chunk = _ENCODE_CHUNK_CUDA if self.device.type == "cuda" else _ENCODE_CHUNK_CPU
        words = list(words)
        if len(words) <= chunk:
            return self._encode_chunk(words)
        return torch.cat([self._encode_chunk(words[i : i + chunk]) for i in range(0, len(words), chunk)])

    def _encode_chunk(self, words: list[str]) -> torch.Tensor:
        char_ids = word_ids = None
        if self.token_encoder.uses_chars:
            char_ids = torch.from_numpy(self.char_ids(words)).to(self.device)
        if self.token_encoder.uses_words:
            assert self.vocab is not None
            word_ids = torch.from_numpy(self.vocab.ids(words)).to(self.device)
        return self.token_encoder(char_ids, word_ids)

    def token_representations(self, words: Sequence[str]) -> torch.Tensor:
        """(N, P) for distinct `words`, through the word cache when no gradient is needed."""
        if self.training or torch.is_grad_enabled():
            return self.encode_words(words)
        dev = self.device
        autocast = torch.is_autocast_enabled(dev.type) and torch.get_autocast_dtype(dev.type)
        # inference-mode tensors cannot be updated outside inference mode: one table per mode
        key = (dev, self.token_encoder.projection.weight.dtype, autocast, torch.is_inference_mode_enabled(),
               _WeightsVersion(self.token_encoder))
        return self.word_cache.lookup(words, self.encode_words, key)

    def forward(
        self, tokens: torch.Tensor, lengths: torch.Tensor, state: LstmState | None = None,
        dropout: float = 0.0,
    ) -> tuple[list[torch.Tensor], LstmState]:
        """The LSTM stacks over `tokens` (B, T, P), boundaries included, of `lengths` (B,) tokens each,
        from `state` (None: zeros), with `dropout` between layers when training: per layer (2, B, T, P),
        and the final states. `embed` is the call for features."""
        return self.lstm(tokens, lengths, state, kernel=self.kernel, dropout=dropout)

    # -- sentences --------------------------------------------------------------------------
    def sentence_tokens(self, sentences: Sequence[Sequence[str]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token representations (B, T+2, P) of `sentences` with boundaries, and lengths (B,) including them."""
        start, end = self.boundary_tokens
        wrapped = [[start, *self.token_keys(s), end] for s in sentences]
        distinct = list(dict.fromkeys(w for s in wrapped for w in s))
        slot = {w: i for i, w in enumerate(distinct)}
        width = max(len(s) for s in wrapped)
        index = np.full((len(wrapped), width), len(distinct), dtype=np.int64)  # padding -> zero row
        for row, s in enumerate(wrapped):
            index[row, : len(s)] = [slot[w] for w in s]
        reps = self.token_representations(distinct)
        reps = torch.cat([reps, reps.new_zeros(1, reps.shape[1])])
        tokens = reps[torch.from_numpy(index).to(reps.device)]
        lengths = torch.tensor([len(s) for s in wrapped])
        return tokens, lengths

    def embed(self, sentences: Sequence[Sequence[str]], state: LstmState | None = None) -> Embeddings:
        """The vectors of `sentences`, a list of B sentences, each a list of token strings (the
        boundaries, `<S>` and `</S>` or a ForManyLangs model's `<bos>` and `<eos>`, are added here and
        left out of the output): see `Embeddings` for the shapes.
        Each sentence starts from a zero LSTM state unless `state` gives one, `(L, 2, B, P)` and
        `(L, 2, B, H)` (as `CarriedState` does)."""
        return self._embed(sentences, state)[0]

    def _check_autocast(self) -> None:
        """Autocast runs a float32 model (or one of its own dtype): float16 weights under bf16
        autocast fail deep in torch ("Unexpected floating ScalarType")."""
        weights = self.token_encoder.projection.weight
        device = weights.device.type
        if torch.is_autocast_enabled(device) and weights.dtype not in (torch.float32, torch.get_autocast_dtype(device)):
            raise ValueError(f"{torch.get_autocast_dtype(device)} autocast with a {weights.dtype} model: autocast "
                             "takes a float32 model; give the model as float32, or run it without autocast (fp32)")

    def _check_gradients(self) -> None:
        """Weights made under inference_mode (a model loaded inside it) cannot take part in a graph:
        with gradients on, torch failed deep in the char CNN ("Inference tensors cannot be saved for
        backward"), naming neither the model nor the way out."""
        if torch.is_grad_enabled() and any(p.requires_grad and p.is_inference() for p in self.parameters()):
            raise RuntimeError("this model's weights were made under torch.inference_mode, and gradients are on: "
                               "embed under torch.no_grad() or torch.inference_mode(), or load the model outside "
                               "inference_mode to train or fine-tune it")

    def _check_state(self, state: LstmState, batch: int) -> None:
        """An initial state has a row per sentence and this model's sizes: the LSTM pads rows, so a
        state of too few rows gave the later sentences a zero state, and one of too many was cut,
        without a word; another model's sizes failed deep in a product. It is two tensors of the
        dtype and device of the model's own zero state: a float64 one (numpy's default) ran the
        cells in float64, moving float32 outputs by up to 1.4e-6; a str failed on "no attribute
        'shape'"."""
        if not (isinstance(state, (tuple, list)) and len(state) == 2
                and all(isinstance(tensor, torch.Tensor) for tensor in state)):
            raise TypeError(f"state is (h, c), two tensors (an LstmState, as CarriedState keeps), got {state!r:.80}")
        zero = self.lstm.zero_state(0, self.token_encoder.projection.weight)
        for name, tensor in zip(("h", "c"), state):
            if (tensor.dtype, tensor.device) != (zero.h.dtype, zero.h.device):
                raise ValueError(f"state.{name} is {tensor.dtype} on {tensor.device}; this model's state is "
                                 f"{zero.h.dtype} on {zero.h.device}")
        cfg = self.config.lstm
        expected = {"h": (cfg.n_layers, 2, batch, cfg.projection_dim), "c": (cfg.n_layers, 2, batch, cfg.dim)}
        for name, tensor in zip(expected, state):
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(f"state.{name} has shape {tuple(tensor.shape)}; {batch} sentences with this model "
                                 f"need {expected[name]} (layers, directions, sentences, units)")

    def _embed(self, sentences: Sequence[Sequence[str]], state: LstmState | None) -> tuple[Embeddings, LstmState]:
        check_sentence_list(sentences)
        if len(sentences) == 0:
            raise ValueError("embed needs at least one sentence")
        check_token_lists(sentences)
        if state is not None:
            self._check_state(state, len(sentences))
        self._check_autocast()
        self._check_gradients()
        tokens, lengths = self.sentence_tokens(sentences)
        layers, final = self(tokens, lengths, state)
        n = lengths - 2
        width = int(n.max())
        # (B, T) on the layers' device: a CPU mask beside CUDA layers failed in every product of the two
        mask = (torch.arange(width).unsqueeze(0) < n.unsqueeze(1)).to(tokens.device)
        keep = mask.unsqueeze(-1).to(layers[0].dtype)
        x = tokens[:, 1 : width + 1].to(layers[0].dtype)
        out = [torch.cat([x, x], dim=-1) * keep]
        for layer in layers:  # (2, B, T+2, P) -> (B, T, 2P)
            out.append(torch.cat([layer[0], layer[1]], dim=-1)[:, 1 : width + 1] * keep)
        return Embeddings(torch.stack(out), mask, n.tolist()), final


class _WeightsVersion:
    """What changes with a module's weights, as the word cache's key: an in-place update (an
    optimizer step, or load_state_dict, also in eval mode) moves a tensor's version counter, and
    a replaced tensor has another address. It holds the tensors it was taken from, so while a
    table is keyed on it their addresses cannot come back as new tensors' (which, with version
    0 again, would match). Equal when every address and version is."""

    __hash__ = None  # type: ignore[assignment]  # compared, never hashed

    def __init__(self, module: nn.Module) -> None:
        params = list(module.parameters())
        self.held = [p.detach() for p in params]
        self.marks = [(p.data_ptr(), p.device, _version(p)) for p in params]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _WeightsVersion) and self.marks == other.marks


def _version(p: torch.Tensor) -> int | None:
    try:
        return p._version
    except RuntimeError:  # an inference tensor keeps no counter (see _weights_loaded)
        return None


def _weights_loaded(module: nn.Module, _incompatible: object) -> None:
    module.clear_cache()


def check_cache_size(cache_size: int) -> None:
    """The word cache's size, named where it is given: 5.5 was taken and failed deep in torch at the
    first batch whose words fit ("new_empty() takes 1 positional argument"), and "10" in a comparison."""
    check_ints(cache_size=cache_size)
    if cache_size < 0:
        raise ValueError(f"cache_size must be >= 0, got {cache_size}")


class TokenListError(TypeError):
    """A sentence given to `embed` that is not a sequence of token strings; `index` says which."""

    def __init__(self, index: int, problem: str) -> None:
        super().__init__(f"sentence {index} {problem}")
        self.index, self.problem = index, problem


class BlankTokenError(TokenListError, ValueError):
    """A token of no text, empty or whitespace only: a ValueError (the commands' refusal of one is)."""


def check_sentence_list(sentences: object) -> None:
    """A list (or tuple, or array) of sentences: a generator failed on len() ("has no len()"), and a
    set would be embedded in hash order."""
    if isinstance(sentences, (str, bytes)) or not isinstance(sentences, (Sequence, np.ndarray)):
        raise TypeError(f"embed takes a list of sentences (each a list of token strings), got a "
                        f"{type(sentences).__name__}: pass list(...) of it, in sentence order")


def check_token_lists(sentences: Sequence[Sequence[str]]) -> None:
    """Each sentence a sequence of token strings. A sentence given as a string would otherwise be
    embedded one character per token, with no error."""
    for i, sentence in enumerate(sentences):
        if isinstance(sentence, (str, bytes)):
            raise TokenListError(i, f"is a {type(sentence).__name__}, not a list of token strings: split it into "
                                 "tokens first")
        # an iterator would be used up by this check and embedded empty; a set or dict has no
        # order of its own (a set's changes with the process's hash seed)
        if not isinstance(sentence, (Sequence, np.ndarray)):
            raise TokenListError(i, f"is a {type(sentence).__name__}, not a sequence of token strings (a list or "
                                 "tuple, in sentence order)")
        if not all(isinstance(token, str) for token in sentence):
            bad = next(t for t in sentence if not isinstance(t, str))
            raise TokenListError(i, f"has a token of type {type(bad).__name__} ({bad!r:.80}); tokens are strings")
        # '' from "a  b".split(" ") was embedded as a word of no text, shifting the tokens after it;
        # the commands refuse such a token too (embed-file --tab-separated), and spaCy's are dropped
        if not all(token and not token.isspace() for token in sentence):
            k = next(k for k, token in enumerate(sentence) if not token or token.isspace())
            raise BlankTokenError(i, f"has an empty or blank token, its token {k} ({sentence[k]!r:.80}); tokens hold "
                                  "text: split on any whitespace with str.split(), not split(' ')")


def _check_family(config: ElmoConfig, vocab: Vocabulary | None, chars: CharVocabulary | None) -> None:
    """A character dictionary comes with its config section, and a word embedding with the
    specials of the family's boundary tokens."""
    if (chars is None) != (config.char_dictionary is None):
        raise ValueError("a character dictionary goes with the config's char_dictionary section, and only with it")
    if chars is not None and config.char_dictionary is not None and len(chars) != config.char_dictionary.size:
        raise ValueError(f"config says char_dictionary.size={config.char_dictionary.size}, "
                         f"the character dictionary has {len(chars)} entries")
    specials = FORMANYLANGS_SPECIALS if chars is not None else SPECIALS
    if vocab is not None and config.token_encoder != "char_cnn" and vocab.specials != specials:
        # the word embedding reads the boundary tokens (`boundary_tokens`) as words
        raise ValueError(f"this model's vocabulary needs the specials {list(specials)}, got {list(vocab.specials)}")


class CarriedState:
    """The original stateful behaviour: row i of a batch starts from the final state of row i
    of the previous batch. Outputs then depend on batch order, size and row; use this only to
    reproduce files written by the original implementation. `model` is the BiLM it embeds with."""

    def __init__(self, model: BiLM) -> None:
        # else the first embed failed: "'NoneType' object has no attribute 'token_encoder'"; a wrapper
        # that passes attributes through (torch.compile's) is taken
        if not callable(getattr(model, "_embed", None)):
            raise TypeError(f"CarriedState carries the state of a BiLM, got {type(model).__name__} ({model!r:.80})")
        self.model = model
        self.state: LstmState | None = None

    def embed(self, sentences: Sequence[Sequence[str]]) -> Embeddings:
        """`model.embed(sentences)`, row i starting from the final state of row i of the previous
        call (from zeros at the first call, and in rows past the previous calls' batches)."""
        check_sentence_list(sentences)  # before len(): a generator said only "has no len()"
        b = len(sentences)
        ref = self.model.token_encoder.projection.weight
        initial = self.model.lstm.zero_state(b, ref)
        if self.state is not None:
            rows = min(b, self.state.h.shape[2])
            initial.h[:, :, :rows] = self.state.h[:, :, :rows]
            initial.c[:, :, :rows] = self.state.c[:, :, :rows]
        result, final = self.model._embed(sentences, initial)
        if self.state is None or self.state.h.shape[2] <= b:
            self.state = LstmState(final.h.detach(), final.c.detach())
        else:  # a smaller batch updates its rows and leaves the others for later batches; new
            # tensors, not writes into the old (made under inference_mode, they refuse writes outside it)
            self.state = LstmState(torch.cat([final.h.detach(), self.state.h[:, :, b:]], dim=2),
                                   torch.cat([final.c.detach(), self.state.c[:, :, b:]], dim=2))
        return result
