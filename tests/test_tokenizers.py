"""Tokenizers: NeoX's GPT-2 tokenizer.json, char level, sentencepiece and BPE training."""
from pathlib import Path

import pytest

from megatron.config.schema import TokenizerConfig
from megatron.data import DataError
from megatron.data.tokenizer_training import train_bpe_tokenizer, train_spm_tokenizer
from megatron.data.tokenizers import CharLevelTokenizer, HFTokenizer, SPMTokenizer, build_tokenizer

NEOX_SAMPLES = Path(__file__).resolve().parents[1].parent / "shared" / "external" / "gpt-neox" / "data"
GPT2_JSON = NEOX_SAMPLES / "gpt2-tokenizer.json"
ENWIK8 = NEOX_SAMPLES / "enwik8_first100.txt"
needs_neox_samples = pytest.mark.skipif(not (GPT2_JSON.is_file() and ENWIK8.is_file()),
                                        reason=f"GPT-NeoX sample files not found under {NEOX_SAMPLES}")
TINY_TEXT = ("The quick brown fox jumps over the lazy dog.\n"
             "A tokenizer splits text into pieces; pieces map to ids.\n"
             "def add(a, b):\n    return a + b\n") * 20


@needs_neox_samples
def test_gpt2_tokenizer_matches_the_tokenizers_library_on_enwik8():
    from tokenizers import Tokenizer

    text = ENWIK8.read_text(encoding="utf-8")
    ours = HFTokenizer(str(GPT2_JSON))
    reference = Tokenizer.from_file(str(GPT2_JSON))
    ids = ours.encode(text)
    assert ids == reference.encode(text).ids
    assert len(ids) > 1000
    assert ours.decode(ids) == text  # byte-level BPE is lossless
    # Known GPT-2 ids, independent of both code paths above.
    assert ours.encode("Hello world") == [15496, 995]
    assert ours.eod_id == 50256
    assert ours.vocab_size == 50257


@needs_neox_samples
def test_build_tokenizer_from_config_and_vocab_size_mismatch():
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="HFTokenizer", vocab_file=str(GPT2_JSON)))
    assert tokenizer.vocab_size == 50257
    with pytest.raises(DataError, match="vocab_size is 50000 but"):
        build_tokenizer(TokenizerConfig(tokenizer_type="HFTokenizer", vocab_file=str(GPT2_JSON), vocab_size=50000))


def test_missing_or_unreadable_files_are_one_line_errors(tmp_path):
    with pytest.raises(DataError, match=r"HFTokenizer file not found: .*nope\.json") as error:
        build_tokenizer(TokenizerConfig(tokenizer_type="HFTokenizer", vocab_file=str(tmp_path / "nope.json")))
    assert "\n" not in str(error.value)
    with pytest.raises(DataError, match="needs a vocab_file"):
        build_tokenizer(TokenizerConfig(tokenizer_type="SPMTokenizer"))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(DataError, match="cannot read .*garbage.json"):
        HFTokenizer(str(garbage))
    with pytest.raises(DataError, match="not supported"):
        build_tokenizer(TokenizerConfig(tokenizer_type="GPT2BPETokenizer"))


def test_char_level_round_trip():
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="CharLevelTokenizer"))
    assert isinstance(tokenizer, CharLevelTokenizer)
    text = "naïve café — 漢字 🙂\x00 tabs\tand\nlines"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert max(ids) < 256 and tokenizer.vocab_size == 512
    assert tokenizer.eod_id not in ids
    assert tokenizer.decode(ids + [tokenizer.eod_id]) == text


def test_sentencepiece_train_and_encode(tmp_path):
    with pytest.raises(DataError, match="Vocabulary size is smaller than required_chars"):
        train_spm_tokenizer([TINY_TEXT], vocab_size=120, output=str(tmp_path / "small.model"))
    model = train_spm_tokenizer([TINY_TEXT], vocab_size=400, output=str(tmp_path / "spm.model"))
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="SPMTokenizer", vocab_file=model))
    assert isinstance(tokenizer, SPMTokenizer)
    ids = tokenizer.encode("The quick brown fox")
    assert ids and all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == "The quick brown fox"
    assert tokenizer.decode([tokenizer.eod_id]) == "<|endoftext|>"
    assert tokenizer.decode(tokenizer.encode("unseen: Ωmega")) == "unseen: Ωmega"  # byte fallback


def test_bpe_training_is_deterministic_and_lossless(tmp_path):
    first = train_bpe_tokenizer([TINY_TEXT], vocab_size=300, output=str(tmp_path / "a.json"))
    second = train_bpe_tokenizer([TINY_TEXT], vocab_size=300, output=str(tmp_path / "b.json"))
    assert Path(first).read_bytes() == Path(second).read_bytes()
    tokenizer = HFTokenizer(first)
    assert tokenizer.eod_id == 0 and tokenizer.pad_id == 1
    assert 258 < tokenizer.vocab_size <= 300
    text = "def add(a, b): return a + b  # ünïcode"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode("The quick brown fox")) < len("The quick brown fox")  # merges were learned
    with pytest.raises(DataError, match="too small"):
        train_bpe_tokenizer([TINY_TEXT], vocab_size=100, output=str(tmp_path / "c.json"))


def test_llama_style_tokenizer_json_ends_documents_with_its_eos(tmp_path):
    """Llama and Mistral ship a tokenizer.json with <s>, </s> and no <|endoftext|>: </s> ends documents;
    one with none of the candidates is refused in one line."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    for specials, want in ((["<unk>", "<s>", "</s>"], "</s>"), (["<unk>", "<s>"], None)):
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel()
        tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20,
                                trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False))
        path = tmp_path / f"tokenizer_{len(specials)}.json"
        tok.save(str(path))
        if want is None:
            with pytest.raises(DataError, match=r"has none of <\|endoftext\|>, </s>") as error:
                HFTokenizer(str(path))
            assert "\n" not in str(error.value)
        else:
            assert HFTokenizer(str(path)).eod_id == tok.token_to_id(want) == 2
