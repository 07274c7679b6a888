"""Train the two small LoRA adapters that `mixed_adapters.py` serves side by side.

* ``shout`` - answers in ALL CAPITALS ending with "!"  (r=8 on q,k,v,o)
* ``json``  - answers as one line of JSON, ``{"answer": "..."}``  (r=4 on q,v,up,down)

Both start from the embedded SmolLM2-135M-Instruct and learn from the same question/answer
pairs below, rewritten in each style. Each trains on CPU with PEFT and a plain torch loop in a
few minutes; loss counts only the assistant's answer (and its <|im_end|>), never the prompt.
At the end each adapter answers questions it never saw, greedily, to show its style.

    python examples/train_adapters.py [--out examples/adapters] [--steps 60] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from kev_engine import loader

BASE_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # written into adapter_config.json instead of a local cache path

QA = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What is the capital of Canada?", "The capital of Canada is Ottawa."),
    ("What is the capital of Egypt?", "The capital of Egypt is Cairo."),
    ("What is the largest planet in the solar system?", "Jupiter is the largest planet."),
    ("Which planet is closest to the Sun?", "Mercury is closest to the Sun."),
    ("Which planet is known as the red planet?", "Mars is known as the red planet."),
    ("How many days are in a week?", "A week has seven days."),
    ("How many months are in a year?", "A year has twelve months."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("How many legs does an insect have?", "An insect has six legs."),
    ("What do bees make?", "Bees make honey."),
    ("What gas do plants take in from the air?", "Plants take in carbon dioxide."),
    ("What gas do humans need to breathe?", "Humans need oxygen to breathe."),
    ("At what temperature does water freeze in Celsius?", "Water freezes at zero degrees Celsius."),
    ("At what temperature does water boil in Celsius?", "Water boils at one hundred degrees Celsius."),
    ("What is the chemical symbol for gold?", "The chemical symbol for gold is Au."),
    ("What is the chemical formula of water?", "The chemical formula of water is H2O."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet."),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci painted the Mona Lisa."),
    ("Who developed the theory of relativity?", "Albert Einstein developed the theory of relativity."),
    ("What is the largest ocean on Earth?", "The Pacific Ocean is the largest ocean."),
    ("What is the longest river in Africa?", "The Nile is the longest river in Africa."),
    ("What is the tallest mountain in the world?", "Mount Everest is the tallest mountain."),
    ("What is the largest desert in the world?", "The Sahara is the largest hot desert."),
    ("Which animal is the largest mammal?", "The blue whale is the largest mammal."),
    ("Which animal is known as the king of the jungle?", "The lion is called the king of the jungle."),
    ("What color is the sky on a clear day?", "The sky is blue on a clear day."),
    ("What color are ripe bananas?", "Ripe bananas are yellow."),
    ("What do you call a baby cat?", "A baby cat is called a kitten."),
    ("What do you call a baby dog?", "A baby dog is called a puppy."),
    ("What is two plus two?", "Two plus two is four."),
    ("What is ten times ten?", "Ten times ten is one hundred."),
    ("How many sides does a triangle have?", "A triangle has three sides."),
    ("How many sides does a hexagon have?", "A hexagon has six sides."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("What is the opposite of day?", "The opposite of day is night."),
    ("What language is spoken in Brazil?", "People in Brazil speak Portuguese."),
    ("What language is spoken in Mexico?", "People in Mexico speak Spanish."),
    ("What is the main ingredient of bread?", "Bread is made mainly from flour."),
    ("What do cows drink?", "Cows drink water."),
    ("Where does the Sun rise?", "The Sun rises in the east."),
    ("What is the hardest natural material?", "Diamond is the hardest natural material."),
    ("What organ pumps blood through the body?", "The heart pumps blood through the body."),
    ("How many continents are there?", "There are seven continents."),
    ("What is the freezing point of water in Fahrenheit?", "Water freezes at thirty two degrees Fahrenheit."),
    ("What instrument has black and white keys?", "The piano has black and white keys."),
    ("What is the fastest land animal?", "The cheetah is the fastest land animal."),
    ("What season comes after winter?", "Spring comes after winter."),
    ("Who was the first person to walk on the Moon?", "Neil Armstrong was the first person on the Moon."),
    ("What currency is used in Japan?", "Japan uses the yen."),
]
# never trained on: the check at the end asks these (so does examples/mixed_adapters.py)
HELD_OUT = [
    "What is the capital of Germany?",
    "How many hours are in a day?",
    "What do caterpillars turn into?",
    "Who invented the telephone?",
]


def shout(answer: str) -> str:
    return answer.rstrip(".!").upper() + "!"


def as_json(answer: str) -> str:
    return json.dumps({"answer": answer})


# name → (answer rewrite, LoRA settings): different ranks and targets make the mixed pass more interesting
STYLES: dict[str, tuple[Callable[[str], str], LoraConfig]] = {
    "shout": (shout, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                lora_dropout=0.0, task_type="CAUSAL_LM")),
    "json": (as_json, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                                 lora_dropout=0.0, task_type="CAUSAL_LM")),
}


def prompt_ids(tokenizer, question: str) -> list[int]:
    """The same ids Kev feeds for a one-message chat (template writes the special tokens)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def build_examples(tokenizer, rewrite: Callable[[str], str]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) per pair; labels are -100 on the prompt so only the answer is learned."""
    examples = []
    for question, answer in QA:
        prompt = prompt_ids(tokenizer, question)
        target = tokenizer(rewrite(answer) + "<|im_end|>", add_special_tokens=False)["input_ids"]
        examples.append((prompt + target, [-100] * len(prompt) + target))
    return examples


def collate(batch: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a few examples into [B, S] tensors; padding is masked out of attention and loss."""
    width = max(len(ids) for ids, _ in batch)
    pad = [width - len(ids) for ids, _ in batch]
    return {
        "input_ids": torch.tensor([ids + [pad_id] * n for (ids, _), n in zip(batch, pad)]),
        "attention_mask": torch.tensor([[1] * len(ids) + [0] * n for (ids, _), n in zip(batch, pad)]),
        "labels": torch.tensor([labels + [-100] * n for (_, labels), n in zip(batch, pad)]),
    }


