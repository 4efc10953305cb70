import numpy as np

from elmo_pipeline.model.characters import (BOS_CHAR, BOW_CHAR, EOS_CHAR, EOW_CHAR, PAD_CHAR, token_char_ids,
                                      tokens_char_ids)


def test_ascii_token_is_bytes_between_word_markers_shifted_by_one():
    ids = token_char_ids("Hi", 50)
    assert ids.shape == (50,)
    assert ids[:4].tolist() == [BOW_CHAR + 1, ord("H") + 1, ord("i") + 1, EOW_CHAR + 1]
    assert (ids[4:] == PAD_CHAR + 1).all()


def test_sentence_boundaries_use_their_own_markers():
    assert token_char_ids("<S>", 50)[:4].tolist() == [BOW_CHAR + 1, BOS_CHAR + 1, EOW_CHAR + 1, PAD_CHAR + 1]
    assert token_char_ids("</S>", 50)[:3].tolist() == [BOW_CHAR + 1, EOS_CHAR + 1, EOW_CHAR + 1]


def test_long_multibyte_token_is_cut_at_48_bytes_like_the_original():
    word = "包袱" * 20  # 120 UTF-8 bytes
    ids = token_char_ids(word, 50)
    raw = word.encode("utf-8")[:48]
    assert ids[1:49].tolist() == [b + 1 for b in raw]
    assert ids[49] == EOW_CHAR + 1


def test_batch_matches_single_tokens_and_handles_surrogates():
    tokens = ["a", "Ünïcödé", "\ud800", "🙂‍↕️"]
    batch = tokens_char_ids(tokens, 20)
    for row, token in enumerate(tokens):
        np.testing.assert_array_equal(batch[row], token_char_ids(token, 20))
    assert batch.min() >= 1 and batch.max() <= 261


def test_a_lone_surrogate_is_dropped_before_the_cut_as_the_original_does():
    # bilm-tf and AllenNLP encode with errors="ignore": the surrogate has no bytes, and the
    # characters after it move up
    np.testing.assert_array_equal(token_char_ids("\ud800x", 50), token_char_ids("x", 50))
    np.testing.assert_array_equal(token_char_ids("x" * 47 + "\udfffyz", 50), token_char_ids("x" * 47 + "yz", 50))
    assert token_char_ids("\ud800", 50)[:3].tolist() == [BOW_CHAR + 1, EOW_CHAR + 1, PAD_CHAR + 1]
