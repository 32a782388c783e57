"""Reusable test builders: tiny random Hugging Face model folders and a minimal paged-KV harness.

`make_tiny_model(tmp_path, "llama", **config_overrides)` writes a complete model folder
(config.json, safetensors weights, tokenizer with a chat template) that both
`transformers.AutoModelForCausalLM` / `AutoTokenizer` and `engine.weights.load_model` can load.
`PagedHarness` plays the model runner: a KV pool, block tables with scattered block ids, and the
AttentionMetadata of one step.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

TINY_VOCAB = 512
# Where the Triton kernels run: compiled on a GPU, else on the CPU under the interpreter (conftest.py)
TRITON_ON: dict[str, str] = dict(device="cuda", dtype="float32") if torch.cuda.is_available() else {}
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# arch -> (transformers config class, small defaults). Every arch has GQA unless overridden.
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        dict(hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5),
    ),
    "mistral": (
        "MistralConfig",
        dict(hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, sliding_window=128),
    ),
    "qwen2": (
        "Qwen2Config",
        dict(hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6),
    ),
    "qwen3": (
        "Qwen3Config",
        dict(hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6),
    ),
    # fused qkv_proj / gate_up_proj in its checkpoints; a window as Phi-3-mini-4k's (2047) has
    "phi3": (
        "Phi3Config",
        dict(hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, sliding_window=64,
             pad_token_id=0),
    ),
    # MQA with head_dim 32 (not hidden/heads), a window of 8 so short prompts outgrow it, 4 layers:
    # Gemma 2 alternates sliding / global; Gemma 3's pattern is given (the default is 5 sliding : 1 global)
    "gemma2": (
        "Gemma2Config",
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=1, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
             sliding_window=8, query_pre_attn_scalar=48, attn_logit_softcapping=0.5,
             final_logit_softcapping=1.0),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=1, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
             sliding_window=8, query_pre_attn_scalar=32,
             layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}),
    ),
    "gpt2": (
        "GPT2Config",
        dict(n_embd=128, n_layer=2, n_head=4, n_positions=256, layer_norm_epsilon=1e-5),
    ),
}


def tiny_tokenizer():
    """A small tokenizer (Unigram: a few words, ASCII, byte fallback) with ChatML special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = [(t, 0.0) for t in specials] + [(f"<0x{b:02X}>", -1000.0) for b in range(256)]
    chars = [chr(c) for c in range(33, 127)]
    vocab += [("\u2581", -10.0)] + [(c, -10.0) for c in chars] + [("\u2581" + c, -10.0) for c in chars]
    words = "the and you that was for are with his they have this from one had word but what".split()
    vocab += [("\u2581" + w, -2.0) for w in words]
    assert len(vocab) <= TINY_VOCAB
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def tiny_config(arch: str, **overrides: Any):
    import transformers

    cls_name, defaults = TINY_CONFIGS[arch]
    kwargs = {"vocab_size": TINY_VOCAB, "bos_token_id": 1, "eos_token_id": 3, **defaults, **overrides}
    return getattr(transformers, cls_name)(**kwargs)


def make_tiny_model(
    path: Path, arch: str, *, seed: int = 0, max_shard_size: str | int | None = None, **overrides: Any
) -> Path:
    """Save a random tiny `arch` model (with tokenizer) into `path`; return `path`.

    Norm weights and biases are randomised too (transformers initialises them to 1 / 0, which
    would hide a missing norm or bias)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and name.endswith("weight"):  # norms
                param.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    model.save_pretrained(path, **kwargs)
    tiny_tokenizer().save_pretrained(path)
    return path


def reference_model(path: Path):
    """The transformers model of a folder, fp32, eager attention, eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@torch.no_grad()
def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), vocab] of one unpadded sequence."""
    return model(torch.tensor([tokens])).logits[0].float()


class PagedHarness:
    """A minimal model runner for tests: owns a KV pool, hands out scattered blocks, builds metadata.

    `step(decodes, prefills)` runs one batch: `decodes` maps seq id -> its next token, `prefills`
    is a list of (seq id, new tokens) (a seq seen before continues after its cached tokens, i.e.
    a chunked prefill). Returns logits [T, vocab] for every new token, decodes first.
    """

    def __init__(self, loaded, *, num_blocks: int = 64, block_size: int = 4, backend: str | None = "torch",
                 seed: int = 0) -> None:
        from engine.attention import AttentionBackend

        param = next(loaded.model.parameters())
        shape = (loaded.num_layers, num_blocks, block_size, loaded.num_kv_heads, loaded.head_dim)
        # NaN-filled: reading a slot that was never written poisons the result
        self.k_cache = torch.full(shape, float("nan"), dtype=param.dtype, device=param.device)
        self.v_cache = torch.full(shape, float("nan"), dtype=param.dtype, device=param.device)
        self.attention = AttentionBackend(self.k_cache, self.v_cache, backend)
        self.model = loaded.model
        self.block_size = block_size
        self.backend = backend
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.device = param.device

    def _append(self, seq: int, n: int) -> list[int]:
        """Reserve n more slots for seq; return their slot ids."""
        table = self.tables.setdefault(seq, [])
        start = self.lens.get(seq, 0)
        slots = []
        for pos in range(start, start + n):
            if pos // self.block_size >= len(table):
                table.append(self.free.pop())
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
        self.lens[seq] = start + n
        return slots

    def _tables(self, seqs: list[int]) -> torch.Tensor:
        width = max([len(self.tables[s]) for s in seqs], default=1)
        rows = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device).reshape(len(seqs), width)

    @torch.no_grad()
    def step(self, decodes: dict[int, int] | None = None, prefills: list[tuple[int, list[int]]] = ()) -> torch.Tensor:
        decodes = decodes or {}
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq, token in decodes.items():
            positions.append(self.lens[seq])
            slots += self._append(seq, 1)
            ids.append(token)
        cu = [0]
        for seq, tokens in prefills:
            start = self.lens.get(seq, 0)
            positions += range(start, start + len(tokens))
            slots += self._append(seq, len(tokens))
            ids += tokens
            cu.append(cu[-1] + len(tokens))
        dev = self.device
        i32 = dict(dtype=torch.int32, device=dev)
        meta = self.attention.metadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_tokens=len(decodes),
            decode_block_tables=self._tables(list(decodes)),
            decode_context_lens=torch.tensor([self.lens[s] for s in decodes], **i32),
            prefill_block_tables=self._tables([s for s, _ in prefills]),
            prefill_cu_seqlens_q=torch.tensor(cu, **i32),
            prefill_context_lens=torch.tensor([self.lens[s] for s, _ in prefills], **i32),
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
        )
        return self.model.compute_logits(hidden)


def drain_checked(engine: Any) -> dict[str, Any]:
    """Step `engine` until every request is done, checking the block manager's invariants after each
    step; the finished outputs by request id."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.block_manager.check_invariants()
    return done