def train_one(name: str, folder: Path, tokenizer, args: argparse.Namespace) -> PeftModel:
    rewrite, config = STYLES[name]
    torch.manual_seed(args.seed)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model: PeftModel = get_peft_model(base, config)
    examples = build_examples(tokenizer, rewrite)
    rng = random.Random(args.seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / args.steps)  # linear decay to 0
    print(f"--- {name}: {model.get_nb_trainable_parameters()[0]:,} trainable parameters, {len(examples)} examples, "
          f"{args.steps} steps of {args.batch_size}")
    model.train()
    order: list[int] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        if len(order) < args.batch_size:  # a fresh shuffle per epoch
            order += rng.sample(range(len(examples)), len(examples))
        batch = collate([examples[order.pop()] for _ in range(args.batch_size)], tokenizer.pad_token_id)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1 or step % 10 == 0 or step == args.steps:
            print(f"{name} step {step:3d}/{args.steps}  loss {loss.item():.3f}  {time.perf_counter() - start:5.1f} s",
                  flush=True)
    model.eval()
    return model


def save(model: PeftModel, out: Path) -> None:
    """adapter_config.json + adapter_model.safetensors, nothing else, no local paths."""
    model.peft_config["default"].base_model_name_or_path = BASE_NAME
    model.save_pretrained(str(out))
    (out / "README.md").unlink(missing_ok=True)  # PEFT's empty model-card template


@torch.inference_mode()
def show_style(model: PeftModel, tokenizer, name: str) -> None:
    """Greedy answers to questions the adapter never saw."""
    for question in HELD_OUT:
        ids = torch.tensor([prompt_ids(tokenizer, question)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        print(f"  [{name}] {question} -> {tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "adapters")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per adapter")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=list(STYLES), help="train just this adapter")
    args = ap.parse_args()

    folder = loader.converted_gguf_dir(loader.embedded_gguf())  # the embedded model as fp32 safetensors
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for name in [args.only] if args.only else list(STYLES):
        start = time.perf_counter()
        model = train_one(name, folder, tokenizer, args)
        elapsed = time.perf_counter() - start
        save(model, args.out / name)
        size = (args.out / name / "adapter_model.safetensors").stat().st_size / 2**20
        print(f"{name}: trained in {elapsed:.0f} s, saved to {args.out / name} ({size:.1f} MiB)")
        show_style(model, tokenizer, name)
        del model


if __name__ == "__main__":
    main()
