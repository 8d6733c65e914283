"""Tiny random models, created and saved the way real checkpoints are (transformers config ->
random weights -> save_pretrained, plus a tokenizer.json), for fidelity tests without a hub."""

from __future__ import annotations

import json
import string
from pathlib import Path

WORDS = (
    "the a an of to in and is are was for on with as by at from this that it be or not query document "
    "search engine flower garden rose tulip seed soil water sun rain green red blue white fast slow "
    "model text embed score rank yes no which what how why who where when good bad big small"
).split()
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"]


def make_tokenizer(path: Path, kind: str) -> None:
    """A WordPiece tokenizer over a small vocabulary.

    kind "bert": [CLS] $A [SEP] / [CLS] $A [SEP] $B [SEP] with pair type ids;
    kind "qwen": $A <|endoftext|> (the EOS that Qwen3-Embedding's post-processor appends), plus
    the chat tokens the Qwen3 reranker template uses.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, decoders

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = list(string.ascii_lowercase + string.digits + string.punctuation)
    vocab_list = specials + CHAT_TOKENS + WORDS + pieces + ["##" + c for c in string.ascii_lowercase + string.digits]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(vocab_list))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(specials + CHAT_TOKENS)
    if kind == "bert":
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
    else:
        tok.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>", pair="$A $B:1 <|endoftext|>:1", special_tokens=[("<|endoftext|>", vocab["<|endoftext|>"])]
        )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512, "pad_token": "[PAD]", "unk_token": "[UNK]"}
    if kind == "bert":
        # Real BERT tokenizers return token types; say so, or pairs reach the model without them.
        cfg.update(cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]", model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    else:
        cfg.update(eos_token="<|endoftext|>")
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


def vocab_size(path: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()


def _st_files(path: Path, pooling: str, normalize: bool, max_len: int, prompts: dict | None = None, dim: int = 0) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    keys = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens", "lasttoken": "pooling_mode_lasttoken"}
    pool_cfg = {"word_embedding_dimension": dim, **{k: False for k in keys.values()}}
    for mode in pooling.split("+"):
        pool_cfg[keys[mode]] = True
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pool_cfg))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_len, "do_lower_case": False}))
    (path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts or {}, "default_prompt_name": None, "similarity_fn_name": "cosine"}))


def make_bert_embedder(path: Path, *, pooling: str = "mean", normalize: bool = True, max_len: int = 64, seed: int = 0) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    make_tokenizer(path, "bert")
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=vocab_size(path), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, max_position_embeddings=128)
    BertModel(cfg, add_pooling_layer=False).eval().save_pretrained(path)
    _st_files(path, pooling, normalize, max_len, prompts={"query": "query : ", "document": ""}, dim=64)
    return path


def make_bert_cross_encoder(path: Path, *, num_labels: int = 1, seed: int = 0, **extra) -> Path:
    """extra: BertConfig fields (initializer_range=0.2 spreads the scores, which the default 0.02
    keeps within ~1e-4 of each other)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    make_tokenizer(path, "bert")
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=vocab_size(path), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, max_position_embeddings=128, num_labels=num_labels,
                     **extra)
    BertForSequenceClassification(cfg).eval().save_pretrained(path)
    return path


def qwen3_config(path: Path, **extra):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab_size(path), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6, **extra)


def make_qwen3_embedder(path: Path, *, bidirectional: bool = False, seed: int = 0) -> Path:
    """Qwen3-Embedding style (causal, last token) or pplx-embed style (bidirectional, mean)."""
    import torch
    from transformers import Qwen3Model

    make_tokenizer(path, "qwen")
    torch.manual_seed(seed)
    Qwen3Model(qwen3_config(path)).eval().save_pretrained(path)
    if bidirectional:
        cfg = json.loads((path / "config.json").read_text())
        cfg["model_type"] = "bidirectional_pplx_qwen3"
        cfg["architectures"] = ["PPLXQwen3Model"]
        (path / "config.json").write_text(json.dumps(cfg))
    prompts = {"query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:", "document": ""}
    _st_files(path, "mean" if bidirectional else "lasttoken", normalize=not bidirectional, max_len=128, prompts=prompts, dim=64)
    if bidirectional:
        mods = json.loads((path / "modules.json").read_text())
        mods.append({"idx": 2, "name": "2", "path": "", "type": "st_quantize.FlexibleQuantizer"})
        (path / "modules.json").write_text(json.dumps(mods))
    return path


def make_qwen3_reranker(path: Path, *, tie: bool = True, seed: int = 0, **extra) -> Path:
    """extra: Qwen3Config fields (as make_bert_cross_encoder's)."""
    import torch
    from transformers import Qwen3ForCausalLM

    make_tokenizer(path, "qwen")
    torch.manual_seed(seed)
    Qwen3ForCausalLM(qwen3_config(path, tie_word_embeddings=tie, **extra)).eval().save_pretrained(path)
    return path
