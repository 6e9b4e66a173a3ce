"""Writes a tiny random Qwen3-MoE checkpoint with a locally trained tokenizer (no hub access).

Sized to serve in seconds on a CPU yet place experts on 1 to 4 ranks with redundancy:
2 layers, 16 routed experts, top-2, hidden 64. Weights come from a fixed seed, so every run
writes the same model. The weights are scaled up so greedy decoding has clear winners: random
tiny models otherwise produce near-ties that flip under a different reduction order.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_NUM_EXPERTS = 16
DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".models" / "tiny-qwen3-moe"

_WORDS = (
    "the a an expert rank shard token router layer cluster server request scale up down "
    "grow shrink join leave recover crash restart serve answer model weight mixture gate "
    "parallel data attention cache memory queue batch prefill decode stream elastic orchestrator "
    "kubernetes operator pod node gpu cpu network transfer buffer dispatch combine placement "
    "balance load latency throughput drain commit phase status event health metric red green "
    "blue one two three four five six seven eight nine ten hello world question reply why how"
).split()

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) for _ in range(lines)]


def write_tiny_model(out_dir: Path = DEFAULT_DIR, seed: int = 0,
                     num_experts: int = DEFAULT_NUM_EXPERTS) -> Path:
    """Write the model to ``out_dir`` (idempotent: an existing complete model is kept)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    out_dir = Path(out_dir)
    marker = out_dir / ".complete"
    if marker.exists() and json.loads(marker.read_text()) == {"seed": seed, "experts": num_experts}:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)

    config = Qwen3MoeConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=num_experts,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.2,
        torch_dtype="float32",
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2 if "gate.weight" not in name else 1.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    marker.write_text(json.dumps({"seed": seed, "experts": num_experts}))
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--experts", type=int, default=16)
    args = parser.parse_args()
    print(write_tiny_model(args.out, args.seed, args.experts))


if __name__ == "__main__":
    main()
