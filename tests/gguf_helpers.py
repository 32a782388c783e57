"""Small GGUF files for tests, written with the `gguf` package's writer the way llama.cpp's
converter writes them: tensor names from gguf's TensorNameMap, Llama q/k rows permuted, a
byte-level BPE tokenizer (tokens, merges, token types), ChatML template, optional sampling keys.

`gguf.quants.quantize` covers F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0; K-quant tensors
(Q4_K, Q5_K, Q6_K) are written as random blocks with small, finite scales.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.helpers import CHAT_TEMPLATE, tiny_config

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = (
    "the cat sat on the mat. the dog ran to the river with his friend. what is the capital of france? "
    "paris is the capital of france. you are a helpful assistant. hello there, how are you today? "
    "system user assistant: be brief and kind. one two three four five six seven eight nine ten. "
)
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gpt2": "gpt2",
             "gemma2": "gemma2", "gemma3": "gemma3"}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
NO_KERNEL = ("Q2_K", "Q3_K")  # K-quants without a kernel of ours (random blocks too)


def bpe_tokenizer():
    """A byte-level BPE tokenizer trained on CORPUS: deterministic, about 400 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 4, trainer)
    return tok


def _k_quant_blocks(rows: int, cols: int, qtype: Any, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (256 weights each) whose fp16 scales are small and finite."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    if qtype.name == "Q6_K":  # ql, qh, int8 scales, then d
        data[..., 208:210] = np.frombuffer(np.float16(2e-5).tobytes(), np.uint8)
    elif qtype.name == "Q3_K":  # hmask, qs, 6-bit scales, then d
        data[..., 108:110] = np.frombuffer(np.float16(2e-4).tobytes(), np.uint8)
    elif qtype.name == "Q2_K":  # 4-bit scales and mins, qs, then d and dmin
        data[..., 80:82] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
        data[..., 82:84] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    else:  # d, dmin, 6-bit scales and mins, (qh,) qs
        data[..., 0:2] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
        data[..., 2:4] = np.frombuffer(np.float16(5e-4).tobytes(), np.uint8)
    return data.reshape(rows, -1)


def write_gguf(
    path: Path,
    arch: str,
    *,
    qtype: str = "F32",
    embed_qtype: str | None = None,
    tie: bool = True,
    sampling: dict[str, float] | None = None,
    seed: int = 0,
    tensor_qtypes: dict[str, str] | None = None,
    general_name: str | None = None,
    **config_overrides: Any,
):
    """Write a random tiny `arch` model as GGUF at `path`; return the transformers model it came from.

    Matrices get `qtype` (`embed_qtype` for the token embedding; `tensor_qtypes` by GGUF tensor kind,
    as {"attn_v": "Q6_K"}: a Q4_K_M-like mix); norms and biases stay F32, as in llama.cpp's files.
    `tie=True` writes no output.weight (the real SmolLM2 file has none). `general_name`:
    general.name (tiny-ARCH by default)."""
    import gguf
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    tok = bpe_tokenizer()
    config = tiny_config(arch, vocab_size=tok.get_vocab_size(), tie_word_embeddings=tie,
                         bos_token_id=0, eos_token_id=2, **config_overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and name.endswith("weight"):
                param.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)

    g_arch = GGUF_ARCH[arch]
    writer = gguf.GGUFWriter(path, g_arch)
    n_layers = config.num_hidden_layers
    writer.add_name(general_name or f"tiny-{arch}")
    writer.add_block_count(n_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    if arch == "gpt2":
        writer.add_feed_forward_length(4 * config.hidden_size)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        if g_arch.startswith("gemma"):
            _gemma_keys(writer, config)
        else:
            writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        if g_arch in ("llama", "phi3"):
            writer.add_rope_dimension_count(head_dim)
        if g_arch == "phi3" and config.sliding_window:  # as llama.cpp's Phi3MiniModel converter
            writer.add_sliding_window(config.sliding_window)
    for key, value in (sampling or {}).items():
        writer.add_float32(f"general.sampling.{key}", value)

    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    merges = tok.to_str()  # the trained merges, in priority order
    import json

    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m
                             for m in json.loads(merges)["model"]["merges"]])
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    writer.add_chat_template(CHAT_TEMPLATE)

    name_map = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[g_arch], n_layers)
    for hf_name, param in model.state_dict().items():
        if hf_name == "lm_head.weight" and tie:
            continue
        if hf_name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        data = param.detach().numpy().astype(np.float32)
        if arch == "gpt2" and hf_name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            data = data.T.copy()  # Conv1D [in, out] -> [out, in], as llama.cpp's converter does
        if g_arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k") and data.ndim == 2:
            from engine.weights.gguf import permute_qk

            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            data = permute_qk(data, heads)
        if g_arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp stores Gemma's norms as the 1 + w they multiply by
        chosen = embed_qtype if name == "token_embd.weight" and embed_qtype else qtype
        chosen = (tensor_qtypes or {}).get(name.split(".")[-2], chosen)
        _add(writer, name, data, chosen if data.ndim == 2 else "F32", rng)
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "llama3":  # llama.cpp stores Llama 3 scaling as per-frequency divisors
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
        dim = config.hidden_size // config.num_attention_heads
        plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        writer.add_tensor("rope_freqs.weight", (plain / scaled).numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, tok


def _gemma_keys(writer: Any, config: Any) -> None:
    """The keys llama.cpp's Gemma2Model / Gemma3Model converters write (neither stores
    query_pre_attn_scalar: llama.cpp takes head_dim). The sliding-window pattern, which llama.cpp
    fixes per architecture (2, 6), is written only where the config departs from it."""
    import gguf

    writer.add_sliding_window(config.sliding_window)
    if config.model_type == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        every = 2
    else:
        full = config.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
        every = 6
    sliding = [t == "sliding_attention" for t in config.layer_types]
    if sliding != [(i + 1) % every != 0 for i in range(config.num_hidden_layers)]:
        writer.add_sliding_window_pattern(sliding)


def _add(writer: Any, name: str, data: np.ndarray, qtype: str, rng: np.random.Generator) -> None:
    import gguf

    q = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        writer.add_tensor(name, data)
    elif qtype in K_QUANTS + NO_KERNEL:
        rows, cols = data.shape
        writer.add_tensor(name, _k_quant_blocks(rows, cols, q, rng), raw_dtype=q)
    else:
        packed = gguf.quants.quantize(data, q)
        writer.add_tensor(name, packed, raw_dtype=q)


def write_typed(path: Path, qtype: str, arch: str = "llama") -> None:
    """A header of `arch` and one token embedding of `qtype` (zero blocks: only its type is read)."""
    import gguf

    q = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[q]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64 // block * size), np.uint8), raw_dtype=q)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def transformers_from_gguf(path: Path):
    """transformers' own load of the same file (fp32, eager attention), the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()
