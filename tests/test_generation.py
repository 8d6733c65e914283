"""Greedy generation against transformers' generate(do_sample=False) on the same tiny random
Qwen3 causal LMs (CPU, fp32): batched, tensor parallel over gloo, with continuous batching."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import florist
from florist.engine.generation.config import GenerationConfig
from florist.text import InputError

import models as tiny

ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 32
PROMPT_LENS = (1, 5, 17, 40, 64)


def make_causal_lm(path: Path, *, tie: bool, seed: int = 0) -> Path:
    """tests/models.py's Qwen3 geometry as a Qwen3ForCausalLM; larger initial weights than the
    default (0.02) so that attention over the cache decides the tokens, not just the last token.
    No EOS in its config: transformers and florist both generate all tokens asked for."""
    from transformers import Qwen3ForCausalLM

    tiny.make_tokenizer(path, "qwen")
    torch.manual_seed(seed)
    Qwen3ForCausalLM(tiny.qwen3_config(path, tie_word_embeddings=tie, initializer_range=0.2)).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["tied", "untied"])
def lm_dir(request, tmp_path_factory):
    return make_causal_lm(tmp_path_factory.mktemp(f"qwen3-causal-lm-{request.param}"), tie=request.param == "tied")


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return make_causal_lm(tmp_path_factory.mktemp("qwen3-causal-lm"), tie=True)


def prompts_for(path: Path, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, tiny.vocab_size(path), size=n).tolist() for n in lens]


_REFERENCE: dict = {}


def reference(path: Path, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' greedy new tokens, one prompt at a time (no padding in the reference)."""
    from transformers import Qwen3ForCausalLM

    key = str(path)
    if key not in _REFERENCE:
        _REFERENCE[key] = (Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), {})
    model, cache = _REFERENCE[key]
    out = []
    for p in prompts:
        k = (tuple(p), new_tokens)
        if k not in cache:
            with torch.no_grad():
                seq = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False)
            cache[k] = seq[0, len(p):].tolist()
        out.append(cache[k])
    return out


@pytest.fixture(scope="module")
def engine(lm_dir):
    return florist.Engine.from_pretrained(lm_dir, device="cpu")


def test_batch_of_prompts_equals_transformers(engine, lm_dir):
    prompts = prompts_for(lm_dir)
    results = engine.generate(prompts, max_tokens=NEW_TOKENS)
    expected = reference(lm_dir, prompts)
    assert [r.token_ids for r in results] == expected
    assert [len(set(e)) > 4 for e in expected].count(True) >= 3, "the reference should not be one token repeated"
    for r, p in zip(results, prompts):
        assert r.prompt_token_ids == p and r.finish_reason == "length"
        assert r.text == engine.text.decode(r.token_ids)


def test_prompts_one_at_a_time_equal_the_batch(engine, lm_dir):
    prompts = prompts_for(lm_dir, (3, 29))
    batched = [r.token_ids for r in engine.generate(prompts, max_tokens=12)]
    single = [engine.generate(p, max_tokens=12)[0].token_ids for p in prompts]  # a flat id list is one prompt
    assert batched == single == [e[:12] for e in reference(lm_dir, prompts)]


def test_string_prompts_are_tokenized_like_the_embedded_api(engine):
    text = "the rose and the tulip need water"
    by_text = engine.generate([text, "sun"], max_tokens=6)
    by_ids = engine.generate(engine.tokenize([text, "sun"]), max_tokens=6)
    assert [r.token_ids for r in by_text] == [r.token_ids for r in by_ids]
    assert engine.generate(text, max_tokens=6)[0].token_ids == by_text[0].token_ids


def test_tensor_parallel_two_ranks_over_gloo(tied_dir):
    """`florist generate --tensor-parallel-size 2`: two processes, weights sharded at load time."""
    prompts = prompts_for(tied_dir, (1, 9, 33))
    cmd = [sys.executable, "-m", "florist.cli", "generate", "--model", str(tied_dir), "--device", "cpu", "--max-tokens", str(NEW_TOKENS),
           "--tensor-parallel-size", "2", "--json"]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [x["token_ids"] for x in lines] == reference(tied_dir, prompts)


