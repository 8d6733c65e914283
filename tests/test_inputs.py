"""Bad input gets a clear error that says what to do; nothing crashes."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import florist
from florist.config import UnsupportedModelError
from florist.text import InputError


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda e: e.embed([]), "empty"),
        (lambda e: e.embed([""]), "empty string"),
        (lambda e: e.embed(["ok", 3]), "strings"),
        (lambda e: e.embed(None), "list"),
        (lambda e: e.embed(["word " * 600]), "takes at most 256; pass truncate=true"),
        (lambda e: e.embed([[101, 99999999]]), "outside the vocabulary"),
        (lambda e: e.embed([[-1, 5]]), "outside the vocabulary"),
        (lambda e: e.embed([[]]), "non-empty"),
        (lambda e: e.embed([[1.5, 2.0]]), "non-integer"),
        (lambda e: e.embed(["x"], prompt_name="nope"), "unknown prompt_name"),
        (lambda e: e.embed(["x"], dimensions=385), "between 1 and 384"),
        (lambda e: e.embed(["x"], dimensions=0), "between 1 and 384"),
        (lambda e: e.embed(["x"], encoding="fp8"), "unsupported encoding"),
        (lambda e: e.embed(["x"], encoding="int8"), "no int8"),
        (lambda e: e.embed(["x"], encoding="binary", dimensions=12), "multiple of 8"),
        (lambda e: e.score("q", ["d"]), "score needs a cross-encoder"),
    ],
)
def test_bad_input_is_a_clear_value_error(default_engine, call, message):
    with pytest.raises(InputError, match=message):
        call(default_engine)
    assert default_engine.embed(["still serving"]).shape == (1, 384)


def test_truncation_states_both_numbers_and_truncate_cuts(default_engine):
    with pytest.raises(InputError, match=r"input 0 has \d+ tokens; the model takes at most 256"):
        default_engine.embed(["flower " * 300])
    assert default_engine.embed(["flower " * 300], truncate=True).shape == (1, 384)
    ids = default_engine.tokenize(["flower " * 300], truncate=True)[0]
    assert len(ids) == 256 and ids[0] == 101 and ids[-1] == 102  # [CLS] ... [SEP] kept


def test_token_ids_equal_text(default_engine):
    ids = default_engine.tokenize(["a garden of roses"])
    np.testing.assert_allclose(default_engine.embed(ids), default_engine.embed(["a garden of roses"]), atol=1e-6)


def test_score_bad_input(cross_encoder_dir):
    engine = florist.Engine.from_pretrained(cross_encoder_dir, device="cpu")
    for call, message in [
        (lambda: engine.score("", ["d"]), "query"),
        (lambda: engine.score("q", []), "documents"),
        (lambda: engine.score("q", ["ok", ""]), "document 1"),
        (lambda: engine.embed(["x"]), "embed needs an embedding model"),
    ]:
        with pytest.raises(InputError, match=message):
            call()


def test_unservable_model_dirs(tmp_path, bert_dir):
    with pytest.raises(UnsupportedModelError, match="does not exist"):
        florist.Engine.from_pretrained(tmp_path / "missing")
    broken = tmp_path / "no-tokenizer"
    shutil.copytree(bert_dir, broken)
    (broken / "tokenizer.json").unlink()
    with pytest.raises(UnsupportedModelError, match="tokenizer.json"):
        florist.Engine.from_pretrained(broken)
    odd = tmp_path / "odd-type"
    shutil.copytree(bert_dir, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["model_type"] = "t5"
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="model_type 't5'"):
        florist.Engine.from_pretrained(odd)


def test_missing_and_unexpected_weights_are_named(tmp_path, bert_dir):
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(bert_dir / "model.safetensors"))
    missing = tmp_path / "missing-weight"
    shutil.copytree(bert_dir, missing)
    save_file({k: v for k, v in weights.items() if "layer.1.attention.self.key.weight" not in k}, str(missing / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=r"layers\.1\.qkv\.weight\[k\]"):
        florist.Engine.from_pretrained(missing)
    extra = tmp_path / "extra-weight"
    shutil.copytree(bert_dir, extra)
    save_file({**weights, "mystery.weight": torch.zeros(2)}, str(extra / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="mystery.weight"):
        florist.Engine.from_pretrained(extra)


def test_sharded_checkpoint_and_dense(tmp_path, bert_dir):
    """A checkpoint split in shards with an index file, and a 2_Dense module, load and match ST."""
    from safetensors.torch import load_file, save_file
    from sentence_transformers import SentenceTransformer
    import torch

    path = tmp_path / "sharded-dense"
    shutil.copytree(bert_dir, path)
    weights = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(weights)
    half = len(names) // 2
    index = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: weights[k] for k in part}, str(path / fname))
        index.update({k: fname for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    dense = path / "2_Dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"in_features": 64, "out_features": 16, "bias": True, "activation_function": "torch.nn.modules.activation.Tanh"}))
    g = torch.Generator().manual_seed(1)
    save_file({"linear.weight": torch.randn(16, 64, generator=g), "linear.bias": torch.randn(16, generator=g)}, str(dense / "model.safetensors"))
    modules = json.loads((path / "modules.json").read_text())
    modules[-1].update(idx=3, name="3")  # Normalize moves behind the Dense module
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (path / "modules.json").write_text(json.dumps(modules))

    texts = ["roses and tulips", "rain on the garden", "a"]
    ref = SentenceTransformer(str(path), device="cpu").encode(texts)
    ours = florist.Engine.from_pretrained(path, device="cpu").embed(texts)
    assert ours.shape == ref.shape == (3, 16)
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_cli_encode(capsys):
    from florist.cli import main

    assert main(["encode", "hello", "world", "--dimensions", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["embeddings"]) == 2 and len(out["embeddings"][0]) == 8
    assert main(["encode", "x", "--model", "/does/not/exist"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_devices_florist_does_not_run_on_are_refused_by_name(monkeypatch, capsys):
    """A device string torch rejects, or one it knows but florist does not run on, or a GPU index
    past those visible: a ValueError that says what florist takes, not torch's list of backends."""
    import torch

    from florist.cli import main
    from florist.engine.runner import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    for device, says in (("tpu", "unknown device 'tpu'; florist runs on cpu, cuda or cuda:N"),
                         ("meta", "device meta is not supported; florist runs on cpu, cuda or cuda:N")):
        with pytest.raises(ValueError, match=says):
            resolve_device(device)
    assert main(["encode", "x", "--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1") and resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(ValueError, match=r"cuda:2 was asked for but 2 CUDA device\(s\) are visible"):
        resolve_device("cuda:2")


def test_every_cli_option_has_help():
    """`florist <command> --help` explains every option and argument of every command."""
    import argparse
    import importlib

    from florist.cli import COMMANDS

    missing = []
    for name, (module, _) in COMMANDS.items():
        p = argparse.ArgumentParser(prog=f"florist {name}")
        importlib.import_module(module).add_arguments(p)
        missing += [f"{name} {'/'.join(a.option_strings) or a.dest}" for a in p._actions
                    if not a.help and not isinstance(a, argparse._HelpAction)]
    assert not missing, f"options without help: {missing}"


def test_step_checks_ids_and_lengths_on_the_host(default_engine):
    from florist.engine.batch import HostBatch

    for seqs, message in [([[101, 30522]], "token ids"), ([[101] * 513], "positions stop at 512"), ([[-1]], "token ids")]:
        with pytest.raises(InputError, match=message):
            default_engine.step(HostBatch.from_sequences(seqs))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_step_refuses_ids_out_of_range_in_any_int_dtype(bert_dir, dtype):
    from florist.engine.batch import HostBatch

    engine = florist.Engine.from_pretrained(bert_dir, device="cpu")
    vocab = engine.info.vocab_size
    for bad in (-1, vocab, -(2**31)):
        host = HostBatch(np.array([5, bad, 7], dtype=dtype), np.array([3], dtype=np.int32))
        with pytest.raises(InputError, match="token ids must lie"):
            engine.step(host)
    engine.step(HostBatch(np.array([5, vocab - 1], dtype=dtype), np.array([2], dtype=np.int32))).numpy()


def test_texts_and_pairs_get_the_ids_of_a_full_tokenizer_call(default_engine):
    """The processor tokenizes without character offsets (encode_batch_fast): the same ids and
    token types as the tokenizer's ordinary call, truncated or not, from either side."""
    from tokenizers import Tokenizer

    processor = default_engine.text
    full = Tokenizer.from_file(processor.identity)
    full.no_padding()
    rng = np.random.default_rng(7)
    words = [w for w in full.get_vocab() if w.isalpha()]
    texts = [" ".join(rng.choice(words, size=int(n))) + " Ünïcödé, punct!! 123" for n in rng.integers(1, 400, size=12)]
    full.no_truncation()
    want = [e.ids for e in full.encode_batch(texts)]
    got = processor.encode([t for t, ids in zip(texts, want) if len(ids) <= processor.max_tokens])
    assert [g.tolist() for g in got] == [ids for ids in want if len(ids) <= processor.max_tokens]
    for direction in ("right", "left"):
        full.enable_truncation(processor.max_tokens, direction=direction)
        assert [g.tolist() for g in processor.encode(texts, truncate=True, direction=direction)] == [e.ids for e in full.encode_batch(texts)]
    full.enable_truncation(processor.max_tokens)
    encs = full.encode_batch([("a query", t) for t in texts])
    ids, first = processor.encode_pairs("a query", texts, truncate=True)
    assert [i.tolist() for i in ids] == [e.ids for e in encs]
    assert first == [len(e.type_ids) - sum(e.type_ids) for e in encs]


def _messy_texts(rng, words, n):
    """Texts with what tokenizers trip on: runs of spaces, tabs, newlines, control characters,
    accents as combining marks, CJK, punctuation, words past WordPiece's 100-character limit,
    special tokens written out, spaces at both ends."""
    extras = ["  ", "\t", "\n", " \n ", "\x1c", "\x00", "e\u0301", "Ünïcödé", "漢字テキスト", "...", "!?", "don't", "[SEP]", "[CLS]",
              "<|im_start|>", "x" * 130, "a\u00a0b", " ", "\u3000"]
    out = []
    for _ in range(n):
        parts = [str(rng.choice(words)) if rng.random() < 0.8 else str(rng.choice(extras)) for _ in range(int(rng.integers(1, 700)))]
        seps = rng.choice([" ", " ", " ", "", "  ", "\n"], size=len(parts))
        out.append(("  " if rng.random() < 0.2 else "") + "".join(p + s for p, s in zip(parts, seps)))
    return out


@pytest.mark.parametrize("kind", ["default", "bert", "qwen"])
def test_long_texts_in_pieces_get_the_ids_of_one_call(default_engine, tmp_path, monkeypatch, kind):
    """Texts cut at spaces and tokenized in pieces at once give exactly one call's ids: plain,
    truncated from either side, with a prompt, for every tokenizer that allows it."""
    from models import make_tokenizer

    from florist.text import TextProcessor

    if kind == "default":
        processor = default_engine.text
    else:
        make_tokenizer(tmp_path, kind)
        base = default_engine.text
        processor = TextProcessor(str(tmp_path / "tokenizer.json"), base.config, base.pipeline)
    assert processor.split_chars is not None
    monkeypatch.setattr(processor, "split_chars", 40)  # many pieces, cut at every kind of place
    monkeypatch.setattr(processor, "piece_chars", 25)
    monkeypatch.setattr(processor, "split_max_texts", 1000)
    rng = np.random.default_rng(5)
    words = [w for w in Tokenizer_vocab(processor) if w.isalpha()]
    texts = _messy_texts(rng, words, 40) + ["x" * 300, "a " * 200, " " * 100 + "b"]
    import florist.text as text_mod
    cut, counts = text_mod.cut_at_spaces, []
    monkeypatch.setattr(text_mod, "cut_at_spaces", lambda t, *a, **k: counts.append(len(r := cut(t, *a, **k))) or r)
    for kwargs in (dict(truncate=True), dict(truncate=True, direction="left"), dict(truncate=True, prompt="query: ")):
        whole = processor.encode(texts, split=False, **kwargs)
        pieces = processor.encode(texts, **kwargs)
        for k, (a, b) in enumerate(zip(whole, pieces)):
            assert a.tolist() == b.tolist(), (kind, kwargs, k, texts[k][:80])
    assert any(n > 1 for n in counts), "no text was cut in pieces"
    short = [t for t, ids in zip(texts, processor.encode(texts, truncate=True, split=False)) if len(ids) < processor.max_tokens]
    assert [a.tolist() for a in processor.encode(short)] == [a.tolist() for a in processor.encode(short, split=False)]
    with pytest.raises(InputError, match="pass truncate=true"):
        processor.encode(["word " * 2000])
    # Calls of many texts keep each whole: the batch call spreads them over the threads already.
    monkeypatch.setattr(processor, "split_max_texts", 2)
    cuts = []
    in_pieces = processor._encode_in_pieces
    monkeypatch.setattr(processor, "_encode_in_pieces", lambda tok, texts: cuts.append(len(texts)) or in_pieces(tok, texts))
    processor.encode(texts[:2], truncate=True)
    processor.encode(texts[:3], truncate=True)
    assert cuts == [2]


def Tokenizer_vocab(processor):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(processor.identity).get_vocab()


def test_byte_level_and_metaspace_tokenizers_are_never_cut():
    """A space belongs to the word after it in byte-level BPE (GPT-2, Qwen) and is a word's mark
    in Metaspace (SentencePiece): cutting there would change the tokens, so such texts stay whole."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from florist.text import cut_at_spaces, splits_at_spaces

    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    metaspace = Tokenizer(models.Unigram())
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    replaced = Tokenizer(models.WordPiece({"[UNK]": 0}, unk_token="[UNK]"))
    replaced.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    replaced.normalizer = normalizers.Replace(" ", "_")
    none = Tokenizer(models.WordPiece({"[UNK]": 0}, unk_token="[UNK]"))
    assert not any(splits_at_spaces(t) for t in (byte_level, metaspace, replaced, none))
    bert = Tokenizer(models.WordPiece({"[UNK]": 0}, unk_token="[UNK]"))
    bert.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.BertPreTokenizer()])
    bert.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase(), normalizers.StripAccents()])
    assert splits_at_spaces(bert)
    bert.add_special_tokens(["<a b>"])  # an added token with a space in it could be cut in two
    assert not splits_at_spaces(bert)
    text = "one two  three" + "x" * 50 + " four"
    for n in (1, 3, 5, 100):
        pieces = cut_at_spaces(text, n)
        assert "".join(pieces) == text and all(p.startswith(" ") for p in pieces[1:])
    assert cut_at_spaces("x" * 100, 10) == ["x" * 100]
    assert len(cut_at_spaces("a " * 1000, 1, max_pieces=16)) == 16
