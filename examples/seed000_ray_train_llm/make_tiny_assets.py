"""Build the offline stand-ins for the document's model and data set: a tiny Qwen2 and its tokenizer.

The document fine-tunes `Qwen/Qwen2.5-3B` on `tatsu-lab/alpaca`, both downloaded from the Hugging Face
Hub. A machine without internet (CI, an air-gapped cluster) cannot, so this script writes, into one
folder, what `train_ray.py` loads with the very same calls:

- `instructions.jsonl`: the small Alpaca-format data set this example ships (`data/`), for
  `load_dataset("json", data_files=...)`;
- `tiny-qwen2/`: a byte-level BPE tokenizer trained on that data with `tokenizers`, and a causal LM of
  the same family (a `Qwen2Config` with tiny sizes, random weights from a fixed seed), for
  `AutoTokenizer.from_pretrained` / `AutoModelForCausalLM.from_pretrained`.

Every node may run it at once into the same folder (nodes of one machine): it builds into a private
folder and renames it into place, so readers never see half-written files. Same seed, same files.

    python make_tiny_assets.py --out /tmp/seed000-assets          # then MODEL_NAME / DATASET_NAME below
    python make_tiny_assets.py --write-data data/instructions.jsonl  # regenerate the shipped data set
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIPPED_DATA = HERE / "data" / "instructions.jsonl"
MODEL_DIR = "tiny-qwen2"
DATA_FILE = "instructions.jsonl"
#: Qwen2's own special tokens: its tokenizer's eos and pad token is <|endoftext|>.
EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]

WORDS = ["cat", "river", "planet", "garden", "silver", "window", "orange", "forest", "rocket", "piano",
         "candle", "mirror", "island", "bridge", "pencil", "thunder"]


def instruction_rows(n: int = 96, seed: int = 0) -> list[dict[str, str]]:
    """A small Alpaca-format data set (instruction, input, output) a tiny model can learn quickly."""
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    for i in range(n):
        kind = i % 6
        word = rng.choice(WORDS)
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        if kind == 0:
            rows.append({"instruction": f"Add {a} and {b}.", "input": "", "output": f"{a} + {b} = {a + b}."})
        elif kind == 1:
            rows.append({"instruction": f'Reverse the word "{word}".', "input": "", "output": word[::-1]})
        elif kind == 2:
            rows.append({"instruction": "Write the word in capital letters.", "input": word, "output": word.upper()})
        elif kind == 3:
            nums = [rng.randint(1, 99) for _ in range(4)]
            rows.append({"instruction": "Sort these numbers from smallest to largest.",
                         "input": ", ".join(map(str, nums)), "output": ", ".join(map(str, sorted(nums)))})
        elif kind == 4:
            rows.append({"instruction": "How many letters does this word have?", "input": word,
                         "output": f'"{word}" has {len(word)} letters.'})
        else:
            rows.append({"instruction": f"Is {a} larger than {b}?", "input": "",
                         "output": f"{'Yes' if a > b else 'No'}, {a} is {'larger' if a > b else 'not larger'} than {b}."})
    return rows


def write_jsonl(rows: list[dict[str, str]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def read_jsonl(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def training_texts(rows: list[dict[str, str]]) -> list[str]:
    """The texts `train_ray.py` formats (same prompt template), so the tokenizer covers them well."""
    texts = []
    for row in rows:
        prompt = f"### Instruction:\n{row['instruction']}\n\n"
        if row.get("input"):
            prompt += f"### Input:\n{row['input']}\n\n"
        texts.append(f"{prompt}### Response:\n{row['output']}")
    return texts


def build_tokenizer(texts: list[str], vocab_size: int, out: Path) -> int:
    """Train a byte-level BPE (Qwen2's tokenizer kind) and save it for AutoTokenizer; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS,
                                   model_max_length=4096)
    fast.save_pretrained(out)
    return len(fast)


def build_model(vocab_size: int, eos_id: int, out: Path, *, hidden: int, layers: int, seed: int) -> int:
    """A randomly initialised Qwen2ForCausalLM of tiny size, saved as safetensors; returns its parameters."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def build_assets(out: Path, *, vocab_size: int = 320, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """Write `out/instructions.jsonl` and `out/tiny-qwen2/` unless they are there already; returns `out`."""
    out = out.resolve()
    if (out / MODEL_DIR / "config.json").exists() and (out / DATA_FILE).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        rows = read_jsonl(SHIPPED_DATA) if SHIPPED_DATA.exists() else instruction_rows()
        write_jsonl(rows, staging / DATA_FILE)
        size = build_tokenizer(training_texts(rows), vocab_size, staging / MODEL_DIR)
        from transformers import AutoTokenizer

        eos_id = AutoTokenizer.from_pretrained(staging / MODEL_DIR).eos_token_id
        params = build_model(size, eos_id, staging / MODEL_DIR, hidden=hidden, layers=layers, seed=seed)
        staging.chmod(0o755)  # mkdtemp makes it private; the result is for every process of the node
        try:
            staging.rename(out)  # atomic; fails if another node got there first, which is fine
        except OSError:
            if not (out / MODEL_DIR / "config.json").exists():
                raise
        else:
            print(f"built {out}: Qwen2 with {params:,} parameters, vocab {size}, {len(rows)} instructions")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder to write instructions.jsonl and tiny-qwen2/ into")
    parser.add_argument("--write-data", type=Path, help="regenerate the shipped data set at this path")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    if args.write_data:
        write_jsonl(instruction_rows(), args.write_data)
    if args.out:
        build_assets(args.out, hidden=args.hidden, layers=args.layers)
    if not (args.out or args.write_data):
        parser.error("nothing to do: give --out and/or --write-data")


if __name__ == "__main__":
    main()