def test_continuous_batching_joins_and_leaves(tied_dir):
    """3 slots, 8 sequences of different budgets arriving over time: each one's tokens equal its
    own reference, while others join and leave around it and slots are reused."""
    engine = florist.Engine.from_pretrained(tied_dir, device="cpu", generation=GenerationConfig(max_num_seqs=3, max_model_len=128, max_prefill_tokens=48))
    gen = engine.runner
    prompts = prompts_for(tied_dir, (7, 1, 30, 12, 45, 3, 20, 9), seed=1)
    budgets = [5, 32, 12, 20, 2, 32, 9, 17]
    arrivals = {0: [0, 1, 2, 3], 4: [4], 9: [5, 6], 20: [7]}  # step number -> sequences that arrive
    seqs: dict[int, object] = {}
    slot_owners: dict[int, set] = {}
    joined_while_running = 0
    step_no = 0
    while step_no <= max(arrivals) or gen.has_work:
        for i in arrivals.get(step_no, []):
            seqs[i] = gen.submit(prompts[i], budgets[i])
        running_before = len(gen.scheduler.running)
        stepped = gen.step()
        if stepped and all(len(s.output) == 1 for s in stepped) and running_before:
            joined_while_running += 1
        for s in gen.scheduler.running:
            slot_owners.setdefault(s.slot, set()).add(s.seq_id)
        step_no += 1
    expected = reference(tied_dir, prompts)
    for i, s in seqs.items():
        assert s.output == expected[i][: budgets[i]], f"sequence {i}"
        assert s.finish_reason == "length"
    assert joined_while_running >= 2, "sequences should join while others are decoding"
    assert any(len(owners) > 1 for owners in slot_owners.values()), "slots should be reused"


def test_stop_token_ids_and_eos(tied_dir, tmp_path):
    engine = florist.Engine.from_pretrained(tied_dir, device="cpu")
    prompt = prompts_for(tied_dir, (11,), seed=2)[0]
    expected = reference(tied_dir, [prompt])[0]
    k = next(i for i in range(3, NEW_TOKENS) if expected[i] not in expected[:i])
    stop = expected[k]
    r = engine.generate([prompt], max_tokens=NEW_TOKENS, stop_token_ids=[stop])[0]
    assert r.token_ids == expected[: k + 1] and r.finish_reason == "stop"
    assert r.text == engine.text.decode(expected[:k])  # the stop token's text is left out

    # The model's EOS (generation_config.json), as transformers' generate reads it.
    with_eos = tmp_path / "qwen3-causal-lm-eos"
    shutil.copytree(tied_dir, with_eos)
    (with_eos / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop, 10**6]}))
    eos_engine = florist.Engine.from_pretrained(with_eos, device="cpu")
    assert eos_engine.generate([prompt], max_tokens=NEW_TOKENS)[0].token_ids == expected[: k + 1]
    assert eos_engine.generate([prompt], max_tokens=NEW_TOKENS, ignore_eos=True)[0].token_ids == expected
    from transformers import Qwen3ForCausalLM

    with torch.no_grad():
        hf = Qwen3ForCausalLM.from_pretrained(with_eos).eval().generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert hf[0, len(prompt):].tolist() == expected[: k + 1]


def test_errors_say_what_to_do(tied_dir, qwen3_dir):
    engine = florist.Engine.from_pretrained(tied_dir, device="cpu", generation=GenerationConfig(max_model_len=64))
    with pytest.raises(InputError, match="max_model_len"):
        engine.generate([list(range(60))], max_tokens=10)
    with pytest.raises(InputError, match="max_tokens must be"):
        engine.generate(["rose"], max_tokens=0)
    with pytest.raises(InputError, match="outside the vocabulary"):
        engine.generate([[10**6]], max_tokens=2)
    with pytest.raises(InputError, match="embed needs an embedding model"):
        engine.embed(["rose"])
    with pytest.raises(InputError, match="use generate"):
        engine.step(None)
    embedder = florist.Engine.from_pretrained(qwen3_dir, device="cpu")
    with pytest.raises(InputError, match="generate needs a causal LM"):
        embedder.generate(["rose"])
    with pytest.raises(InputError, match="tensor parallelism serves causal LMs"):
        florist.Engine.from_pretrained(qwen3_dir, device="cpu", tensor_parallel_size=2)


def test_decode_hands_raw_qkv_to_a_fused_attention_backend(tied_dir, monkeypatch):
    """Where decode attention also runs QK-norm, rotary and the KV store (the Triton kernel on
    CUDA: `decode_attention_qk_norm_rope`), Qwen3 hands it the raw projections. On CPU a stand-in
    for the kernel runs the composition it replaces; the tokens are transformers'."""
    from florist.kernels import decode_attention as da

    calls = []

    def kernel(q, k_cache, v_cache, slots, context_lens, scale, splits=None, counters=None, min_split_keys=None, rope=None):
        assert rope is not None, "the fused path hands its rotary inputs over"
        calls.append(q.shape[0])
        k, v, q_weight, k_weight, eps, cos_sin_cache = rope
        return da.decode_attention_qk_norm_rope_ref(q, k, v, q_weight, k_weight, eps, cos_sin_cache, k_cache, v_cache, slots, context_lens, scale)

    monkeypatch.setattr(da, "qk_norm_rope_applies", lambda *args: True)
    monkeypatch.setattr(da, "decode_attention_triton", kernel)
    greedy_matches_transformers(tied_dir, "triton")
    layers = json.loads((tied_dir / "config.json").read_text())["num_hidden_layers"]
    assert calls and len(calls) % layers == 0  # every layer of every decode step


