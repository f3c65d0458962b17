"""Make the tiny model the real-vLLM test serves (issue 25): no hub download is possible here.

A random-weight Llama (transformers' ``LlamaConfig``: 4 layers, hidden 128, 2 heads of 64, seed
fixed) and a byte-level BPE tokenizer trained with ``tokenizers`` on the repository's README,
saved with a chat template so ``/v1/chat/completions`` works. Deterministic: the same inputs
give the same files, so the directory is cached under a key of this file's and the README's
contents (scripts/test-real-vllm.sh).

The weights are drawn with a larger spread than a trained model's initialisation
(``initializer_range``): a freshly initialised model's greedy answer barely depends on its
context, and the test needs the opposite — an answer decoded from another prompt's KV blocks
must come out different, or a wrong read would pass unseen. The harness checks that property
on every run (distinct answers for prompts that differ only in their first blocks).

Usage: python make_model.py OUT_DIR TEXT_FILE
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 2048
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-character map, which the ByteLevel pre-tokenizer uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return chars


_BYTE_CHAR = _byte_chars()


def make_tokenizer(out: Path, text: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Printable ASCII, tab and newline only: every token decodes to whole characters, so a
    # streamed answer's chunks add up to the non-streamed text exactly (a byte-level token of
    # half a UTF-8 character would be held back or replaced differently by the two paths).
    text = "".join(c for c in text if c in "\t\n" or " " <= c <= "~")
    alphabet = [_BYTE_CHAR[b] for b in (9, 10, *range(32, 127))]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 8192
    fast.save_pretrained(out)


def make_model(out: Path, vocab_size: int, bos: int, eos: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(25)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    # No sampling defaults from the model: requests say temperature 0 themselves.
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    out, text_file = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out, text_file.read_text(encoding="utf-8"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    make_model(out, len(tok), tok.bos_token_id, tok.eos_token_id)
    print(f"tiny model in {out}: vocab {len(tok)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
