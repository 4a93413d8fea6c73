"""Train one demo LoRA adapter for SmolLM2-135M-Instruct on CPU, and write its held-out eval set.

    python examples/train_adapter.py sql-employees [--steps 160] [--out lorafleet/demo_adapters]

Data is generated here (examples/tasks.py), seeded; the eval set uses another seed and every
eval prompt is removed from the training data. Loss is on the assistant reply only, with the
same chat template the worker applies, so the adapter learns exactly what serving will ask.
"""

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from tasks import TASKS, Task

from services.worker.engine.model_loader import load_model

TRAIN_SEED, EVAL_SEED = 0, 1
EVAL_ITEMS = 16
MODULES = ("q_proj", "v_proj", "o_proj")


def eval_set(task: Task) -> list[tuple[str, str]]:
    rng, items, seen = random.Random(EVAL_SEED), [], set()
    while len(items) < EVAL_ITEMS:
        prompt, answer = task.held_out(rng)
        if prompt not in seen:
            seen.add(prompt)
            items.append((prompt, answer))
    return items


def train_set(task: Task, size: int, held_out: set[str]) -> list[tuple[str, str]]:
    """``size`` distinct training pairs, none of whose prompts is in the eval set."""
    rng, items = random.Random(TRAIN_SEED), {}
    while len(items) < size:
        prompt, answer = task.train(rng)
        if prompt not in held_out:
            items[prompt] = answer
    return list(items.items())


def encode(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids of the whole chat and next-token labels: -100 except where the reply (and its end) follows."""
    user = [{"role": "user", "content": prompt}]
    head = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template([*user, {"role": "assistant", "content": answer}], tokenize=False)
    head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    ids = tokenizer(full.rstrip("\n"), add_special_tokens=False)["input_ids"]
    assert ids[: len(head_ids)] == head_ids
    return ids, [-100] * (len(head_ids) - 1) + ids[len(head_ids) :] + [-100]


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    """Right-padding: with causal attention no real token ever sees a pad, so no mask is needed."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def _layers(inner, h: torch.Tensor, layers) -> torch.Tensor:
    positions = torch.arange(h.shape[1]).unsqueeze(0)
    embeddings = inner.rotary_emb(h, position_ids=positions)
    for layer in layers:
        h = layer(h, position_embeddings=embeddings, position_ids=positions)
    return h


def train(task: Task, out: Path, steps: int, batch: int, lr: float, examples: int, top_layers: int) -> float:
    """LoRA on the top ``top_layers`` layers only: the frozen layers below run once per example (cached)."""
    torch.manual_seed(TRAIN_SEED)
    loaded = load_model()
    held_out = eval_set(task)
    data = [encode(loaded.tokenizer, p, a) for p, a in train_set(task, examples, {p for p, _ in held_out})]
    num_layers = loaded.model.config.num_hidden_layers
    first = num_layers - top_layers
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=list(MODULES),
        task_type="CAUSAL_LM",
        layers_to_transform=list(range(first, num_layers)),
    )
    model = get_peft_model(loaded.model, config)
    inner, head = model.base_model.model.model, model.base_model.model.lm_head
    start = time.perf_counter()
    cached = []
    with torch.no_grad():
        for i in range(0, len(data), 16):
            chunk = [torch.tensor(ids) for ids, _ in data[i : i + 16]]
            h = _layers(inner, inner.embed_tokens(_pad(chunk)), inner.layers[:first])
            cached += [row[: len(ids)] for row, ids in zip(h, chunk, strict=True)]
    print(f"{task.name}: cached layer-{first} states of {len(data)} examples ({time.perf_counter() - start:.0f}s)")
    labels = [torch.tensor(y) for _, y in data]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 8) * (1 - s / steps))
    order = random.Random(TRAIN_SEED)
    for step in range(steps):
        pick = order.sample(range(len(data)), batch)
        h = _layers(inner, _pad([cached[i] for i in pick]), inner.layers[first:])
        target = _pad([labels[i] + 100 for i in pick]) - 100  # pads become -100: ignored
        keep = target != -100
        loss = torch.nn.functional.cross_entropy(head(inner.norm(h[keep])), target[keep])
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == steps - 1:
            print(f"{task.name} step {step:4d} loss {loss.item():.4f} ({time.perf_counter() - start:.0f}s)", flush=True)
    elapsed = time.perf_counter() - start
    save(model, out / task.name / "adapter", num_layers)
    write_eval(task, held_out, out / task.name / "eval.jsonl")
    return elapsed


def save(model, target: Path, num_layers: int) -> None:
    """A plain PEFT adapter over every layer (zeros below the trained ones) in fp16, under 2 MB."""
    model.save_pretrained(target)
    (target / "README.md").unlink(
        missing_ok=True
    )  # peft's empty model card; lorafleet/demo_adapters/README.md documents them
    weights = target / "adapter_model.safetensors"
    tensors = {k: v.half().contiguous() for k, v in load_file(weights).items()}
    for key in list(tensors):
        for layer in range(num_layers):
            other = re.sub(r"layers\.\d+\.", f"layers.{layer}.", key)
            tensors.setdefault(other, torch.zeros_like(tensors[key]))
    save_file(dict(sorted(tensors.items())), weights)
    weights.chmod(0o644)
    config_path = target / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config.update(layers_to_transform=None, layers_pattern=None, base_model_name_or_path="SmolLM2-135M-Instruct")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_eval(task: Task, held_out: list[tuple[str, str]], path: Path) -> None:
    with open(path, "w") as f:
        f.write(json.dumps({"meta": {"adapter": task.name, "scorer": task.scorer, "threshold": task.threshold}}) + "\n")
        for prompt, answer in held_out:
            item = {
                "messages": [{"role": "user", "content": prompt}],
                "expected": task.expected(answer),
                "scorer": task.scorer,
            }
            f.write(json.dumps(item) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "lorafleet" / "demo_adapters")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--examples", type=int, default=96, help="distinct training pairs")
    parser.add_argument("--top-layers", type=int, default=6, help="layers that get LoRA, counted from the top")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    elapsed = train(TASKS[args.task], args.out, args.steps, args.batch, args.lr, args.examples, args.top_layers)
    print(f"{args.task}: trained {args.steps} steps in {elapsed:.0f}s -> {args.out / args.task}/adapter")


if __name__ == "__main__":
    main()