def greedy_matches_transformers(model_dir, decode_attention: str):
    """A CPU engine with that decode backend generates transformers' greedy tokens for two
    prompts (8 new tokens each); -> (engine, prompts)."""
    engine = florist.Engine.from_pretrained(model_dir, device="cpu", generation=GenerationConfig(decode_attention=decode_attention))
    prompts = prompts_for(model_dir, lens=(5, 17))
    got = [r.token_ids for r in engine.generate(prompts, max_tokens=8)]
    assert got == reference(model_dir, prompts, 8)
    return engine, prompts


def test_incremental_detokenizer_deltas_add_up(tied_dir):
    from tokenizers import Tokenizer

    from florist.engine.generation.detokenizer import IncrementalDetokenizer

    tok = Tokenizer.from_file(str(tied_dir / "tokenizer.json"))
    rng = np.random.default_rng(3)
    for _ in range(20):
        ids = rng.integers(0, tok.get_vocab_size(), size=int(rng.integers(1, 40))).tolist()
        detok = IncrementalDetokenizer(tok)
        pieces, i = [], 0
        while i < len(ids):
            n = int(rng.integers(1, 4))
            pieces.append(detok.push(ids[i : i + n]))
            i += n
        pieces.append(detok.finish())
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    # Byte-level BPE (Qwen's real tokenizers): a character spans tokens, so a delta that would end
    # inside one is held back and finish() flushes what is left.
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    byte_tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    byte_tok.decoder = decoders.ByteLevel()
    text = "naïve café — 你好 🌷 rose"
    ids = [alphabet.index(c) for c in _byte_level(text)]
    for n in (1, 2, 3):
        detok = IncrementalDetokenizer(byte_tok)
        pieces = [detok.push(ids[i : i + n]) for i in range(0, len(ids), n)]
        assert "\ufffd" not in "".join(pieces) and "".join(pieces) + detok.finish() == text
    detok = IncrementalDetokenizer(byte_tok)
    assert [detok.push([alphabet.index(c)]) for c in _byte_level("🌷")] == ["", "", "", "🌷"]
    cut = [alphabet.index(c) for c in _byte_level("rose 🌷")][:-2]  # ends inside the flower
    detok = IncrementalDetokenizer(byte_tok)
    assert detok.push(cut) == "" and detok.finish() == byte_tok.decode(cut) == "rose \ufffd"


def _byte_level(text: str) -> list[str]:
    """The byte-level symbols of text's UTF-8 bytes (GPT-2's byte-to-unicode map)."""
    from tokenizers import pre_tokenizers

    return list("".join(piece for piece, _ in pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)))


def test_decode_runs_the_fused_layers_where_they_apply(tied_dir, monkeypatch):
    """Where the fused decode step applies (the Triton kernel on CUDA), Qwen3 hands it the
    residual stream and the whole layer stack, then applies the final norm. On the CPU a stand-in
    runs the per-layer references over the same stack; the tokens are transformers'. The stack
    is built once, on the first decode step, and a stack that does not fit is not retried."""
    from florist.kernels import decode_layer as dl

    builds, steps = [], []
    build = dl.DecodeStack.build

    def counted_build(*args):
        builds.append(1)
        return build(*args)

    def stand_in(resid, stack, cos_sin, slots, context_lens, scale, config=None, stages_apart=None):
        steps.append(resid.shape[0])
        for w, k, v in zip(stack.layers, stack.k_caches, stack.v_caches):
            resid = dl.qwen3_decode_layer_ref(resid, w, cos_sin, k, v, slots, context_lens, scale)
        return resid

    monkeypatch.setattr(dl.DecodeStack, "build", staticmethod(counted_build))
    monkeypatch.setattr(dl.DecodeStack, "fits", lambda self, resid, cos_sin: True)  # fp32 on the CPU: the kernel would refuse
    monkeypatch.setattr(dl, "applies", lambda *args: True)
    monkeypatch.setattr(dl, "qwen3_decode_layers_triton", stand_in)
    engine, prompts = greedy_matches_transformers(tied_dir, "triton")
    assert steps and len(builds) == 1, (steps, builds)
    # The final norm's weight is all ones here, which leaves the argmax blind to it: with a
    # weight of unequal entries the fused path must still give the unfused path's tokens.
    plain = florist.Engine.from_pretrained(tied_dir, device="cpu", generation=GenerationConfig(decode_attention="torch"))
    for e in (engine, plain):
        norm = e.runner.runner.model.model.norm.weight
        norm.data.copy_(torch.linspace(0.1, 3.0, norm.numel()).flip(0) ** 2)
    got = [r.token_ids for r in engine.generate(prompts, max_tokens=16)]
    assert got == [r.token_ids for r in plain.generate(prompts, max_tokens=16)]

    # A stack that does not fit: the unfused layers run, and the build is not tried again.
    builds.clear()
    steps.clear()
    monkeypatch.setattr(dl.DecodeStack, "fits", lambda self, resid, cos_sin: False)
    greedy_matches_transformers(tied_dir, "triton")
    assert not steps and len(builds) == 1, (steps, builds)
